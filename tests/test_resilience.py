"""tfdp.resilience: the pure decisions and the atomic backup store (no training here)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tfdp import resilience
from tfdp.resilience import (BackupStore, Position, elastic_batch_size, find_stragglers,
                             is_update_boundary, membership_allows_eviction, resume_position,
                             should_back_up)


def test_resume_position_continues_at_the_next_step():
    assert resume_position(2, 3, 8) == Position(2, 3)
    assert resume_position(2, 0, 8) == Position(2, 0)
    assert resume_position(2, 8, 8) == Position(3, 0)  # the epoch was complete
    assert resume_position(2, 5, None) == Position(2, 5)


def test_backups_fall_on_update_boundaries():
    assert [g for g in range(1, 13) if should_back_up(g, 5)] == [5, 6, 7, 8, 9, 10, 11, 12]
    last, taken = 0, []
    for g in range(1, 21):
        if should_back_up(g, 5, accumulation_steps=4, last_backup_step=last):
            taken.append(g)
            last = g
    assert taken == [8, 16]  # due at 5 and 13, taken at the next multiple of 4
    assert all(is_update_boundary(g, 4) for g in taken)
    assert not is_update_boundary(6, 4) and is_update_boundary(6, 1)


def test_find_stragglers_names_only_the_slow_worker():
    assert find_stragglers([10.0, 11.0, 35.0]) == [2]
    assert find_stragglers([30.0, 10.0]) == [0]          # two workers: the other is the reference
    assert find_stragglers([10.0, 11.0, 12.0, 10.5]) == []  # healthy workers are not named
    assert find_stragglers([0.5, 0.6, 1.4]) == []        # 2.8x but below min_excess_ms: noise
    assert find_stragglers([0.5, 0.6, 1.4], min_excess_ms=0.1) == [2]  # guard: ratio alone would
    assert find_stragglers([10.0]) == []


def test_membership_allows_eviction_only_when_the_launcher_can_shrink():
    env = {"TFDP_MIN_WORKERS": "2", "TFDP_RESTARTS_LEFT": "1"}
    assert membership_allows_eviction(3, env)[0]
    ok, why = membership_allows_eviction(2, env)
    assert not ok and "--min-workers 2" in why
    ok, why = membership_allows_eviction(3, dict(env, TFDP_RESTARTS_LEFT="0"))
    assert not ok and "no restarts left" in why
    ok, why = membership_allows_eviction(3, {})
    assert not ok and "tfdp-run" in why


def test_elastic_batch_size_policies():
    assert elastic_batch_size(24, 3, 2) == (24, 1.0)
    assert elastic_batch_size(24, 3, 4, policy="constant_per_replica") == (32, 4 / 3)
    with pytest.raises(ValueError, match="not divisible by 5 replicas"):
        elastic_batch_size(24, 3, 5)
    with pytest.raises(ValueError, match="policy="):
        elastic_batch_size(24, 3, 2, policy="bigger")


def _write(store, step, payload=b"w"):
    def write_weights(path):
        with open(path, "wb") as f:
            f.write(payload)
    return store.write(step, write_weights, {"epoch": 0, "step_in_epoch": step})


def test_store_keeps_the_newest_and_ignores_incomplete(tmp_path):
    store = BackupStore(tmp_path, keep=2)
    for step in (5, 10, 15):
        _write(store, step, payload=str(step).encode())
    assert store.steps() == [10, 15]
    assert store.read_meta(15)["global_step"] == 15
    os.makedirs(tmp_path / ".incomplete-step-000000000020-999999")  # a writer that died
    os.makedirs(tmp_path / "step-000000000025")  # renamed dir without meta: not a backup
    assert store.latest() == 15
    store.prune()
    assert not (tmp_path / ".incomplete-step-000000000020-999999").exists()


# A child process writes backups 1..3 and SIGKILLs itself at the n-th file-system event of
# the third write (weights chunks, fsyncs, meta, rename, prune). Whatever n, the newest
# complete backup must load and hold one step's data only.
_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from tfdp import resilience
    from tfdp.resilience import backups
    kill_at = int(sys.argv[2]); events = [0]
    def event():
        events[0] += 1
        if WRITING[0] and events[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    WRITING = [False]
    for name in ("_fsync_file", "_fsync_dir"):
        real = getattr(backups, name)
        def wrapped(path, real=real):
            event(); real(path); event()
        setattr(backups, name, wrapped)
    real_rename = os.rename
    def rename(a, b):
        event(); real_rename(a, b); event()
    os.rename = rename
    store = resilience.BackupStore(sys.argv[1])
    for step in (1, 2, 3):
        WRITING[0] = step == 3
        def write_weights(path, step=step):
            with open(path, "wb") as f:
                for chunk in range(4):
                    f.write(bytes([step]) * 1000); f.flush(); event()
        store.write(step, write_weights, {"epoch": 0, "step_in_epoch": step})
    print("events", events[0])
""")


