"""Preemption, crashes and restarts with real worker processes on 127.0.0.1 (issue 11).

2 workers x 2 replicas, shuffled tfdp.data input, Adam, BackupAndRestore(save_freq=5). The
steps each launch ran are recorded by a callback in the worker (the optimizer's iteration
counter after each step), not inferred. Every launch is bounded by a timeout, and only
processes these tests started are signalled (by pid).
"""

import os
import signal
import sys
import time

import numpy as np
import pytest

from launching import finish_job, run_job, start_job, wait_for_file, wait_until
from procs import process_alive
from resume_job import (TIMEOUT, WORKER, assert_same_weights, environment, launcher, steps_run,
                        weights)

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]
STEPS = 3 * 8  # 3 epochs x 256 examples / global batch 32


def test_sigterm_ends_a_worker_without_backup_and_restore(tmp_path):
    # No tfdp callback listens for SIGTERM here, so it must end the worker as it ends any
    # Python program. Joining the cluster lets TensorFlow's coordination service swallow it
    # (measured: the worker trained on until SIGKILL); the strategy takes it back.
    env = environment(tmp_path, None, TFDP_TEST_EPOCHS=100_000, TFDP_TEST_PACE_MS=5)
    proc = start_job(launcher(cpu_replicas=1, extra=("--grace-period", "5")), env)
    try:
        wait_for_file(tmp_path / "pid-slot1-attempt0", proc, TIMEOUT)
        steps = tmp_path / "steps-slot1.txt"
        wait_until(lambda: steps.exists() and steps.read_text().strip(), "worker 1 trains", TIMEOUT)
        os.kill(int((tmp_path / "pid-slot1-attempt0").read_text()), signal.SIGTERM)
        code, log = finish_job(proc, 120)  # without the fix: no end until the test's timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        # The workers run in sessions of their own: a worker that survived its SIGTERM would
        # outlive the launcher's SIGKILL and train on (seen in this test's guard run).
        for slot in range(2):
            pid_file = tmp_path / f"pid-slot{slot}-attempt0"
            if pid_file.exists() and process_alive(int(pid_file.read_text())):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert "worker 1 exited with code 143" in log, log
    assert code == 143, log


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    code, log = run_job(launcher(), environment(out, out / "backup"), TIMEOUT)
    assert code == 0, log
    iterations = [it for _, _, it in steps_run(out)]
    assert iterations == list(range(1, STEPS + 1)), iterations
    return out


