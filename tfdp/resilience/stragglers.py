"""Stragglers: which worker the others wait for, whatever slows it.

Rules:

* **Synchronised waits.** Every collective (the gradient reduction, the input pipeline's
  end-of-data agreement where there is one, metric reductions, ShardedOptimizer's all-to-all
  and all-gather, the agreements between steps) ends only when the last worker has arrived.
  While a ``StepTimer`` listens, each collective traced into a step is timed on its worker:
  a graph timestamp when its input is ready and one when its result is, handed to the host
  by one ``tf.numpy_function`` off the critical path (``tfdp.strategy.timing``, which this
  module's ``StepTimer`` listens to). Agreements run from the host report their own interval.
* **Own time** = wall time per step minus the union of this worker's waits. The worker the
  others wait for has a long own time wherever its time goes (its compute, its input
  pipeline, Python and callbacks between steps, garbage collection, a stopped process); the
  workers that wait for it spend that time inside a collective, so theirs stays short.
* **Split** (``split_step``): *host* is own time outside the training function, *input* from
  the call to the batch being in hand, *step* from there to the call's return (forward,
  backward, update); *wait* is the union of the waits. The four add up to the wall time.
* **Judgement** (``find_stragglers``). Window means are summed across workers with one
  all-reduce per window; a worker whose own time is ``threshold`` times the median of the
  *others* (and more than ``min_excess_ms`` above it) is slow in that window.
* **Stalls** (``stall_interval``). A process that is not running (stopped, swapped out,
  starved of CPU) may be stopped inside a collective: its wait interval then grows by as
  much as the others', and the interval bounds alone would hide it. While the timer listens,
  a thread sleeps ``tick`` at a time; a wake-up more than ``slack`` late marks the time the
  process did not run. That time is the worker's own even inside a collective (the others
  waited for it there), so it is taken out of the waits.

On GPUs the timestamps mark when the ops around a collective are scheduled, not when the
device finishes them (not measured here: no GPU).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Sequence

from tfdp.strategy import timing

__all__ = ["find_stragglers", "StepSplit", "split_step", "stall_interval", "StallMeter",
           "StepTimer", "SPLIT_FIELDS"]

# Per step and worker, in this order in the gathered vector and the history.
SPLIT_FIELDS = ("compute", "step", "input", "host", "wait")


# --- pure decisions ---------------------------------------------------------------------

def find_stragglers(compute_ms: Sequence[float], threshold: float = 1.5,
                    min_excess_ms: float = 2.0) -> list[int]:
    """Ranks whose own time per step is ``threshold`` times the median of the others.

    The median of the *other* workers is the reference, so one slow worker among two is still
    found. ``min_excess_ms`` ignores differences too small to matter (timer noise on tiny
    steps). Needs at least two workers.

    Example:
        >>> find_stragglers([10.0, 11.0, 35.0])
        [2]
    """
    if len(compute_ms) < 2:
        return []
    slow = []
    for rank, mine in enumerate(compute_ms):
        others = [c for r, c in enumerate(compute_ms) if r != rank]
        reference = statistics.median(others)
        if mine > threshold * reference and mine - reference > min_excess_ms:
            slow.append(rank)
    return slow


def stall_interval(asleep: float, awake: float, tick: float, slack: float):
    """The time a process did not run, seen by a thread that slept ``tick`` from ``asleep``
    and woke at ``awake``: ``(asleep + tick, awake)`` when it woke more than ``slack`` late,
    else None (scheduling noise).

    Example:
        >>> stall_interval(0.0, 0.160, tick=0.01, slack=0.02)  # stopped for 150 ms
        (0.01, 0.16)
        >>> stall_interval(0.0, 0.015, tick=0.01, slack=0.02) is None
        True
    """
    if awake - asleep > tick + slack:
        return (asleep + tick, awake)
    return None


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """One step of one worker, in milliseconds: ``compute`` (own time) = ``step`` +
    ``input`` + ``host``; ``compute + wait`` is the step's wall time."""

    compute: float
    step: float
    input: float
    host: float
    wait: float

    def as_list(self) -> list[float]:
        return [getattr(self, name) for name in SPLIT_FIELDS]


