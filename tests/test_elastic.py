"""Elastic membership and stragglers with real worker processes on 127.0.0.1 (issue 12).

The reference is one process with one replica at the same global batch: a job that shrinks
from 3 workers to 2, or grows from 2 to 3, must end with its weights (1e-5), because the
global batch, and with it every step's set of examples, stays the same.
"""

import json
import os
import signal
import sys
import threading

import pytest

from launching import finish_job, run_job, start_job, wait_for_file
from resume_job import (TIMEOUT, WORKER, assert_same_weights, environment, launcher, steps_run,
                        weights)

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]
KNOBS = dict(TFDP_TEST_N=240, TFDP_TEST_GLOBAL_BATCH=24)  # 10 steps per epoch
STEPS = 30


def one_process(out, **knobs):
    env = environment(out, None, TFDP_CPU_REPLICAS=1, **{**KNOBS, **knobs})
    code, log = run_job([sys.executable, WORKER], env, TIMEOUT)
    assert code == 0, log
    return weights(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    results = {}
    for opt in ("adam", "sharded_adam"):
        results[opt] = one_process(tmp_path_factory.mktemp(f"ref-{opt}"), TFDP_TEST_OPT=opt)
    return results


def read_steps(out, slot):
    with open(os.path.join(out, f"steps-slot{slot}.txt")) as f:
        return [(int(a), int(r), int(i), float(t)) for a, r, i, t in
                (line.split() for line in f if line.strip())]


@pytest.mark.parametrize("opt", ["adam", "sharded_adam"])
def test_a_lost_host_is_dropped_and_the_job_ends_like_one_device(tmp_path, reference, opt):
    # Slot 2 dies mid-epoch 1 and fails at every start after that (its host is gone).
    code, log = run_job(launcher(workers=3, cpu_replicas=1,
                                 extra=("--max-restarts", "3", "--min-workers", "2")),
                        environment(tmp_path, tmp_path / "backup", TFDP_TEST_OPT=opt,
                                    TFDP_TEST_FAIL="2:14:kill", TFDP_TEST_BROKEN_SLOT=2, **KNOBS),
                        TIMEOUT)
    assert code == 0, log
    assert "worker 2 dropped" in log and "continuing on 2 workers" in log, log
    records = steps_run(tmp_path, slot=0)
    last = max(a for a, _, _ in records)
    resumed = [it for a, _, it in records if a == last]
    assert resumed == list(range(11, STEPS + 1))  # from the backup at step 10, on 2 workers
    assert "2 workers, 2 replicas" in log
    assert_same_weights(weights(tmp_path), reference[opt])


def test_a_two_worker_backup_resumes_on_three_workers(tmp_path, reference):
    backup = tmp_path / "backup"
    code, log = run_job(launcher(workers=2, cpu_replicas=1),
                        environment(tmp_path, backup, TFDP_TEST_FAIL="1:14:kill", **KNOBS), TIMEOUT)
    assert code == 137, log
    code, log = run_job(launcher(workers=3, cpu_replicas=1), environment(tmp_path, backup, **KNOBS),
                        TIMEOUT)
    assert code == 0, log
    assert "3 workers, 3 replicas" in log
    resumed = [it for a, _, it in steps_run(tmp_path)][14:]
    assert resumed == list(range(11, STEPS + 1))
    assert_same_weights(weights(tmp_path), reference["adam"])


def test_an_indivisible_global_batch_on_the_new_size_is_a_clear_error(tmp_path):
    # A 2-worker job at global batch 20 cannot resume on 3 replicas at the same global batch.
    env = environment(tmp_path, tmp_path / "backup", TFDP_TEST_N=200, TFDP_TEST_GLOBAL_BATCH=20,
                      TFDP_TEST_FAIL="1:3:kill")
    code, log = run_job(launcher(workers=2, cpu_replicas=1), env, TIMEOUT)
    assert code == 137, log
    code, log = run_job(launcher(workers=3, cpu_replicas=1), env, TIMEOUT)
    assert code != 0
    assert "global_batch_size=20 is not divisible by the 3 replicas" in log, log
    assert not [l for l in log.splitlines() if "steps-slot" in l]
    assert len(steps_run(tmp_path)) == 3  # no step ran on 3 workers


class DutyCycle(threading.Thread):
    """Slows one worker from outside: SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, until
    told to end or the process is gone. This is load put on the worker, not synchronisation."""

    def __init__(self, pid, stop_s=0.15, run_s=0.05):
        super().__init__(daemon=True)
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.done = threading.Event()

    def run(self):
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.run_s)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def slowed_job(tmp_path, evict):
    extra = ("--max-restarts", "1", "--min-workers", "2") if evict else ()
    env = environment(tmp_path, tmp_path / "backup", TFDP_TEST_MONITOR=8, TFDP_TEST_EPOCHS=6,
                      TFDP_TEST_COMPUTE_MS=20,
                      TFDP_TEST_SAVE_FREQ=10, **({"TFDP_TEST_EVICT": 1} if evict else {}), **KNOBS)
    proc = start_job(launcher(workers=3, cpu_replicas=1, extra=extra), env)
    wait_for_file(tmp_path / "pid-slot2-attempt0", proc, TIMEOUT)
    with open(tmp_path / "pid-slot2-attempt0") as f:
        slow = DutyCycle(int(f.read()))
    wait_for_file(tmp_path / "steps-slot2.txt", proc, TIMEOUT)  # training has started
    slow.start()
    try:
        code, log = finish_job(proc, TIMEOUT)
    finally:
        slow.done.set()
        slow.join()
    return code, log


def steps_per_second(records):
    if len(records) < 2:
        return float("nan")
    return (len(records) - 1) / (records[-1][3] - records[0][3])


def test_a_slowed_worker_is_named_and_healthy_ones_are_not(tmp_path):
    code, log = slowed_job(tmp_path, evict=False)
    assert code == 0, log
    lines = [l for l in log.splitlines() if "tfdp: straggler:" in l]
    assert lines and all("rank 2 compute" in l for l in lines), log
    assert "over the last 8 steps" in lines[0]
    with open(tmp_path / "monitor-attempt0-rank0.json") as f:
        monitor = json.load(f)
    assert monitor["stragglers"] == [2]
    last = monitor["history"][-1]
    assert last["compute_ms"][2] > 1.5 * max(last["compute_ms"][:2])
    assert last["wait_ms"][0] > last["wait_ms"][2]  # the healthy workers wait for it


def test_eviction_drops_the_straggler_and_loses_nothing(tmp_path, reference):
    code, log = slowed_job(tmp_path, evict=True)
    assert code == 0, log
    assert "restart requested without rank 2" in log, log
    assert "worker 2 dropped" in log and "continuing on 2 workers" in log, log
    records = read_steps(tmp_path, slot=0)
    before = [r for r in records if r[0] == 0][8:]  # after the first window
    after = [r for r in records if r[0] == 1][2:]
    print(f"throughput with the straggler: {steps_per_second(before):.1f} steps/s; "
          f"after evicting it: {steps_per_second(after):.1f} steps/s")
    iterations = sorted({i for _, _, i, _ in records})
    assert iterations == list(range(1, 6 * 10 + 1))
    (tmp_path / "ref").mkdir()
    ref = one_process(tmp_path / "ref", TFDP_TEST_EPOCHS=6, TFDP_TEST_COMPUTE_MS=20)
    assert_same_weights(weights(tmp_path), ref)
