"""``StragglerMonitor``: names the worker the others wait for, and can evict it.

The timing and the judgement are in ``tfdp.resilience.stragglers``; this module is the Keras
callback that installs the timing, gathers a window across workers and acts on it.
"""

from __future__ import annotations

import logging
import statistics
import warnings

import keras

from tfdp.callbacks import _running
from tfdp.callbacks.chief import cluster_of
from tfdp.resilience import elastic, stragglers
from tfdp.strategy import keras_integration, timing
from tfdp.strategy.agreement import Agreement

__all__ = ["StragglerMonitor"]

log = logging.getLogger("tfdp")

_FIELDS = stragglers.SPLIT_FIELDS  # compute (own time) = step + input + host; wait


class StragglerMonitor(keras.callbacks.Callback):
    """Names the worker the others wait for, whatever slows it, and can evict it.

    Every collective ends only when the last worker arrives, so the worker the others wait
    for is the one whose time goes elsewhere. Each step of each worker is split
    (``tfdp.resilience.stragglers``) into time waiting in collectives for the others
    (*wait*) and its own time (*compute*), which is itself split into *step* (forward,
    backward, update, once the batch is in hand), *input* (getting the batch) and *host*
    (Python between steps: callbacks, garbage collection, a stopped or starved process).
    Every ``window`` steps the window means are summed across workers with one all-reduce,
    so every worker sees every worker's numbers. A worker whose own time is ``threshold``
    times the median of the others (and ``min_excess_ms`` above it) for ``patience`` windows
    in a row is a straggler; the chief logs

        tfdp: straggler: rank R compute X ms/step vs median Y ms/step over the last K steps
        (in the step A, input B, host C; waiting D ms/step; at step S)

    The latest window's numbers go into the Keras logs as ``tfdp_compute_ms_rank{r}`` (own
    time), ``tfdp_step_ms_rank{r}``, ``tfdp_input_ms_rank{r}``, ``tfdp_host_ms_rank{r}`` and
    ``tfdp_wait_ms_rank{r}`` (so ``CSVLogger`` and ``TensorBoard`` record them).

    With ``evict=True``, when the launcher allows the job to shrink (``tfdp-run
    --min-workers`` below the current count, restarts left), all workers back up at the same
    step (through ``BackupAndRestore``, which must be in the callbacks) and exit with 75;
    tfdp-run restarts the job without the straggler's slot. Otherwise it only logs.

    Nothing is measured without this callback: the timing is traced into the training step
    only while it is in use. Steps that start an epoch are not measured.

    Args:
        window: steps per measurement window (one all-reduce per window).
        threshold: slower than ``threshold`` x the others' median own time.
        patience: consecutive windows before a worker is called a straggler.
        min_excess_ms: ignore excesses smaller than this (timer noise).
        evict: restart without a persistent straggler when the launcher allows it.
        strategy: the strategy (default: the model's).

    References:
        Horovod's stall inspector (names the ranks the others wait for at a collective).
    """

    def __init__(self, window=20, threshold=1.5, patience=2, min_excess_ms=2.0, evict=False,
                 strategy=None):
        super().__init__()
        if window < 2:
            raise ValueError(f"window={window}: need at least 2 steps per window.")
        if threshold <= 1.0:
            raise ValueError(f"threshold={threshold}: must be > 1 (a ratio to the median).")
        self.window = int(window)
        self.threshold = float(threshold)
        self.patience = int(patience)
        self.min_excess_ms = float(min_excess_ms)
        self.evict = bool(evict)
        self._strategy = strategy
        self.history = []  # one dict per window: step, <field>_ms per rank, slow, stragglers
        self.stragglers = set()

    def get_config(self):
        return {"window": self.window, "threshold": self.threshold, "patience": self.patience,
                "min_excess_ms": self.min_excess_ms, "evict": self.evict,
                "strategy": self._strategy}

    # --- fit hooks --------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        strategy = self._strategy or self.model.distribute_strategy
        cluster = cluster_of(strategy)
        self._num_workers, self._rank = cluster.num_workers, cluster.rank
        self._agreement = Agreement(strategy, self._num_workers)
        self._timer = stragglers.StepTimer(len(strategy.extended.worker_devices))
        self._streak = [0] * self._num_workers
        self._steps = 0
        self._latest = {}
        self._marked = False
        self._install_hooks()
        if self.evict and _running.backup() is None:
            warnings.warn("StragglerMonitor(evict=True) needs tfdp.callbacks.BackupAndRestore in the "
                          "same fit (placed before it) to back up before a restart; only logging.",
                          stacklevel=2)

    def on_train_end(self, logs=None):
        self._remove_hooks()

    def on_epoch_begin(self, epoch, logs=None):
        self._timer.epoch_started()

    def on_train_batch_begin(self, batch, logs=None):
        if self.model.train_function is not self._wrapped:  # rebuilt by another callback
            self._wrap_train_function()

    def on_train_batch_end(self, batch, logs=None):
        self._timer.step_ended()
        self._steps += 1
        if not self._marked:
            elastic.mark_progress(self._rank)
            self._marked = True
        if self._steps == 1:  # the first step includes tracing: not a measurement
            self._timer.window()
        elif (self._steps - 1) % self.window == 0:  # the same step on every worker
            self._close_window()
        if logs is not None:
            logs.update(self._latest)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._latest)

    # --- the window -------------------------------------------------------------------------
    def _close_window(self):
        means, n = self._timer.window()
        width = len(_FIELDS)
        vec = [0.0] * (width * self._num_workers)
        vec[width * self._rank:width * (self._rank + 1)] = means
        summed = self._agreement.sum(vec)
        per_field = {f: summed[i::width] for i, f in enumerate(_FIELDS)}
        compute_ms = per_field["compute"]
        slow = stragglers.find_stragglers(compute_ms, self.threshold, self.min_excess_ms)
        self._streak = [s + 1 if r in slow else 0 for r, s in enumerate(self._streak)]
        persistent = [r for r, s in enumerate(self._streak) if s >= self.patience]
        self._latest = {f"tfdp_{f}_ms_rank{r}": per_field[f][r]
                        for f in _FIELDS for r in range(self._num_workers)}
        self.history.append({"step": self._steps, "steps": n, "slow": slow,
                             "stragglers": persistent,
                             **{f"{f}_ms": per_field[f] for f in _FIELDS}})
        for r in persistent:
            self.stragglers.add(r)
            if self._rank == 0:
                log.warning(self._line(r, per_field, n))
        running = _running.backup()
        if persistent and self.evict and running is not None:
            allowed, why = elastic.membership_allows_eviction(self._num_workers)
            worst = max(persistent, key=lambda r: compute_ms[r])
            if allowed:
                running.request_restart(worst, f"straggler: compute {compute_ms[worst]:.1f} ms/step")
            elif self._rank == 0 and not getattr(self, "_said_no_evict", False):
                self._said_no_evict = True
                log.warning("tfdp: straggler rank %d not evicted: %s", worst, why)

    def _line(self, r, per_field, n):
        compute = per_field["compute"]
        median = statistics.median(c for i, c in enumerate(compute) if i != r)
        return (f"tfdp: straggler: rank {r} compute {compute[r]:.1f} ms/step vs median "
                f"{median:.1f} ms/step over the last {n} steps (in the step "
                f"{per_field['step'][r]:.1f}, input {per_field['input'][r]:.1f}, host "
                f"{per_field['host'][r]:.1f}; waiting {per_field['wait'][r]:.1f} ms/step; "
                f"at step {self._steps})")

    # --- the hooks: added per model instance only while the monitor is in use ----------------
    def _install_hooks(self):
        model, timer = self.model, self._timer
        keras_integration.require("collective_timing")
        timer.listen()
        original_step = model.train_step

        def train_step(data):
            timing.mark_batch_in_hand(data)
            return original_step(data)

        # It only observes: tfdp's own train steps (which do not call model.train_step) stamp
        # the batch themselves, and still count this as Keras's step (tfdp.strategy.xla).
        train_step._tfdp_transparent = True
        model.train_step = train_step
        # A train function traced before the hooks existed would not time anything.
        model.make_train_function(force=True)
        self._hooked = model
        self._wrap_train_function()

    def _wrap_train_function(self):
        traced, timer = self.model.train_function, self._timer

        def train_function(iterator):
            timer.call_started()
            try:
                return traced(iterator)
            finally:
                timer.call_ended()

        self.model.train_function = self._wrapped = train_function

    def _remove_hooks(self):
        self._timer.stop()
        model = getattr(self, "_hooked", None)
        if model is not None:
            try:
                del model.train_step
            except AttributeError:
                pass
            model.train_function = None
            self._hooked = None
