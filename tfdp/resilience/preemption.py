"""Preemption: a preemption signal to any worker stops every worker at the same step.

Rules:

* **Which signals.** SIGTERM always (tfdp-run, Kubernetes, Slurm's ``PreemptMode`` and
  ``scancel`` all preempt with it). Inside a Slurm job (``SLURM_JOB_ID`` set) SIGUSR1 and
  SIGUSR2 too: Slurm sends them only when the user asked for a warning (``sbatch
  --signal=[B:]USR1@120``, ``scancel --signal=USR1``) and submitit asks for SIGUSR2 (its
  ``--signal=USR2@90`` before the time limit, also at a preemption where the cluster sets
  ``PreemptParameters=send_user_signal``), so there they mean "time is running out".
  Outside Slurm they are left alone: their default action ends the process, and other tools
  use them for other things (log rotation, stack dumps), so a generic worker has no reason
  to read them as a preemption. ``BackupAndRestore(preemption_signals=...)``, else
  ``TFDP_PREEMPTION_SIGNALS=SIGTERM,SIGUSR1`` (``tfdp.protocol.PREEMPTION_SIGNALS_ENV``),
  replaces that default; every set must contain SIGTERM (``preemption_signals``). A signal not
  in the set keeps its handler.
* **Signal.** The handler only records the signal (``PreemptionWatcher``); the training loop
  decides at a step boundary. Every preemption signal takes that one path: the same agreed
  stop, the same backup, the same exit code ``tfdp.protocol.EXIT_PREEMPTED`` (143), which is
  what a Slurm batch script tests before ``scontrol requeue`` (Slurm requeues on ``scontrol
  requeue``, ``--requeue`` with a node failure or ``PreemptMode=REQUEUE``, never on an exit
  code; docs/clusters.md has the script). If the job has not exited ``grace_seconds - margin``
  after the signal (a peer hung, a step that never ends), the process exits with
  ``EXIT_PREEMPTED`` anyway, before the scheduler's SIGKILL, so the exit code still says
  "preempted".
* **Passing the signal on.** A preemption signal whose handler before ``fit`` was a Python
  function (submitit's checkpoint-and-requeue on SIGUSR2, a script's own) is handed to that
  function once the agreed backup is written (``PreemptionWatcher.pass_on``): tfdp backs up
  at an exact step first, then whoever owned the signal does what it does (submitit requeues
  the job and exits). If it returns, or there is none, ``fit`` ends with ``Preempted`` (143).
* **Stop agreement** (``StopAgreement``). Every worker sums its flag with the others', so they
  all see the stop at the same step, back up at that step and exit together. The flag rides
  in the gradient all-reduce (one more element of its last bucket,
  ``tfdp.strategy.riders.add_gradient_rider``): it is agreed at every optimizer update and costs
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

from tfdp.protocol import (DEFAULT_GRACE_SECONDS, EXIT_PREEMPTED, GRACE_ENV,
                           PREEMPTION_SIGNALS_ENV)
from tfdp.strategy.agreement import Agreement

__all__ = ["PreemptionWatcher", "StopAgreement", "DEFAULT_GRACE_SECONDS", "preemption_signals",
           "SLURM_PREEMPTION_SIGNALS"]

log = logging.getLogger("tfdp")

# The warning signals Slurm sends only on request (--signal, scancel --signal; submitit's
# USR2), watched by default inside a Slurm job.
SLURM_PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# Signals no process can handle.
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def _parse_signal(item, source: str) -> signal.Signals:
    if isinstance(item, signal.Signals):
        return item
    text = str(item).strip()
    try:
        if text.lstrip("-").isdigit():
            return signal.Signals(int(text))
        name = text.upper()
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):
        raise ValueError(
            f"{source}: {text!r} is not a signal. Fix: give signal names such as SIGTERM, "
            "SIGUSR1, SIGUSR2 (or USR1, or their numbers).") from None


def preemption_signals(signals=None, environ=None) -> tuple[signal.Signals, ...]:
    """The signals that mean "preempted": ``signals`` if given, else
    ``TFDP_PREEMPTION_SIGNALS`` (comma-separated), else the default.

    The default is SIGTERM, plus SIGUSR1 and SIGUSR2 inside a Slurm job (``SLURM_JOB_ID``
    set): Slurm sends those only when asked to (``--signal=[B:]USR1@120``, ``scancel
    --signal``, submitit's USR2), so there they can only be the warning before a time limit
    or a preemption; elsewhere they end the process by default and other tools use them, so
    tfdp leaves them alone.

    Args:
        signals: names (``"SIGUSR1"``, ``"USR1"``), numbers or ``signal.Signals``; a string is
            split at commas.
        environ: where to read ``TFDP_PREEMPTION_SIGNALS`` and ``SLURM_JOB_ID`` (default
            ``os.environ``).

    Raises:
        ValueError: an unknown signal, SIGKILL or SIGSTOP (no process can handle them), or a
            set without SIGTERM (which tfdp-run, Kubernetes and Slurm preempt with).
    """
    environ = os.environ if environ is None else environ
    if signals is not None:
        source = f"preemption_signals={signals!r}"
    elif environ.get(PREEMPTION_SIGNALS_ENV, "").strip():
        signals = environ[PREEMPTION_SIGNALS_ENV]
        source = f"{PREEMPTION_SIGNALS_ENV}={signals!r}"
    else:
        extra = SLURM_PREEMPTION_SIGNALS if environ.get("SLURM_JOB_ID") else ()
        return (signal.SIGTERM,) + extra
    if isinstance(signals, (str, int, signal.Signals)):
        signals = str(signals).split(",") if isinstance(signals, str) else [signals]
    parsed = []
    for item in signals:
        if isinstance(item, str) and not item.strip():
            continue  # "SIGTERM,SIGUSR1," : a trailing comma
        s = _parse_signal(item, source)
        if s in _UNCATCHABLE:
            raise ValueError(f"{source}: {s.name} cannot be handled by any process, so it cannot "
                             "announce a preemption. Fix: leave it out.")
        if s not in parsed:
            parsed.append(s)
    if signal.SIGTERM not in parsed:
        raise ValueError(
            f"{source} leaves out SIGTERM, the signal tfdp-run, Kubernetes and Slurm preempt "
            f"with; without it a preempted worker dies without a backup. Fix: add SIGTERM, e.g. "
            f"{','.join(['SIGTERM'] + [s.name for s in parsed])}.")
    return tuple(parsed)


class PreemptionWatcher:
    """Turns the preemption signals into a flag, with a hard backstop at the end of the grace
    period.

    Args:
        grace_seconds: the grace period (default: ``TFDP_GRACE_SECONDS`` set by tfdp-run's
            ``--grace-period``, else ``tfdp.protocol.DEFAULT_GRACE_SECONDS``).
        margin_seconds: the backstop exits this long before the grace period ends.
        exit_code: the backstop's exit code.
        signals: the signals to watch (default: ``preemption_signals()``: SIGTERM, plus
            SIGUSR1/SIGUSR2 inside a Slurm job, or ``TFDP_PREEMPTION_SIGNALS``).
    """

    def __init__(self, grace_seconds: float | None = None, margin_seconds: float = 2.0,
                 exit_code: int = EXIT_PREEMPTED, signals=None):
        if grace_seconds is None:
            grace_seconds = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_SECONDS))
        self.grace_seconds = float(grace_seconds)
        self.margin_seconds = margin_seconds
        self.exit_code = exit_code
        self.signals = preemption_signals(signals)
        self.received_at: float | None = None
        self.received: list[signal.Signals] = []  # in arrival order, each once
        self._previous: dict = {}  # installed: signal -> the handler to put back
        self._handed: dict = {}  # signal -> the handler it had before install (for pass_on)
        self._passed_on = False
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    @property
    def received_signal(self) -> signal.Signals | None:
        """The first preemption signal received (None: none yet)."""
        return self.received[0] if self.received else None

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for s in self.signals:
            previous = signal.signal(s, self._on_signal)
            # setdefault: installed twice, the handler to put back is still the one before.
            self._previous.setdefault(s, previous)
            self._handed.setdefault(s, previous)

    def uninstall(self):
        # None: a handler not installed from Python (e.g. set in C), which Python cannot put
        # back; ours stays (it only sets a flag, with the backstop).
        for s, previous in self._previous.items():
            if previous is not None:
                signal.signal(s, previous)
        self._previous = {}

    def _on_signal(self, signum, frame):
        s = signal.Signals(signum)
        if s not in self.received:
            self.received.append(s)
        if self.received_at is not None:
            return
        self.received_at = time.monotonic()
        delay = max(0.5, self.grace_seconds - self.margin_seconds)
        self._timer = threading.Timer(delay, self._backstop)
        self._timer.daemon = True
        self._timer.start()

    def pass_on(self):
        """Calls, once, the Python handler each received signal had before ``install`` (in
        arrival order), e.g. submitit's checkpoint-and-requeue for SIGUSR2. For after the
        agreed backup: what that handler raises (submitit's ``SystemExit``) propagates. A
        default, ignored or C-level handler is not called: the caller exits with
        ``EXIT_PREEMPTED`` instead."""
        if self._passed_on:
            return
        self._passed_on = True
        for s in list(self.received):
            handler = self._handed.get(s)
            if callable(handler) and handler != self._on_signal:
                log.info("tfdp: preemption: passing %s on to the handler it had before fit "
                         "(%s)", s.name, getattr(handler, "__qualname__", handler))
                handler(int(s), None)

    def _backstop(self):
        name = self.received_signal.name if self.received_signal is not None else "the signal"
        log.error(
            "tfdp: preemption: no agreed stop within the %.0f s grace period after %s (a peer "
            "did not reach the next step boundary); exiting with %d without a new backup",
            self.grace_seconds, name, self.exit_code)
        os._exit(self.exit_code)

    def cancel_backstop(self):
        if self._timer is not None:
            self._timer.cancel()


class _StopFlagRider:
    """The stop flag as a rider of the gradient all-reduce (``tfdp.strategy.riders``)."""

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
    """Whether any worker received a preemption signal, decided identically on every worker.

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
            from tfdp.strategy import riders

            self._rider = _StopFlagRider(watcher)
            riders.add_gradient_rider(strategy, self._rider)

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
            from tfdp.strategy import riders

            riders.remove_gradient_rider(self._strategy, self._rider)