@pytest.mark.slow
def test_a_kill_at_any_point_of_a_backup_leaves_a_loadable_one(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)

    def run(kill_at, directory):
        return subprocess.run([sys.executable, str(script), str(directory), str(kill_at)],
                              capture_output=True, text=True, timeout=60)

    full = run(0, tmp_path / "full")
    assert full.returncode == 0, full.stderr
    total = int(full.stdout.split()[-1])
    killed_points = 0
    for kill_at in range(1, total + 1):
        directory = tmp_path / f"kill{kill_at}"
        proc = run(kill_at, directory)
        if proc.returncode != -signal.SIGKILL:
            continue  # the event came after the third write had finished
        killed_points += 1
        store = BackupStore(directory)
        latest = store.latest()
        assert latest in (2, 3), (kill_at, store.steps())
        with open(store.weights_path(latest), "rb") as f:
            data = f.read()
        assert data == bytes([latest]) * 4000, kill_at  # complete, and one step's data only
        assert store.read_meta(latest)["step_in_epoch"] == latest
    assert killed_points >= 8  # the kill really landed at many points inside the write


def test_guard_a_plain_overwrite_would_leave_a_torn_backup(tmp_path):
    # What the rename protects against: writing in place and dying half-way.
    path = tmp_path / "model.weights.h5"
    path.write_bytes(bytes([2]) * 4000)
    with open(path, "wb") as f:
        f.write(bytes([3]) * 1000)  # killed here
    assert path.read_bytes() != bytes([2]) * 4000 and path.read_bytes() != bytes([3]) * 4000


def test_preemption_watcher_turns_sigterm_into_a_flag():
    watcher = resilience.PreemptionWatcher(grace_seconds=60)
    watcher.install()
    try:
        assert not watcher.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.requested  # handled, and the process is still alive
    finally:
        watcher.cancel_backstop()
        watcher.uninstall()
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None) or callable(
        signal.getsignal(signal.SIGTERM))