def test_sigterm_to_tfdp_run_backs_up_and_the_relaunch_finishes_exactly(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    proc = start_job(launcher(), environment(tmp_path, backup, TFDP_TEST_HOLD="0:13"))
    wait_for_file(tmp_path / "held-0", proc, TIMEOUT)  # mid-epoch 2 (8 steps per epoch)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, log = finish_job(proc, TIMEOUT)
    print(f"SIGTERM -> tfdp-run exit: {time.monotonic() - sent:.1f} s")
    assert code == 143, log
    assert "preempted: all workers backed up at global step 13" in log, log
    first = [it for _, _, it in steps_run(tmp_path)]
    assert first == list(range(1, 14))
    code, log = run_job(launcher(), environment(tmp_path, backup), TIMEOUT)
    assert code == 0, log
    second = [it for a, _, it in steps_run(tmp_path)][len(first):]
    assert second == list(range(14, STEPS + 1))  # no step twice, none skipped
    assert len(first) + len(second) == STEPS
    for rank in range(2):
        assert_same_weights(weights(tmp_path, rank), weights(uninterrupted, rank))


def test_sigterm_to_one_worker_with_restarts_finishes_with_no_step_twice(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    proc = start_job(launcher(extra=("--max-restarts", "1")),
                     environment(tmp_path, backup, TFDP_TEST_HOLD="1:10"))
    wait_for_file(tmp_path / "held-1", proc, TIMEOUT)
    with open(tmp_path / "held-1") as f:
        os.kill(int(f.read()), signal.SIGTERM)  # only worker 1, as a node drain would
    code, log = finish_job(proc, TIMEOUT)
    assert code == 0, log
    assert "restart 1/1: worker 1 exited with 143" in log, log
    for slot in range(2):
        iterations = [it for _, _, it in steps_run(tmp_path, slot)]
        assert iterations == list(range(1, STEPS + 1)), iterations  # each step exactly once
    assert_same_weights(weights(tmp_path), weights(uninterrupted))


def test_sigkill_mid_epoch_with_restarts_redoes_at_most_save_freq_steps(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    code, log = run_job(launcher(extra=("--max-restarts", "2")),
                        environment(tmp_path, backup, TFDP_TEST_FAIL="1:13:kill"), TIMEOUT)
    assert code == 0, log
    assert "restart 1/2: worker 1 exited with 137 (SIGKILL)" in log, log
    records = steps_run(tmp_path, slot=0)
    first = [it for a, _, it in records if a == 0]
    second = [it for a, _, it in records if a == 1]
    assert second[0] == 11  # resumed after the backup at step 10
    redone = sorted(set(first) & set(second))
    assert 1 <= len(redone) <= 5, redone
    assert sorted(set(first) | set(second)) == list(range(1, STEPS + 1))
    assert_same_weights(weights(tmp_path), weights(uninterrupted))


def test_guard_epoch_level_resume_redoes_steps(tmp_path, uninterrupted):
    # What the step-exact resume prevents: with epoch backups only, the same kill makes the
    # relaunch redo the interrupted epoch's first steps, which the step checks above catch.
    backup = tmp_path / "backup"
    code, log = run_job(launcher(extra=("--max-restarts", "1")),
                        environment(tmp_path, backup, TFDP_TEST_FAIL="1:13:kill",
                                    TFDP_TEST_SAVE_FREQ="epoch"), TIMEOUT)
    assert code == 0, log
    records = steps_run(tmp_path, slot=0)
    first = [it for a, _, it in records if a == 0]
    second = [it for a, _, it in records if a == 1]
    assert second[0] == 9 and len(set(first) & set(second)) > 4


def test_a_plain_relaunch_with_the_same_tf_config_resumes(tmp_path, uninterrupted):
    # Kubernetes (restartPolicy: ExitCode) or Slurm (--requeue) relaunch the same processes
    # with the same TF_CONFIG and no tfdp-run: the backup alone carries the resume.
    import json
    from tfdp.launcher.cli import free_ports

    backup = tmp_path / "backup"
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}

    def task_env(index, **knobs):
        env = environment(tmp_path, backup, TFDP_CPU_REPLICAS=2, **knobs)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        return env

    procs = [start_job([sys.executable, WORKER], task_env(i, TFDP_TEST_HOLD="0:13"))
             for i in range(2)]
    wait_for_file(tmp_path / "held-0", procs[0], TIMEOUT)
    for p in procs:
        p.send_signal(signal.SIGTERM)  # the scheduler preempts every pod
    results = [finish_job(p, TIMEOUT) for p in procs]
    assert [c for c, _ in results] == [143, 143], results
    procs = [start_job([sys.executable, WORKER], task_env(i)) for i in range(2)]
    results = [finish_job(p, TIMEOUT) for p in procs]
    assert [c for c, _ in results] == [0, 0], results
    iterations = [it for _, _, it in steps_run(tmp_path)]
    assert iterations == list(range(1, STEPS + 1))
    assert_same_weights(weights(tmp_path), weights(uninterrupted))


def test_the_stop_flag_rides_in_the_gradient_reduction(tmp_path):
    # Issue 20: with check_every=1 the stop agreement adds no collective to a step: the flag
    # is one more element of the gradient all-reduce. Counted, per step, on 2 real workers of
    # 2 replicas each (the count is per local replica).
    import json
    import statistics

    from launching import tfdp_run_command, worker_script

    cmd = tfdp_run_command(worker_script("mw_collectives_worker.py"), cpu_replicas=2)
    code, log = run_job(cmd, environment(tmp_path), TIMEOUT)
    assert code == 0, log
    counts = json.loads(log.split("COUNTS ", 1)[1].splitlines()[0])
    per_step = {name: statistics.median(c[1:]) for name, c in counts.items()
                if isinstance(c, list) and not name.startswith("losses")}
    print("collectives per step:", per_step)
    assert counts["adam_rides"] and per_step["adam"] >= 2
    assert per_step["adam_backup"] == per_step["adam"]  # the flag costs no collective
    # The logs (Keras's metric results) ride too: one collective per step and local replica,
    # where a train_step of the user's own (Keras's, reached through an override) keeps
    # Keras's per-step all-reduce of the logs (the guard); the logs are the same.
    assert per_step["adam"] == 2
    assert per_step["adam_own_step"] == per_step["adam"] + 2
    (batch_riding, epoch_riding), (batch_keras, epoch_keras) = (counts["losses_riding"],
                                                                counts["losses_keras"])
    np.testing.assert_allclose(batch_riding, batch_keras, rtol=1e-6)
    np.testing.assert_allclose(epoch_riding, epoch_keras, rtol=1e-6)
    # Guard: ShardedOptimizer reduces its own way, so the flag takes its own all-reduce
    # (one per local replica), and the count shows it.
    assert not counts["sharded_rides"]
    assert per_step["sharded_backup"] == per_step["sharded"] + 2
