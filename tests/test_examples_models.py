"""The model examples run and learn (issue 41, part 4): examples/kerashub_causal_lm.py (a
KerasHub GPT-2 on the standard library's sources) and examples/recommender.py (a DLRM-style
model on synthetic clicks), each with small flags on 2 CPU replicas, the recommender also on
2 workers x 2 replicas through tfdp-run. Each example checks its own result (--max_final_loss,
--min_auc) and exits non-zero below it; the tests also read what it printed."""

import importlib.util
import os
import re
import sys

import pytest

from launching import ROOT, run_job, tfdp_run_command
from output_checks import noise_lines

pytestmark = pytest.mark.slow  # each starts TensorFlow in a fresh process and trains

TIMEOUT = 240  # seconds; the runs take 15-40 s alone on the 2-core host


def _env():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the examples set what they need themselves
    # What the examples print is judged: the interpreter's full exit, as a user's run has it
    # (tests/hidden_imports/sitecustomize.py).
    env["TFDP_TEST_FULL_FINALIZATION"] = "1"
    return env


def _number(pattern, out):
    found = re.search(pattern, out)
    assert found, f"{pattern!r} not in the output:\n{out}"
    return float(found.group(1))


@pytest.mark.skipif(importlib.util.find_spec("keras_hub") is None,
                    reason="keras-hub is installed by the README's test command "
                           "(pip install --no-deps keras-hub==0.32.0)")
def test_kerashub_causal_lm_example_learns_the_standard_library():
    code, out = run_job([sys.executable, "examples/kerashub_causal_lm.py", "--replicas", "2",
                         "--steps", "120", "--log_every", "40", "--files", "8",
                         "--eval_batches", "4", "--max_final_loss", "3.8"],
                        _env(), TIMEOUT, cwd=ROOT)
    assert code == 0, out
    before = _number(r"held-out loss before training: (\d+\.\d+)", out)
    after = _number(r"held-out loss: (\d+\.\d+)", out)
    assert before > 5.3 and after < before - 1.5, out  # from about uniform over 256 bytes
    assert "2 replica(s)" in out and "step 120/120: loss" in out, out
    assert re.search(r"sample \(top-5, 64 bytes\):\ndef ", out), out
    assert noise_lines(out) == [], out


def test_recommender_example_beats_chance_on_validation_clicks():
    code, out = run_job([sys.executable, "examples/recommender.py", "--replicas", "2",
                         "--rows", "20000", "--items", "2000", "--examples", "32768",
                         "--val_examples", "8192", "--epochs", "2", "--min_auc", "0.65"],
                        _env(), TIMEOUT, cwd=ROOT)
    assert code == 0, out
    assert "2 replica(s)" in out and "epoch 2/2: loss" in out, out
    auc = _number(r"validation AUC: (\d+\.\d+)", out)
    best = _number(r"the hidden model that drew the clicks: (\d+\.\d+)", out)
    assert 0.65 <= auc <= best + 0.01, out
    assert noise_lines(out) == [], out


@pytest.mark.multiworker
def test_recommender_example_on_two_workers():
    code, out = run_job(tfdp_run_command(
        "examples/recommender.py", "--rows", "20000", "--items", "2000", "--examples", "32768",
        "--val_examples", "8192", "--epochs", "2", "--min_auc", "0.65", cpu_replicas=2),
        _env(), TIMEOUT, cwd=ROOT)
    assert code == 0, out
    assert "[w0] tfdp: 2 worker(s), 4 replica(s)" in out, out
    assert _number(r"\[w0\] validation AUC: (\d+\.\d+)", out) >= 0.65, out
