"""Every collective outside a training step ends within the deadline (issue 40, item 2).

A worker that is alive but never reaches a collective its peers wait in is not found by
TensorFlow (its heartbeats arrive): the peers waited for ever. Each kind below runs on two
real workers (``tfdp-run --workers 2``, 127.0.0.1); worker 1 skips the call worker 0 makes (the
``if rank == 0`` idiom) and blocks. Worker 0 must fail within ``TFDP_TIMEOUT_SECONDS`` (the
first call of a kind gets ``FIRST_STEP_FACTOR`` times as long) with tfdp's message naming
worker 1 and the fix, and tfdp-run must end the job. The guard runs the same script with
nobody skipping: it returns on both workers. The initial-value broadcast of a variable has its
own tests in tests/test_rebuild.py; steps and agreements in tests/test_deadline.py.
"""

import re
import time

import pytest

from launching import run_job, tfdp_run_command, worker_env, worker_script
from tfdp.strategy.deadline import FIRST_STEP_FACTOR

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]
LAUNCH_TIMEOUT = 240
TIMEOUT = 2  # TFDP_TIMEOUT_SECONDS: the first call of a kind may take FIRST_STEP_FACTOR x


def launch(tmp_path, case, cpu_replicas=1, **env):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, TFDP_TEST_CASE=case,
                         TFDP_TIMEOUT_SECONDS=TIMEOUT, **env)
    cmd = tfdp_run_command(worker_script("mw_outside_step.py"), workers=2,
                           cpu_replicas=cpu_replicas, flags=["--output", "all"])
    start = time.monotonic()
    code, out = run_job(cmd, environ, LAUNCH_TIMEOUT)
    return code, out, time.monotonic() - start


CASES = {
    # Keras's evaluate asks every worker, eagerly, whether any has data left before its first
    # step (with arrays and with tfdp.data's input alike).
    "evaluate": (2, "an eager cross-worker reduction (strategy.reduce, or, in Keras's "
                 "predict and evaluate", "model.predict and model.evaluate on every worker"),
    # case: (cpu replicas, what the error names, words of the fix)
    "hvd_broadcast": (1, "tfdp.horovod's broadcast (hvd.broadcast, broadcast_variables",
                      "one under `if hvd.rank() == 0`"),
    "zero3_save": (2, "reading the sharded variable 'kernel' whole",
                   "make that call on every worker, not under `if is_chief`"),
    # Keras's predict asks every worker, eagerly, whether any has data left before each step.
    "zero3_predict": (2, "an eager cross-worker reduction (strategy.reduce, or, in Keras's "
                      "predict", "model.predict and model.evaluate on every worker"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_worker_that_never_arrives_is_an_error_within_the_deadline(tmp_path, case):
    cpu_replicas, what, fix = CASES[case]
    code, out, elapsed = launch(tmp_path, case, cpu_replicas)
    assert "rank 1: skipping" in out, out[-4000:]  # the case ran as meant
    assert code not in (0, None), out[-4000:]
    assert "rank 0: returned" not in out
    assert "tfdp: " + what in out, out[-4000:]
    assert "worker 0 exited with code" in out, out[-4000:]  # tfdp-run ended the job
    assert re.search(r"rank 0: \w+Error: ", out), out[-4000:]  # the call raised on worker 0
    message = out[out.index("tfdp: " + what):].splitlines()[0]
    assert "on worker 0 of 2" in message, message
    assert fix in message, message
    assert "Worker(s) 1 never arrived at it" in message, message
    assert elapsed < TIMEOUT * FIRST_STEP_FACTOR + 90, elapsed  # far below a hang's 240 s


def test_guard_the_same_calls_return_when_every_worker_makes_them(tmp_path):
    # Nobody skips: the bounded calls return (the arrival posts and the armed deadline change
    # nothing in a healthy job). Predict is covered by ZeRO-3's tests on two workers.
    for case in ("hvd_broadcast", "zero3_save"):
        (tmp_path / case).mkdir()
        code, out, _ = launch(tmp_path / case, case, CASES[case][0], TFDP_TEST_SKIP="none")
        assert code == 0, out[-4000:]
        assert "rank 0: returned" in out and "rank 1: returned" in out, out[-4000:]
