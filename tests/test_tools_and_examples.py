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


def test_zero3_activations_summary_takes_each_configurations_median():
    # tools/zero3_activations.py: rounds of the same configuration reduce to their median.
    from zero3_activations import summary

    row = dict(first_s=1.0, step_ms=10.0, allocator_peak=100, growth=200)
    rows = [dict(row, config="kept"), dict(row, config="kept", step_ms=30.0),
            dict(row, config="kept", step_ms=20.0), dict(row, config="checkpointed")]
    table = summary(rows)
    assert list(table) == ["kept", "checkpointed"]
    assert table["kept"]["step_ms"] == 20.0 and table["checkpointed"]["growth"] == 200


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


def test_bench_restart_parses_xla_timers_and_splits_a_restart_into_phases():
    # tools/bench_restart.py: TensorFlow's own XLA timer lines (as TF 2.21 writes them with
    # TF_CPP_VMODULE=device_compiler=2,device_executable_persistor=2), the phases of one
    # worker's restarted attempt, the medians and the 20% verdict. Pure: no job is run.
    from bench_restart import parse_xla_log, phases_of, summarize, verdict

    sig = "__inference_one_step_on_data_131674"
    log = "\n".join([
        "I0000 00:00:100.000000    1 device_compiler.h:551] Instantly compiling for signature: " + sig,
        "I0000 00:00:100.300000    1 device_executable_persistor.h:360] Try loading serialized "
        "cache entry:" + sig + "[],float [64] time: 100 ms (100000 us) (cumulative: 100 ms)",
        "E0000 00:00:100.310000    1 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result.",
        "I0000 00:00:100.320000    1 device_executable_persistor.h:371] Loading cached entry for: " + sig,
        "I0000 00:00:100.400000    1 device_compiler.h:538] Compilation of XLA executable time: "
        "400 ms (400000 us) (cumulative: 400 ms, max: 400 ms, #called: 1)",
        "I0000 00:00:100.500000    1 device_compiler.h:562] Already Compiled for signature: " + sig,
        "I0000 00:00:200.000000    1 device_compiler.h:551] Instantly compiling for signature: f_2",
        "I0000 00:00:205.000000    1 device_executable_persistor.h:386] Not persisting executable.",
        "I0000 00:00:205.000000    1 device_compiler.h:538] Compilation of XLA executable time: "
        "5.00 s (5000000 us) (cumulative: 5.4 s, max: 5 s, #called: 2)",
    ])
    warm, cold = parse_xla_log(log)
    assert warm["signature"] == sig and warm["loaded"] and warm["seconds"] == 0.4
    assert warm["tf2xla"] == pytest.approx(0.2) and warm["end"] == 100.4
    assert not cold["loaded"] and cold["tf2xla"] is None and cold["seconds"] == 5.0

    events = {"proc_start": 10.0, "top": 10.1, "imported_tfdp": 10.2, "imported_tensorflow": 12.0,
              "imported_keras": 13.0, "imports": 14.0, "cluster": 15.0, "built": 16.0,
              "restored": 99.0, "steps": [101.0, 101.5, 101.6, 101.7, 101.8]}
    p = phases_of(events, [warm, cold], kill=9.0)
    assert p["relaunch"] == pytest.approx(1.0) and p["imports"] == pytest.approx(3.9)
    assert p["import_tensorflow"] == pytest.approx(1.8) and p["restore"] == pytest.approx(83.0)
    assert p["compile"] == 0.4 and p["clusters"] == 1 and p["loaded"]  # cold ended after the step
    assert p["tf2xla"] == pytest.approx(0.2) and p["xla_compile_or_load"] == pytest.approx(0.2)
    assert p["trace_run"] == pytest.approx(1.6) and p["steady_step"] == pytest.approx(0.1)
    assert p["total"] == pytest.approx(92.0)
    parts = ("relaunch", "interpreter", "imports", "cluster", "build", "restore", "trace_run",
             "tf2xla", "xla_compile_or_load")
    assert sum(p[k] for k in parts) == pytest.approx(p["total"])  # the stack adds up

    rows = [dict(model="m", mode="warm", round=r, worker=w, compile=c, loaded=True)
            for r, w, c in ((1, 0, 0.4), (1, 1, 0.6), (2, 0, 0.5))]
    assert summarize(rows)[("m", "warm")] == {"compile": 0.5, "n": 3, "all_loaded": True}
    assert verdict(0.5, 5.0, 0.2)[:2] == (pytest.approx(0.1), True)
    ratio, met, said = verdict(1.5, 5.0, 0.2)
    assert not met and "missed by 10.0%" in said
