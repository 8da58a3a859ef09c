"""Elastic membership and stragglers with real worker processes on 127.0.0.1 (issue 12).

The reference is one process with one replica at the same global batch: a job that shrinks
from 3 workers to 2, or grows from 2 to 3, must end with its weights (1e-5), because the
global batch, and with it every step's set of examples, stays the same.
"""

import json
import os
import re
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
    """One device with plain Adam: what every job here must end with, the sharded ones too
    (ZeRO's promise is the unsharded optimizer's weights, not its own on one device)."""
    adam = one_process(tmp_path_factory.mktemp("ref-adam"), TFDP_TEST_OPT="adam")
    return {"adam": adam, "sharded_adam": adam}


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
    # The steps file holds both jobs (each starts at attempt 0): the second starts where the
    # iteration count falls back. The first job ran to the kill after step 14 (slot 0 may be
    # stopped by the launcher before it records step 14).
    iterations = [it for _, _, it in steps_run(tmp_path)]
    second = max(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    assert iterations[:second] == list(range(1, second + 1)) and second in (13, 14), iterations
    assert iterations[second:] == list(range(11, STEPS + 1))  # from the backup at step 10
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
    assert not [line for line in log.splitlines() if "steps-slot" in line]
    assert len(steps_run(tmp_path)) == 3  # no step ran on 3 workers


class DutyCycle(threading.Thread):
    """Slows one worker from outside: SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, while the
    worker's own step count (read from its steps file) is in [first, last), or until the
    process is gone. This is load put on the worker, not synchronisation; the step count is
    polled, so the phase edges are approximate (the assertions leave a margin)."""

    def __init__(self, pid, steps_file, first, last=None, stop_s=0.15, run_s=0.05):
        super().__init__(daemon=True)
        self.pid, self.steps_file, self.first, self.last = pid, steps_file, first, last
        self.stop_s, self.run_s = stop_s, run_s
        self.done = threading.Event()

    def steps(self):
        try:
            with open(self.steps_file) as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    def run(self):
        try:
            while not self.done.is_set() and self.steps() < self.first:
                self.done.wait(0.02)  # polling the worker's progress
            while not self.done.is_set() and (self.last is None or self.steps() < self.last):
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


def run_with_duty_cycle(tmp_path, extra, env, first, last=None):
    """Starts tfdp-run; slows slot 1 from outside while its steps are in [first, last)."""
    proc = start_job(launcher(workers=3, cpu_replicas=1, extra=extra), env)
    wait_for_file(tmp_path / "pid-slot1-attempt0", proc, TIMEOUT)
    with open(tmp_path / "pid-slot1-attempt0") as f:
        slow = DutyCycle(int(f.read()), tmp_path / "steps-slot1.txt", first, last)
    slow.start()
    try:
        code, log = finish_job(proc, TIMEOUT)
    finally:
        slow.done.set()
        slow.join()
    return code, log


# One 3-worker run of the MLP (forward pass well under 1 ms, no added work) with four phases,
# by optimizer step: healthy; slot 1 stopped from outside (SIGSTOP 150 ms / SIGCONT 50 ms);
# slot 2's input pipeline slowed (its map sleeps 20 ms per batch); slot 0's forward pass
# slowed by 20 ms. Healthy gaps of three windows between them let a verdict end.
PHASES = {1: (200, 280), 2: (340, 420), 0: (480, 560)}  # rank slowed: [first, last) steps
STEPS_PER_EPOCH, WINDOW = 310, 20
LINE = re.compile(r"tfdp: straggler: rank (\d+) compute ([\d.]+) ms/step vs median ([\d.]+) "
                  r"ms/step over the last (\d+) steps \(in the step ([\d.]+), input ([\d.]+), "
                  r"host ([\d.]+); waiting ([\d.]+) ms/step; at step (\d+)\)")


def verdict_allowed(step):
    """The rank a straggler line at ``step`` may name: the phase's, or none while healthy."""
    for rank, (first, last) in PHASES.items():
        if first < step <= last + 3 * WINDOW:
            return rank
    return None


def phase_means(history, rank):
    """Per-rank means of each split field over the windows well inside ``rank``'s phase (a
    window's margin at the start: the phase edges are approximate)."""
    first, last = PHASES[rank]
    inside = [e for e in history if first + WINDOW < e["step"] - WINDOW and e["step"] <= last]
    assert inside, history
    return {field: [sum(e[f"{field}_ms"][r] for e in inside) / len(inside) for r in range(3)]
            for field in ("compute", "step", "input", "host", "wait")}


@pytest.mark.exclusive  # (d) a healthy run names nobody: only true without a noisy neighbour
def test_the_worker_the_others_wait_for_is_named_whatever_slows_it(tmp_path):
    env = environment(tmp_path, None, TFDP_TEST_N=24 * STEPS_PER_EPOCH, TFDP_TEST_GLOBAL_BATCH=24,
                      TFDP_TEST_EPOCHS=2, TFDP_TEST_SHUFFLE="", TFDP_TEST_MONITOR=WINDOW,
                      TFDP_TEST_SLOW="input:2:340:420,compute:0:480:560")
    code, log = run_with_duty_cycle(tmp_path, (), env, *PHASES[1])
    assert code == 0, log
    lines = [LINE.search(line) for line in log.splitlines() if "tfdp: straggler:" in line]
    assert lines and all(lines), log
    named = [(int(m.group(1)), int(m.group(9))) for m in lines]
    print("named (rank, at step):", named)
    # (d) nobody during the 200 healthy steps; (a), (b), (c): only the slowed worker.
    assert all(verdict_allowed(step) == rank for rank, step in named), named
    assert {rank for rank, _ in named} == {0, 1, 2}, named
    with open(tmp_path / "monitor-attempt0-rank0.json") as f:
        history = json.load(f)["history"]
    assert sum(e["steps"] for e in history) >= 2 * STEPS_PER_EPOCH - 2 * WINDOW - 2  # measured
    # Where each slowed worker's time went, and that the others waited for it.
    stopped = phase_means(history, 1)
    assert min(stopped["wait"][0], stopped["wait"][2]) > stopped["wait"][1], stopped
    starved = phase_means(history, 2)
    assert starved["input"][2] > max(starved["step"][2], starved["host"][2]), starved
    assert min(starved["wait"][0], starved["wait"][1]) > starved["wait"][2], starved
    busy = phase_means(history, 0)
    assert busy["step"][0] > max(busy["input"][0], busy["host"][0]), busy
    assert min(busy["wait"][1], busy["wait"][2]) > busy["wait"][0], busy


def steps_per_second(records):
    if len(records) < 2:
        return float("nan")
    return (len(records) - 1) / (records[-1][3] - records[0][3])


def test_eviction_of_a_stopped_worker_loses_nothing(tmp_path):
    # (e) the stopped worker of (a), with evict=True and --min-workers 2: the job backs up,
    # restarts on 2 workers and ends with the weights of an uninterrupted run.
    env = environment(tmp_path, tmp_path / "backup", TFDP_TEST_MONITOR=8, TFDP_TEST_EPOCHS=6,
                      TFDP_TEST_SAVE_FREQ=10, TFDP_TEST_EVICT=1, **KNOBS)
    code, log = run_with_duty_cycle(tmp_path, ("--max-restarts", "1", "--min-workers", "2"),
                                    env, first=20)
    assert code == 0, log
    assert "restart requested without rank 1" in log, log
    assert "worker 1 dropped" in log and "continuing on 2 workers" in log, log
    records = read_steps(tmp_path, slot=0)
    before = [r for r in records if r[0] == 0][20:]
    after = [r for r in records if r[0] == 1][2:]
    print(f"throughput with the straggler: {steps_per_second(before):.1f} steps/s; "
          f"after evicting it: {steps_per_second(after):.1f} steps/s")
    iterations = sorted({i for _, _, i, _ in records})
    assert iterations == list(range(1, 6 * 10 + 1))
    (tmp_path / "ref").mkdir()
    ref = one_process(tmp_path / "ref", TFDP_TEST_EPOCHS=6)
    assert_same_weights(weights(tmp_path), ref)
