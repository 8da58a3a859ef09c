"""Examples print only what the user needs (issue 10): the noise check, the examples'
filter of TensorFlow's startup notices, and the README's example commands. Moved from
test_rough_edges.py."""

import os
import sys

import pytest

from launching import ROOT, run_job, tfdp_run_command
from output_checks import noise_lines

LAUNCH_TIMEOUT = 240

# The warning the examples used to print (Keras 3.15, fit on a dataset with shuffle=True).
CAPTURED_KERAS_SHUFFLE_WARNING = (
    "/x/keras/src/trainers/epoch_iterator.py:74: UserWarning: `shuffle=True` was passed, but "
    "will be ignored since the data `x` was provided as a tf.data.Dataset.\n"
    "  self.data_adapter = data_adapters.get_data_adapter(\n")
# What TensorFlow 2.21 writes to stderr while it is imported, whatever TF_CPP_MIN_LOG_LEVEL.
CAPTURED_TF_IMPORT_STDERR = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795306282.361210    1691 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1795306282.387771    1691 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795306283.522022    1691 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
"""


def test_noise_check_catches_keras_and_tensorflow_warnings():
    assert len(noise_lines(CAPTURED_KERAS_SHUFFLE_WARNING)) == 1
    assert len(noise_lines(CAPTURED_TF_IMPORT_STDERR)) == 2  # absl's pre-init WARNING lines
    assert noise_lines("epoch 3/3: loss 0.2952 accuracy 0.9126\ntest accuracy: 0.9499\n") == []


def test_examples_drop_only_tensorflows_startup_notices():
    import common  # examples/common.py (examples/ is on pytest's pythonpath)

    assert common.drop_startup_notices(CAPTURED_TF_IMPORT_STDERR) == ""
    # Guard: anything else written during the import stays, including TF's own errors.
    other = ("W0000 00:00:1795306282.4 1691 x.cc:1] something to act on\n"
             "E0000 00:00:1795306282.5 1691 y.cc:2] a real error\n"
             "Traceback (most recent call last):\n")
    assert common.drop_startup_notices(CAPTURED_TF_IMPORT_STDERR + other) == other


def _run_readme_command(cmd, timeout=LAUNCH_TIMEOUT):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the examples set what they need themselves
    # What the examples print is judged: the interpreter's full exit, as a user's run has it
    # (tests/hidden_imports/sitecustomize.py).
    env["TFDP_TEST_FULL_FINALIZATION"] = "1"
    return run_job(cmd, env, timeout, cwd=ROOT)


@pytest.mark.slow
def test_keras_fit_example_prints_no_warnings():
    # README: python examples/keras_fit.py (fewer epochs).
    code, out = _run_readme_command([sys.executable, "examples/keras_fit.py", "--epochs", "2",
                                     "--replicas", "2"])
    assert code == 0, out
    assert "test accuracy:" in out, out
    assert noise_lines(out) == [], out


@pytest.mark.slow
@pytest.mark.multiworker
def test_multi_worker_example_prints_no_warnings(tmp_path):
    # README: tfdp-run --workers 2 --cpu-replicas 2 -- python examples/multi_worker.py
    code, out = _run_readme_command(tfdp_run_command(
        "examples/multi_worker.py", "--epochs", "1", "--model_dir", tmp_path, cpu_replicas=2))
    assert code == 0, out
    assert "[w0] saved" in out, out
    assert noise_lines(out) == [], out
