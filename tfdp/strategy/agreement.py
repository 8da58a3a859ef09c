"""Agreement: every worker learns the same small vector of numbers.

Rule. Each worker contributes its vector once (from its first local replica) to one all-reduce
(a sum), so every worker gets the same result and decides the same thing from it. Used for the
chief's backup choice, the stop flag where no gradient reduction carries it
(``tfdp.resilience.preemption``) and the straggler monitor's window timings. One worker needs no
collective. The time a worker spends in ``sum`` is time waiting for the others: it is reported
to the step timing (``tfdp.strategy.timing.note_wait``). Each sum runs under the
strategy's step deadline (``tfdp.strategy.deadline``), so a worker that never comes fails it, not hangs it.
"""

from __future__ import annotations

import time
from typing import Sequence

from tfdp.strategy import deadline, timing

__all__ = ["Agreement"]


class Agreement:
    """Sums small float vectors across workers with one all-reduce.

    Args:
        strategy: the strategy whose workers agree.
        num_workers: its number of workers (``strategy.cluster.num_workers``).
    """

    def __init__(self, strategy, num_workers: int):
        self.strategy = strategy
        self.num_workers = num_workers
        self._fn = None
        self._calls = 0

    def sum(self, values: Sequence[float]) -> list[float]:
        """The element-wise sum of every worker's ``values`` (the same on every worker)."""
        if self.num_workers <= 1:
            return [float(v) for v in values]
        import tensorflow as tf

        if self._fn is None:
            self._fn = _summing_function(self.strategy)
        start = time.time()
        first = self._calls == 0
        self._calls += 1
        with deadline.watching(self.strategy, "an agreement between the workers", first=first):
            result = self._fn(tf.constant(list(values), tf.float64))
        local = self.strategy.experimental_local_results(result)[0]
        summed = [float(v) for v in local.numpy()]
        timing.note_wait(start, time.time())
        return summed


def _summing_function(strategy):
    import tensorflow as tf

    from tfdp import _tf_private

    def replica_fn(x):
        ctx = tf.distribute.get_replica_context()
        first_local = tf.equal(_tf_private.local_replica_id(ctx), 0)
        mine = tf.where(first_local, x, tf.zeros_like(x))
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)

    # autograph=False: nothing here branches on a tensor, and autograph would convert
    # tfdp's strategy.run and the helpers it calls, once per process (0.5 s of CPU at a
    # worker's first agreement, measured with py-spy on a 2-worker job).
    @tf.function(autograph=False)
    def fn(x):
        return strategy.run(replica_fn, args=(x,))

    return fn
