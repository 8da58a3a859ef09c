"""Riders: values other mechanisms send with the gradients, and the registry of values
already reduced.

Rule: a value that every replica must sum at every optimizer update rides in the gradient
all-reduce, appended to the last floating bucket, so it costs no collective of its own.
Two kinds: a strategy-wide rider (the preemption stop flag, tfdp.resilience.preemption),
registered once on its strategy and carried by every gradient reduction traced from then on;
and a rider of one replica's step (the step's metric results, ``LogsRider``), carried by the
reductions traced inside ``riding_with_gradients``. A rider has ``contribution()`` (a tensor
of static shape, called in each replica while the reduction is traced; it may note that it
rides) and ``receive(total)`` (the sum over all replicas, same shape); a rider whose
``precise`` is True rides only in a bucket of 32 bits or more (not a compressed one).
The carrying itself is ``tfdp.strategy.collectives.all_reduce_gradients``.

Strategy-wide riders are held on their strategy (weakly): a strategy that is gone takes its
riders with it, and a new one never inherits them (they were keyed by ``id(strategy)``,
which a new strategy can reuse).
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from tfdp import process_state

__all__ = ["add_gradient_rider", "remove_gradient_rider", "riding_with_gradients", "board",
           "LogsRider", "mark_reduced", "is_reduced", "strategy_riders"]

_riders = weakref.WeakKeyDictionary()  # strategy -> [rider]
_replica_riders = threading.local()  # replicas trace their steps in threads of their own


def add_gradient_rider(strategy, rider) -> None:
    """Carries ``rider`` in ``strategy``'s gradient reductions traced from now on."""
    _riders.setdefault(strategy, []).append(rider)


def remove_gradient_rider(strategy, rider) -> None:
    riders = _riders.get(strategy, [])
    if rider in riders:
        riders.remove(rider)
    if not riders:
        _riders.pop(strategy, None)


def strategy_riders() -> int:
    """How many strategy-wide riders are registered (``tfdp.process_state``)."""
    return sum(len(r) for r in _riders.values())


class riding_with_gradients:  # a context manager, used as a statement
    """``with riding_with_gradients(rider):`` the gradient reductions this replica traces
    inside carry ``rider`` (None: nothing)."""

    def __init__(self, rider):
        self.rider = rider

    def __enter__(self):
        stack = getattr(_replica_riders, "stack", None)
        if stack is None:
            stack = _replica_riders.stack = []
        stack.append(self.rider)
        return self.rider

    def __exit__(self, *exc):
        _replica_riders.stack.pop()
        return False


def board(strategy, bucket_dtypes, compression_dtype):
    """Which bucket carries the riders (the last floating one) and the riders it carries:
    ``(bucket index, riders)``, or ``(None, [])``. ``compression_dtype``: the wire dtype of
    compressed buckets (None: uncompressed). A ``precise`` rider rides only in a bucket of 32
    bits or more on the wire."""
    floating = [k for k, dtype in enumerate(bucket_dtypes) if dtype.is_floating]
    if not floating:
        return None, []
    k = floating[-1]
    wire = compression_dtype or bucket_dtypes[k]
    riders = list(_riders.get(strategy, ()))
    riders += [r for r in getattr(_replica_riders, "stack", ()) if r is not None]
    riders = [r for r in riders if wire.size >= 4 or not getattr(r, "precise", False)]
    return (k, riders) if riders else (None, [])


class LogsRider:
    """One replica's step logs (Keras's metric results), averaged over all replicas by riding
    in the step's gradient all-reduce instead of an all-reduce of their own.

    ``mean_logs()`` is the logs' mean over all replicas, or None when they did not ride: no
    gradient reduction ran at this step's level (one traced under a condition, as with
    gradient accumulation or loss scaling, does not run at every step), or it had no bucket
    of 32 bits or more. The mean is what Keras's own per-step reduction of a multi-worker
    step computes (the sum over replicas divided by their count), so the logs stay the same.

    Args:
        logs: the replica's logs, a nest of floating scalars (anything else: ``of`` gives
            None and the logs are reduced the usual way).
        num_replicas: replicas in sync over all workers.
    """

    precise = True

    def __init__(self, logs, num_replicas):
        self.logs, self.num_replicas = logs, num_replicas
        self._flat = tf.nest.flatten(logs)
        self._graph = tf.compat.v1.get_default_graph()  # the step's own level
        self._total = None

    @classmethod
    def of(cls, logs, num_replicas):
        """A rider for ``logs``, or None where they cannot ride."""
        flat = tf.nest.flatten(logs)
        if not flat or not all(isinstance(v, tf.Tensor) and v.dtype.is_floating
                               and v.shape.rank == 0 for v in flat):
            return None
        return cls(logs, num_replicas)

    def contribution(self):
        return tf.stack([tf.cast(v, tf.float32) for v in self._flat])

    def receive(self, total):
        if total.graph is self._graph:
            self._total = total

    def mean_logs(self):
        if self._total is None:
            return None
        mean = self._total / tf.cast(self.num_replicas, self._total.dtype)
        values = [tf.cast(mean[k], v.dtype) for k, v in enumerate(self._flat)]
        mark_reduced(values)
        return tf.nest.pack_sequence_as(self.logs, values)


# graph -> ids of the tensors in it that hold a value already averaged over all replicas
# (``LogsRider``), which ``DataParallelStrategy.reduce`` then passes through without a
# collective. Weak: a traced function's graph takes its entries with it.
_reduced = weakref.WeakKeyDictionary()
_reduced_lock = threading.Lock()


def mark_reduced(tensors) -> None:
    """Notes that each of ``tensors`` (graph tensors) holds its mean over all replicas."""
    with _reduced_lock:
        for t in tensors:
            _reduced.setdefault(t.graph, set()).add(id(t))


def is_reduced(parts) -> bool:
    """Whether every tensor of ``parts`` is marked by ``mark_reduced``."""
    parts = list(parts)
    with _reduced_lock:
        return bool(parts) and all(
            isinstance(p, tf.Tensor) and hasattr(p, "graph")  # an eager tensor has none
            and id(p) in _reduced.get(p.graph, ()) for p in parts)


process_state.register("riders", __name__, strategy_riders, _riders.clear)
