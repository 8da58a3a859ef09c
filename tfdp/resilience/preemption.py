"""Preemption: SIGTERM to any worker stops every worker at the same step.

Rules:

* **Signal.** The SIGTERM handler only records the signal (``PreemptionWatcher``); the
  training loop decides at a step boundary. If the job has not exited ``grace_seconds -
  margin`` after the signal (a peer hung, a step that never ends), the process exits with
  ``tfdp.protocol.EXIT_PREEMPTED`` anyway, before the scheduler's SIGKILL, so the exit code
  still says "preempted".
* **Stop agreement** (``StopAgreement``). Every worker sums its flag with the others', so they
  all see the stop at the same step, back up at that step and exit together. The flag rides
  in the gradient all-reduce (one more element of its last bucket,
  ``tfdp.collectives.add_gradient_rider``): it is agreed at every optimizer update and costs
  no collective of its own. Where no gradient reduction carries it (``ShardedOptimizer``
  reduces its own way, a model without dense gradients, a train step traced before the
  callback started), it is one scalar all-reduce of its own (``Agreement``) every
  ``check_every`` steps. Whether the flag rides is known when the step is traced, the same
  on every worker. One process needs no collective.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np

from tfdp.protocol import DEFAULT_GRACE_SECONDS, EXIT_PREEMPTED, GRACE_ENV
from tfdp.strategy.agreement import Agreement

__all__ = ["PreemptionWatcher", "StopAgreement", "DEFAULT_GRACE_SECONDS"]

log = logging.getLogger("tfdp")


class PreemptionWatcher:
    """Turns SIGTERM into a flag, with a hard backstop at the end of the grace period.

    Args:
        grace_seconds: the grace period (default: ``TFDP_GRACE_SECONDS`` set by tfdp-run's
            ``--grace-period``, else ``tfdp.protocol.DEFAULT_GRACE_SECONDS``).
        margin_seconds: the backstop exits this long before the grace period ends.
        exit_code: the backstop's exit code.
    """

    def __init__(self, grace_seconds: float | None = None, margin_seconds: float = 2.0,
                 exit_code: int = EXIT_PREEMPTED):
        if grace_seconds is None:
            grace_seconds = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_SECONDS))
        self.grace_seconds = float(grace_seconds)
        self.margin_seconds = margin_seconds
        self.exit_code = exit_code
        self.received_at: float | None = None
        self._previous = None
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame):
        if self.received_at is not None:
            return
        self.received_at = time.monotonic()
        delay = max(0.5, self.grace_seconds - self.margin_seconds)
        self._timer = threading.Timer(delay, self._backstop)
        self._timer.daemon = True
        self._timer.start()

    def _backstop(self):
        log.error(
            "tfdp: preemption: no agreed stop within the %.0f s grace period (a peer did not "
            "reach the next step boundary); exiting with %d without a new backup",
            self.grace_seconds, self.exit_code)
        os._exit(self.exit_code)

    def cancel_backstop(self):
        if self._timer is not None:
            self._timer.cancel()


class _StopFlagRider:
    """The stop flag as a rider of the gradient all-reduce (``tfdp.collectives``)."""

    def __init__(self, watcher: PreemptionWatcher):
        self.watcher = watcher
        self.rides = False  # traced into a gradient reduction
        self._lock = threading.Lock()
        self._received = None  # the largest sum received since the last take()

    def _flag(self):
        return np.float32(1.0 if self.watcher.requested else 0.0)

    def _on_received(self, total):
        with self._lock:
            self._received = max(self._received or 0.0, float(total))

    # Both host calls run order-independently: tf.function would otherwise chain them with
    # the other replicas' stateful ops, so replica 1's flag would wait for replica 0's
    # received sum, which waits for replica 1's all-reduce (a deadlock with 2+ replicas).
    def contribution(self):
        import tensorflow as tf

        from tfdp import _tf_private

        self.rides = True
        flag = tf.numpy_function(self._flag, [], tf.float32, stateful=True, name="tfdp_stop_flag")
        flag.set_shape([])
        _tf_private.run_independently(flag.op)
        return flag

    def receive(self, total):
        import tensorflow as tf

        from tfdp import _tf_private

        # With no outputs, numpy_function returns its op.
        _tf_private.run_independently(tf.numpy_function(
            lambda t: self._on_received(t) or (), [total], [], stateful=True,
            name="tfdp_stop_agreed"))

    def take(self):
        """The agreed sum of the last call of the training function (None: no reduction)."""
        with self._lock:
            received, self._received = self._received, None
        return received


class StopAgreement:
    """Whether any worker received SIGTERM, decided identically on every worker.

    Args:
        watcher: this worker's ``PreemptionWatcher``.
        agreement: the ``Agreement`` of the job's workers.
        check_every: steps between agreements of their own (when the flag cannot ride).
        strategy: whose gradient reduction carries the flag (None: never carried).
    """

    def __init__(self, watcher: PreemptionWatcher, agreement: Agreement, check_every: int = 1,
                 strategy=None):
        self.watcher = watcher
        self.agreement = agreement
        self.check_every = int(check_every)
        self._strategy = strategy
        self._rider = None
        if strategy is not None and agreement.num_workers > 1:
            from tfdp.strategy import collectives

            self._rider = _StopFlagRider(watcher)
            collectives.add_gradient_rider(strategy, self._rider)

    @property
    def rides_with_gradients(self) -> bool:
        """True once a traced step carries the flag in its gradient reduction."""
        return self._rider is not None and self._rider.rides

    def stop_after(self, global_step: int) -> bool:
        """Called after every step on every worker: True when the workers agreed to stop."""
        if self.rides_with_gradients:
            agreed = self._rider.take()  # None on steps without an optimizer update
            return agreed is not None and agreed > 0
        if global_step % self.check_every:
            return False
        return self.agreement.sum([1.0 if self.watcher.requested else 0.0])[0] > 0

    def close(self):
        """Stops carrying the flag in gradient reductions traced from now on."""
        if self._rider is not None:
            from tfdp.strategy import collectives

            collectives.remove_gradient_rider(self._strategy, self._rider)