def _union(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of ``intervals`` clipped to [lo, hi], as sorted disjoint intervals."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    merged: list[list[float]] = []
    for a, b in clipped:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif b > a:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(merged, lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged)


def _subtract(merged, holes) -> list[tuple[float, float]]:
    """Sorted disjoint ``merged`` minus sorted disjoint ``holes``."""
    out = []
    for a, b in merged:
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def split_step(start: float, call_start: float, batch_ready: float | None, call_end: float,
               end: float, waits, stalls=()) -> StepSplit:
    """Splits one step of one worker into own time (step, input, host) and waiting.

    Args:
        start: when the previous step ended (wall clock, seconds).
        call_start, call_end: when the training function was called and returned.
        batch_ready: when the first replica had its batch (None, or outside the call:
            unknown, no input time).
        end: when this step ended.
        waits: (begin, end) intervals spent in collectives; overlaps count once.
        stalls: (begin, end) intervals the process did not run (``stall_interval``): own
            time even where they overlap a wait.

    Example:
        >>> split = split_step(0.0, 0.001, 0.002, 0.010, 0.011, [(0.004, 0.009)])
        >>> [round(v, 6) for v in split.as_list()]  # compute, step, input, host, wait (ms)
        [6.0, 3.0, 1.0, 2.0, 5.0]
    """
    call_start = min(max(call_start, start), end)
    call_end = min(max(call_end, call_start), end)
    known = batch_ready is not None and call_start <= batch_ready <= call_end
    ready = batch_ready if known else call_start
    merged = _subtract(_union(waits, start, end), _union(stalls, start, end))

    def own(lo, hi):
        return max(0.0, (hi - lo) - _covered(merged, lo, hi))

    host = own(start, call_start) + own(call_end, end)
    got_input, step = own(call_start, ready), own(ready, call_end)
    ms = 1000.0
    return StepSplit(compute=ms * (host + got_input + step), step=ms * step,
                     input=ms * got_input, host=ms * host, wait=ms * _covered(merged, start, end))


# --- one worker's timeline -------------------------------------------------------------------

class StallMeter:
    """Notes when this process did not run (module docstring, *Stalls*).

    A daemon thread sleeps ``tick`` at a time and reports each late wake-up
    (``stall_interval``) to ``report(begin, end)``. It runs from ``start()`` until ``stop()``
    or until ``alive()`` turns false (its owner stopped listening without stopping it, e.g. a
    ``fit`` that raised), so it never outlives the measurement.

    Args:
        report: called with each stall's (begin, end), wall clock seconds.
        alive: polled every tick; the thread ends when it returns False.
        tick: seconds slept per tick.
        slack: lateness taken as scheduling noise.
        clock: the wall clock, as ``StepTimer``'s.
    """

    def __init__(self, report, alive=lambda: True, tick: float = 0.01, slack: float = 0.02,
                 clock=time.time):
        self._report, self._alive = report, alive
        self.tick, self.slack, self._clock = tick, slack, clock
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self):
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="tfdp-stall-meter", daemon=True)
        self._thread.start()

    def stop(self):
        self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self):
        asleep = self._clock()
        while not self._stopped.wait(self.tick) and self._alive():
            awake = self._clock()
            stall = stall_interval(asleep, awake, self.tick, self.slack)
            if stall is not None:
                self._report(*stall)
            asleep = awake


class StepTimer:
    """One worker's steps split into own time and waiting (module docstring).

    ``listen()`` while training; the callback marks the training function's call and return
    (``call_started``/``call_ended``), every step's end (``step_ended``) and epoch starts;
    the graph reports waits and batch times. ``window()`` returns the means since the last one.

    Args:
        local_replicas: this worker's replicas (each reports its batch).
        clock: the wall clock (seconds), as ``tf.timestamp`` reads it.
    """

    def __init__(self, local_replicas: int = 1, clock=time.time):
        self.local_replicas = max(1, int(local_replicas))
        self._clock = clock  # wall clock, as tf.timestamp: graph and host times compare
        self._lock = threading.Lock()
        self._waits: list[tuple[float, float]] = []
        self._stalls: list[tuple[float, float]] = []
        self._batches: list[float] = []
        self._last_end: float | None = None
        self._call: tuple[float, float] | None = None
        self._splits: list[StepSplit] = []
        self._stall_meter = StallMeter(self.add_stall, lambda: timing.is_listening(self),
                                       clock=clock)

    def listen(self):
        timing.listen(self)
        self._stall_meter.start()

    def stop(self):
        timing.stop_listening(self)
        self._stall_meter.stop()

    def add_stall(self, start: float, end: float):
        with self._lock:
            self._stalls.append((start, end))

    def add_wait(self, start: float, end: float):
        with self._lock:
            self._waits.append((start, end))

    def add_batch(self, stamp: float):
        with self._lock:
            self._batches.append(stamp)

    def call_started(self):
        self._call = (self._clock(), None)

    def call_ended(self):
        if self._call is not None:
            self._call = (self._call[0], self._clock())

    def epoch_started(self):
        """Steps that span an epoch boundary (iterator creation, epoch callbacks) are not
        measured: they are not training steps."""
        self._last_end = None

    def step_ended(self) -> StepSplit | None:
        """Closes the current step; returns its split (None when not measured)."""
        end = self._clock()
        start, call = self._last_end, self._call
        self._last_end, self._call = end, None
        with self._lock:
            waits, self._waits = self._waits, [w for w in self._waits if w[1] > end]
            stalls, self._stalls = self._stalls, [w for w in self._stalls if w[1] > end]
            batches, self._batches = self._batches, []
        if start is None or call is None or call[1] is None:
            return None
        in_call = [b for b in batches if call[0] <= b <= call[1]]
        split = split_step(start, call[0], min(in_call) if in_call else None, call[1], end, waits,
                           stalls)
        steps = max(1, len(in_call) // self.local_replicas)  # steps_per_execution > 1
        if steps > 1:
            split = StepSplit(*(v / steps for v in split.as_list()))
        self._splits.extend([split] * steps)
        return split

    def window(self) -> tuple[list[float], int]:
        """Mean of each ``SPLIT_FIELDS`` entry (ms/step) since the last call, and the number
        of measured steps."""
        splits, self._splits = self._splits, []
        if not splits:
            return [0.0] * len(SPLIT_FIELDS), 0
        means = [sum(values) / len(splits) for values in zip(*(s.as_list() for s in splits))]
        return means, len(splits)
