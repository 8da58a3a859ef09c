"""Stragglers: which worker the others wait for.

Rules:

* **Step timing** (``StepTimer``). Two host callbacks in the graph mark when a replica has
  its input batch and when its gradients are ready (just before ``optimizer.apply``); the time
  between them is compute, the rest of the step is waiting for the other workers (the input
  pipeline's end-of-data agreement and the gradient reduction both finish only when the
  slowest worker arrives) plus the update.
* **Judgement** (``find_stragglers``). Window means are summed across workers with one
  all-reduce per window; a worker whose time is ``threshold`` times the median of the
  *others* (and more than ``min_excess_ms`` above it) is slow in that window.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Sequence

__all__ = ["find_stragglers", "StepTimer", "note_wait"]


def find_stragglers(compute_ms: Sequence[float], threshold: float = 1.5,
                    min_excess_ms: float = 2.0) -> list[int]:
    """Ranks whose compute time per step is ``threshold`` times the median of the others.

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


_wait_sinks: list = []


def note_wait(start: float, end: float) -> None:
    """Records that this worker waited for the others from ``start`` to ``end`` (wall clock,
    seconds), e.g. in a host-side agreement. A no-op unless a straggler monitor listens."""
    for sink in list(_wait_sinks):
        sink(start, end)


class StepTimer:
    """Per-step compute and wait times on one worker (module docstring: "Step timing").

    Compute runs from the moment the replica has its input batch (after the input
    pipeline's own cross-worker agreement on whether data remains, where fast workers
    already wait for slow ones) to the moment its gradients are ready; the rest of the host
    step is waiting (for input agreement, the reduction, the update, metric reduction).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._begin: list[float] = []
        self._ready: list[float] = []
        self.begin = None
        self.compute_ms: list[float] = []
        self.wait_ms: list[float] = []

    def record_begin(self):
        with self._lock:
            self._begin.append(time.time())
        return 0.0

    def record_ready(self):
        with self._lock:
            self._ready.append(time.time())
        return 0.0

    def on_begin(self):
        with self._lock:
            self._begin.clear()
            self._ready.clear()
        self.begin = time.time()

    def on_end(self):
        end = time.time()
        if self.begin is None:
            return
        with self._lock:
            start = min(self._begin) if self._begin else self.begin
            ready = max(self._ready) if self._ready else None
        if ready is None or ready < start:  # a micro-batch without an update: all compute
            ready = end
        total = end - self.begin
        compute = min(total, max(0.0, ready - start))
        self.compute_ms.append(1000.0 * compute)
        self.wait_ms.append(1000.0 * (total - compute))

    def window(self) -> tuple[float, float, int]:
        """Mean compute and wait (ms) since the last call, and the number of steps."""
        n = len(self.compute_ms)
        if not n:
            return 0.0, 0.0, 0
        c, w = sum(self.compute_ms) / n, sum(self.wait_ms) / n
        self.compute_ms.clear()
        self.wait_ms.clear()
        return c, w, n
