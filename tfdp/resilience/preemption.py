"""Preemption: SIGTERM to any worker stops every worker at the same step.

Rules:

* **Signal.** The SIGTERM handler only records the signal (``PreemptionWatcher``); the
  training loop decides at a step boundary. If the job has not exited ``grace_seconds -
  margin`` after the signal (a peer hung, a step that never ends), the process exits with
  ``tfdp.protocol.EXIT_PREEMPTED`` anyway, before the scheduler's SIGKILL, so the exit code
  still says "preempted".
* **Stop agreement** (``StopAgreement``). Every worker sums its flag with the others', so they
  all see the stop at the same step, back up at that step and exit together. Every
  ``check_every`` steps this is one scalar all-reduce of its own (``Agreement``). One process
  needs no collective.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from tfdp.protocol import DEFAULT_GRACE_SECONDS, EXIT_PREEMPTED, GRACE_ENV
from tfdp.resilience.agreement import Agreement

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


class StopAgreement:
    """Whether any worker received SIGTERM, decided identically on every worker.

    Args:
        watcher: this worker's ``PreemptionWatcher``.
        agreement: the ``Agreement`` of the job's workers.
        check_every: steps between agreements.
    """

    def __init__(self, watcher: PreemptionWatcher, agreement: Agreement, check_every: int = 1):
        self.watcher = watcher
        self.agreement = agreement
        self.check_every = int(check_every)

    def stop_after(self, global_step: int) -> bool:
        """Called after every step on every worker: True when the workers agreed to stop."""
        if global_step % self.check_every:
            return False
        return self.agreement.sum([1.0 if self.watcher.requested else 0.0])[0] > 0