def test_preemption_backstop_exits_143_when_no_stop_is_agreed(tmp_path):
    code = textwrap.dedent("""
        import os, signal, threading
        from tfdp import resilience
        w = resilience.PreemptionWatcher(grace_seconds=1.0, margin_seconds=0.5)
        w.install()
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(60)  # a training loop that never reaches a step boundary
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert "grace period" in proc.stderr


def test_mark_progress_writes_the_launcher_file(tmp_path):
    resilience.mark_progress(1, {"TFDP_CONTROL_DIR": str(tmp_path), "TFDP_ATTEMPT": "2"})
    assert (tmp_path / "step-1").read_text() == "2"
    resilience.mark_progress(1, {})  # no launcher: nothing to do


def test_store_on_a_tf_io_gfile_filesystem_commits_with_the_metadata_last():
    # TensorFlow's in-memory ram:// filesystem stands for gs:// and s3://: reached through
    # tf.io.gfile, no atomic directory rename, so meta.json written last marks completion.
    import tensorflow as tf

    directory = f"ram://tfdp-test-{os.getpid()}/backup"
    store = BackupStore(directory, keep=2)

    def writer(step, fail=False):
        def write_weights(path):
            with tf.io.gfile.GFile(path, "wb") as f:
                f.write(bytes([step]) * 100)
            if fail:
                raise RuntimeError("killed after the weights, before the metadata")
        return write_weights

    for step in (5, 10, 15):
        store.write(step, writer(step), {"epoch": 0, "step_in_epoch": step})
    assert store.steps() == [10, 15]
    with pytest.raises(RuntimeError, match="killed"):
        store.write(20, writer(20, fail=True), {"epoch": 0, "step_in_epoch": 20})
    assert tf.io.gfile.exists(store.weights_path(20))  # the weights are there ...
    assert store.latest() == 15  # ... but without meta.json it is not a backup
    with tf.io.gfile.GFile(store.weights_path(15), "rb") as f:
        assert f.read() == bytes([15]) * 100
    assert store.read_meta(15)["step_in_epoch"] == 15 and store.readable(15)
    store.write(15, writer(99), {"epoch": 1, "step_in_epoch": 0})  # the same step again
    assert store.read_meta(15)["epoch"] == 1
    with tf.io.gfile.GFile(store.weights_path(15), "rb") as f:
        assert f.read() == bytes([15]) * 100  # one step is one state: weights kept
    store.prune()
    assert not tf.io.gfile.exists(store.path(20))  # the incomplete one is removed
    store.delete()
    assert store.steps() == [] and not tf.io.gfile.exists(directory)


# --- stragglers: the split of a step (pure, no TensorFlow) -----------------------------------

def test_a_step_splits_into_own_time_and_waiting():
    from tfdp.resilience.stragglers import split_step

    # 1 ms host before the call, 1 ms to get the batch, waits 4-9 ms (two overlapping
    # collectives count once), 1 ms host after the call.
    split = split_step(0.0, 0.001, 0.002, 0.010, 0.011, [(0.004, 0.009), (0.005, 0.008)])
    assert split.as_list() == pytest.approx([6.0, 3.0, 1.0, 2.0, 5.0])
    assert split.compute + split.wait == pytest.approx(11.0)  # the step's wall time
    # The worker the others wait for: it arrives last, its collective takes only the transfer.
    slow = split_step(0.0, 0.001, 0.030, 0.032, 0.033, [(0.030, 0.031)])
    fast = split_step(0.0, 0.001, 0.002, 0.032, 0.033, [(0.004, 0.031)])
    assert find_stragglers([fast.compute, slow.compute, fast.compute]) == [1]
    assert slow.input == pytest.approx(29.0) and fast.wait == pytest.approx(27.0)
    # Waits outside the step are clipped; a batch time outside the call is ignored.
    clipped = split_step(1.0, 1.0, 5.0, 1.002, 1.002, [(0.5, 1.001), (1.5, 2.0)])
    assert clipped.wait == pytest.approx(1.0) and clipped.input == 0.0


def test_guard_timing_only_the_compute_window_misses_a_host_straggler():
    # What issue 20 found: a worker slowed between steps (host) looks like the others if
    # only the time from "batch in hand" to "gradients ready" is compared.
    from tfdp.resilience.stragglers import split_step

    stopped = split_step(0.0, 0.040, 0.041, 0.044, 0.045, [(0.043, 0.044)])  # 40 ms host
    waiting = split_step(0.0, 0.001, 0.002, 0.044, 0.045, [(0.003, 0.044)])
    assert stopped.step == pytest.approx(2.0) and waiting.step == pytest.approx(1.0)
    assert find_stragglers([waiting.step, stopped.step, waiting.step]) == []  # blind
    assert find_stragglers([waiting.compute, stopped.compute, waiting.compute]) == [1]


def test_a_process_stopped_inside_a_collective_is_the_straggler_through_its_stall():
    # What a CI run found: SIGSTOP landing while the stopped worker is already inside its
    # all-reduce grows its wait as much as the others', so its own time looks healthy.
    from tfdp.resilience.stragglers import split_step, stall_interval

    # 2 ms of work, then a collective 2-34 ms: the stopped worker did not run 3-33 ms.
    stall = stall_interval(0.002, 0.033, tick=0.001, slack=0.002)
    assert stall == pytest.approx((0.003, 0.033))
    stopped = split_step(0.0, 0.0, 0.001, 0.034, 0.035, [(0.002, 0.034)], [stall])
    waiting = split_step(0.0, 0.0, 0.001, 0.034, 0.035, [(0.002, 0.034)])
    assert stopped.wait == pytest.approx(2.0) and stopped.compute == pytest.approx(33.0)
    assert find_stragglers([waiting.compute, stopped.compute, waiting.compute]) == [1]
    # Guard: without the stall the stopped worker is indistinguishable from the others.
    blind = split_step(0.0, 0.0, 0.001, 0.034, 0.035, [(0.002, 0.034)])
    assert find_stragglers([waiting.compute, blind.compute, waiting.compute]) == []
    # A stall outside any wait is own time already: counted once, not twice.
    between = split_step(0.0, 0.010, 0.011, 0.012, 0.013, [], [(0.001, 0.009)])
    assert between.compute == pytest.approx(13.0) and between.host == pytest.approx(11.0)
    assert stall_interval(0.0, 0.0025, tick=0.001, slack=0.002) is None  # scheduling noise


def test_stall_meter_reports_late_wake_ups_and_ends_with_its_owner():
    import threading

    from tfdp.resilience.stragglers import StallMeter

    # A clock that says the thread woke 0.01 s, then 0.30 s (a stop), then 0.01 s later.
    times = iter([0.0, 0.01, 0.31, 0.32] + [0.32 + 0.01 * i for i in range(1, 10**6)])
    stalls, seen = [], threading.Event()

    def report(begin, end):
        stalls.append((begin, end))
        seen.set()

    meter = StallMeter(report, tick=0.01, slack=0.02, clock=lambda: next(times))
    meter.start()
    assert seen.wait(10), "no stall reported"
    meter.stop()
    assert not meter.running()
    assert stalls == [pytest.approx((0.02, 0.31))]
    # The owner stopped listening without stopping it (a fit that raised): it ends itself.
    alive = threading.Event()
    alive.set()
    orphan = StallMeter(lambda *_: None, alive=alive.is_set, tick=0.001)
    orphan.start()
    thread = orphan._thread
    alive.clear()
    thread.join(10)
    assert not thread.is_alive()


def test_step_timer_windows_of_steps_from_graph_and_host_marks():
    from tfdp.resilience.stragglers import StepTimer

    now = [100.0]
    timer = StepTimer(local_replicas=2, clock=lambda: now[0])

    def step(host_s, input_s, work_s, wait_s, replicas_batches=2):
        now[0] += host_s
        timer.call_started()
        now[0] += input_s
        for _ in range(replicas_batches):
            timer.add_batch(now[0])
        timer.add_wait(now[0] + work_s, now[0] + work_s + wait_s)
        now[0] += work_s + wait_s
        timer.call_ended()
        return timer.step_ended()

    assert step(0.001, 0.001, 0.002, 0.003) is None  # the first step: nothing before it
    timer.epoch_started()
    assert step(0.001, 0.001, 0.002, 0.003) is None  # starts an epoch: not measured
    for _ in range(4):
        step(0.002, 0.001, 0.003, 0.004)
    means, n = timer.window()
    assert n == 4 and means == pytest.approx([6.0, 3.0, 1.0, 2.0, 4.0])
    step(0.002, 0.001, 0.003, 0.004, replicas_batches=4)  # steps_per_execution=2: per step
    means, n = timer.window()
    assert n == 2 and means == pytest.approx([3.0, 1.5, 0.5, 1.0, 2.0])
    assert timer.window() == ([0.0] * 5, 0)
