"""Formulas used by the tools (tools/collective_math.py, imported through pytest's pythonpath;
no tool is run here), and a smoke run of the main example."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ring_allreduce_alpha_beta_model():
    import collective_math as sm
    assert sm.ring_allreduce_seconds(1, 1e9, 1e-5, 1e9) == 0.0
    # 2(n-1) latency hops + 2(n-1)/n of the bytes over the link.
    assert sm.ring_allreduce_seconds(4, 4e9, 1e-3, 2e9) == pytest.approx(6e-3 + 1.5 * 2.0)
    assert sm.efficiency(1.0, 0.5, overlap=0.0) == pytest.approx(1 / 1.5)
    assert sm.efficiency(1.0, 0.5, overlap=0.5) == pytest.approx(1.0)


def test_nccl_tests_bus_bandwidth_factors():
    import collective_math as ba
    assert ba.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert ba.bus_factor("tf_all_reduce", 8) == pytest.approx(1.75)
    assert ba.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert ba.bus_factor("all_gather", 2) == pytest.approx(0.5)


@pytest.mark.slow
def test_keras_fit_example_trains_to_a_reported_accuracy():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "keras_fit.py"),
                           "--epochs", "8", "--replicas", "2", "--min_accuracy", "0.85"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test accuracy:" in proc.stdout and "samples/s" in proc.stdout


def test_soak_outcomes_and_summary():
    # tools/soak_jobs.py: a run past its timeout is hung whatever its code; a non-zero exit or
    # a check that found a difference is failed; only a clean exit with its check passed ended.
    from soak_jobs import outcome_of, summarize

    assert outcome_of(None, True, None) == "hung"
    assert outcome_of(1, False, None) == "failed"
    assert outcome_of(0, False, "rank 1 weight 0 is 1e-3 off one process") == "failed"
    assert outcome_of(0, False, None) == "ended"
    table = summarize([{"job": "a", "outcome": "ended", "seconds": 3.0},
                       {"job": "a", "outcome": "hung", "seconds": 240.0},
                       {"job": "b", "outcome": "failed", "seconds": 1.0}])
    assert table["a"] == {"ended": 1, "failed": 0, "hung": 1, "runs": 2, "seconds": [3.0]}
    assert table["b"]["failed"] == 1 and table["b"]["seconds"] == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_soak_tool_runs_a_job_and_its_check(tmp_path):
    # One run of the Horovod fit job with its weight check, no added load.
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "soak_jobs.py"),
                          "--jobs=hvd_fit", "--runs=1", "--busy=0", f"--out={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hvd_fit run 0: ended" in out.stdout, out.stdout[-3000:]
    assert (tmp_path / "soak.png").exists() and (tmp_path / "soak.json").exists()
