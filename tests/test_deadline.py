"""tfdp.strategy.deadline: the step deadline that replaced TensorFlow's per-collective timeout.

The multi-worker proof (a live worker that never joins the step fails it at the deadline)
is in test_multiworker.py; a frozen worker is found by TensorFlow's heartbeats (ibid.).
"""

import os
import queue
import subprocess
import sys

import pytest
import tensorflow as tf

import tfdp
from tfdp import _tf_private
from tfdp.strategy import deadline
from helpers import cpu_devices
from launching import worker_env, worker_script


def test_the_deadline_is_the_timeout_and_longer_for_the_first_step():
    assert deadline.deadline_seconds(None, first=False) is None
    assert deadline.deadline_seconds(None, first=True) is None
    assert deadline.deadline_seconds(300, first=False) == 300.0
    assert deadline.deadline_seconds(300, first=True) == 300.0 * deadline.FIRST_STEP_FACTOR
    assert deadline.FIRST_STEP_FACTOR > 1


def test_the_message_names_the_step_the_worker_the_limit_and_the_fix():
    message = deadline.overdue_message("a training step", 4.0, 1, 3)
    assert "a training step on worker 1 of 3 did not finish within 4 s" in message
    assert "timeout_seconds" in message and "stuck outside the step" in message
    # At a step function's first run each worker posts its arrival: the missing are named.
    named = deadline.overdue_message("an evaluation step", 24.0, 0, 3, missing=[2])
    assert "Worker(s) 2 never started it" in named and "stuck outside" not in named


def _watchdog():
    fired = queue.Queue()
    return deadline.Watchdog(fired.put), fired


def test_an_armed_deadline_fires_once_with_its_message():
    dog, fired = _watchdog()
    dog.arm(0.05, lambda: "late step")  # formatted only when due
    assert fired.get(timeout=10) == "late step"
    dog.arm(0.05, "next")  # the thread keeps serving
    assert fired.get(timeout=10) == "next"
    assert fired.empty()


def test_a_disarmed_deadline_never_fires():
    dog, fired = _watchdog()
    early = dog.arm(0.02, "disarmed in time")
    dog.disarm(early)
    dog.arm(0.2, "armed later")  # due after the first one would have been
    assert fired.get(timeout=10) == "armed later"
    assert fired.empty()


def test_an_inner_deadline_hides_the_outer_until_it_is_disarmed():
    dog, fired = _watchdog()
    dog.arm(0.3, "outer")
    inner = dog.arm(60.0, "inner")
    with pytest.raises(queue.Empty):
        fired.get(timeout=0.6)  # the outer is overdue, but the inner step is running
    dog.disarm(inner)
    assert fired.get(timeout=10) == "outer"


def test_a_peer_exit_the_poll_reports_ends_the_armed_step_at_once_with_its_message():
    fired, news = queue.Queue(), queue.Queue()

    def poll():  # what tfdp-run's PEER_EXITED_FILE says, once it is there
        return None if news.empty() else news.queue[0]

    dog = deadline.Watchdog(fired.put, poll=poll, poll_seconds=0.01)
    dog.arm(600.0, "the deadline")  # ten minutes: only the poll can end it within the test
    with pytest.raises(queue.Empty):
        fired.get(timeout=0.3)  # guard: polled, but no peer exited, so nothing fires
    news.put("worker 1 exited")
    assert fired.get(timeout=10) == "worker 1 exited"


def test_the_peer_exit_poll_reads_tfdp_runs_file_and_only_under_tfdp_run(tmp_path):
    from tfdp.protocol import CONTROL_DIR_ENV, PEER_EXITED_FILE

    assert deadline._make_watchdog({})._poll is None  # no control directory: nothing polls
    poll = deadline._make_watchdog({CONTROL_DIR_ENV: str(tmp_path)})._poll
    assert poll() is None  # no peer exited yet
    (tmp_path / PEER_EXITED_FILE).write_text("{not json")
    assert poll() is None  # a torn or foreign file is no news
    (tmp_path / PEER_EXITED_FILE).write_text('{"slot": 1, "rank": 1, "exit": "137 (SIGKILL)"}')
    message = poll()
    assert "worker 1 (rank 1) exited with code 137 (SIGKILL)" in message
    assert "--max-restarts" in message


def test_watching_arms_nothing_without_a_timeout(monkeypatch):
    armed = []
    monkeypatch.setattr(deadline._watchdog, "arm", lambda *a: armed.append(a) or 0)
    with deadline.watching(object(), "a step"):
        pass
    assert armed == []


def test_the_broadcast_message_names_the_variable_the_missing_workers_and_the_fix():
    # Real two-worker cases: tests/test_rebuild.py.
    named = deadline.broadcast_overdue_message("kernel", 18.0, 0, 3, missing=[2])
    assert "variable 'kernel' on worker 0 of 3 did not finish within 18 s" in named
    assert "Worker(s) 2 never reached this strategy's first variable" in named
    assert "Build the same model on every worker" in named and "timeout_seconds" in named
    unknown = deadline.broadcast_overdue_message("bias", 3.0, 1, 2)
    assert "one creates a variable the others do not" in unknown


def test_variable_broadcast_arms_nothing_in_one_process_or_without_a_timeout(monkeypatch):
    armed = []
    monkeypatch.setattr(deadline._watchdog, "arm", lambda *a: armed.append(a) or 0)
    for strategy in (object(), tfdp.DataParallelStrategy(devices=cpu_devices(2),
                                                         timeout_seconds=300)):
        with deadline.variable_broadcast(strategy, "kernel", first=True):
            pass
    assert armed == []


def test_the_outside_step_message_names_the_call_the_missing_workers_the_cause_and_the_fix():
    # Real two-worker cases: tests/test_outside_step.py.
    named = deadline.outside_step_message("tfdp.horovod's broadcast", 2.0, 0, 3, [1, 2],
                                          "Call it on every rank.")
    assert "tfdp.horovod's broadcast on worker 0 of 3 did not finish within 2 s" in named
    assert "Worker(s) 1, 2 never arrived at it" in named and named.endswith("every rank.")
    everyone = deadline.outside_step_message("x", 2.0, 1, 2, [], "Fix.")
    assert "Every worker arrived at it" in everyone
    failed = deadline.outside_step_message("x", 2.0, 1, 2, None, "Fix.",
                                           cause="UnavailableError: peer gone")
    assert "failed (UnavailableError: peer gone)" in failed and "within" not in failed


def test_collective_outside_step_arms_nothing_in_one_process(monkeypatch):
    armed = []
    monkeypatch.setattr(deadline._watchdog, "arm", lambda *a: armed.append(a) or 0)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2), timeout_seconds=300)
    with deadline.collective_outside_step(strategy, "a call", "Fix."):
        strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    assert armed == []


def test_tfdp_timeout_seconds_is_the_multi_worker_default_deadline(monkeypatch):
    from tfdp.strategy.options import DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS, resolve_options

    monkeypatch.delenv("TFDP_TIMEOUT_SECONDS", raising=False)
    assert resolve_options(multi_worker=True).timeout_seconds == \
        DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS
    monkeypatch.setenv("TFDP_TIMEOUT_SECONDS", "7.5")
    assert resolve_options(multi_worker=True).timeout_seconds == 7.5
    assert resolve_options(multi_worker=True, timeout_seconds=3).timeout_seconds == 3
    assert resolve_options(multi_worker=False).timeout_seconds is None  # one process: none
    monkeypatch.setenv("TFDP_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match="TFDP_TIMEOUT_SECONDS='soon' must be a positive"):
        resolve_options(multi_worker=True)


def _thread_growth(strategy, steps=100):
    @tf.function
    def step(x):
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", x))

    x = tf.ones([16])
    step(x)
    before = len(os.listdir("/proc/self/task"))
    for _ in range(steps):
        step(x)
    return len(os.listdir("/proc/self/task")) - before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_timeout_costs_no_thread_per_collective():
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2), timeout_seconds=300)
    assert strategy.timeout_seconds == 300
    assert not _tf_private.communication_options(strategy.extended).timeout_seconds
    assert _thread_growth(strategy) < 20  # 200 collectives
    # Guard: TensorFlow's own per-collective timeout (what tfdp passed before) leaves
    # threads sleeping for the whole timeout after every collective (2 s here, to let go).
    guard = tfdp.DataParallelStrategy(devices=cpu_devices(2), timeout_seconds=300)
    _tf_private.communication_options(guard.extended).timeout_seconds = 2
    assert _thread_growth(guard) >= 200


def test_an_overdue_custom_step_fails_with_deadline_exceeded_and_the_message():
    # In a process of its own: aborting the collectives is for good (as after any collective
    # error, the process must restart), and this process serves other tests.
    proc = subprocess.run([sys.executable, worker_script("deadline_worker.py")],
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "DeadlineExceededError" in out, out
    assert "a custom step on worker 0 of 1 did not finish within 2 s" in out, out
    assert "the step that came in time: ok" in out, out
