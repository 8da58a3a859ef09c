"""``StragglerMonitor``: names the worker the others wait for, and can evict it.

The timing and the judgement are in ``tfdp.resilience.stragglers``; this module is the Keras
callback that installs the timing hooks, gathers a window across workers and acts on it.
"""

from __future__ import annotations

import logging
import statistics
import warnings

import keras
import tensorflow as tf

from tfdp.callbacks import _running
from tfdp.callbacks.chief import cluster_of
from tfdp.resilience import elastic, stragglers
from tfdp.resilience.agreement import Agreement

__all__ = ["StragglerMonitor"]

log = logging.getLogger("tfdp")


class StragglerMonitor(keras.callbacks.Callback):
    """Finds workers that are persistently slower than the rest, and can evict them.

    Each step of each worker is split at the moment its gradients are ready: before it is
    *compute* (forward, backward), after it is *wait* (the reduction, which completes only
    when the slowest worker arrives, plus the update). Every ``window`` steps the window
    means are summed across workers with one all-reduce, so every worker sees every worker's
    numbers. A worker whose compute is ``threshold`` times the median of the others for
    ``patience`` windows in a row is a straggler; the chief logs

        tfdp: straggler: rank R compute X ms/step vs median Y ms/step over the last K steps

    The latest window's numbers go into the Keras logs as ``tfdp_compute_ms_rank{r}`` and
    ``tfdp_wait_ms_rank{r}`` (so ``CSVLogger`` and ``TensorBoard`` record them).

    With ``evict=True``, when the launcher allows the job to shrink (``tfdp-run
    --min-workers`` below the current count, restarts left), all workers back up at the same
    step (through ``BackupAndRestore``, which must be in the callbacks) and exit with 75;
    tfdp-run restarts the job without the straggler's slot. Otherwise it only logs.

    Without this callback nothing is measured (the timing hook is added to the training
    step only while the callback is in use).

    Args:
        window: steps per measurement window (one all-reduce per window).
        threshold: slower than ``threshold`` x the others' median compute time.
        patience: consecutive windows before a worker is called a straggler.
        min_excess_ms: ignore excesses smaller than this (timer noise).
        evict: restart without a persistent straggler when the launcher allows it.
        strategy: the strategy (default: the model's).

    References:
        Horovod's stall inspector; "Straggler mitigation" in MLPerf-style large-scale training.
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
        self.history = []  # one dict per window: compute_ms, wait_ms, stragglers, step
        self.stragglers = set()

    def get_config(self):
        return {"window": self.window, "threshold": self.threshold, "patience": self.patience,
                "min_excess_ms": self.min_excess_ms, "evict": self.evict,
                "strategy": self._strategy}

    def on_train_begin(self, logs=None):
        strategy = self._strategy or self.model.distribute_strategy
        cluster = cluster_of(strategy)
        self._num_workers, self._rank = cluster.num_workers, cluster.rank
        self._agreement = Agreement(strategy, self._num_workers)
        self._timer = stragglers.StepTimer()
        self._streak = [0] * self._num_workers
        self._steps = 0
        self._latest = {}
        self._marked = False
        self._install_hook()
        if self.evict and _running.backup() is None:
            warnings.warn("StragglerMonitor(evict=True) needs tfdp.callbacks.BackupAndRestore in the "
                          "same fit (placed before it) to back up before a restart; only logging.",
                          stacklevel=2)

    def on_train_end(self, logs=None):
        self._remove_hook()

    def on_train_batch_begin(self, batch, logs=None):
        self._timer.on_begin()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        self._timer.on_end()
        if self._steps == 1:  # the first step includes tracing: not a measurement
            self._timer.window()
        if not self._marked:
            elastic.mark_progress(self._rank)
            self._marked = True
        if self._steps > 1 and (self._steps - 1) % self.window == 0:
            self._close_window()
        if logs is not None:
            logs.update(self._latest)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._latest)

    def _close_window(self):
        compute, wait, n = self._timer.window()
        vec = [0.0] * (2 * self._num_workers)
        vec[2 * self._rank], vec[2 * self._rank + 1] = compute, wait
        summed = self._agreement.sum(vec)
        compute_ms = summed[0::2]
        wait_ms = summed[1::2]
        slow = stragglers.find_stragglers(compute_ms, self.threshold, self.min_excess_ms)
        self._streak = [s + 1 if r in slow else 0 for r, s in enumerate(self._streak)]
        persistent = [r for r, s in enumerate(self._streak) if s >= self.patience]
        self._latest = {}
        for r in range(self._num_workers):
            self._latest[f"tfdp_compute_ms_rank{r}"] = compute_ms[r]
            self._latest[f"tfdp_wait_ms_rank{r}"] = wait_ms[r]
        self.history.append({"step": self._steps, "compute_ms": compute_ms, "wait_ms": wait_ms,
                             "stragglers": persistent})
        for r in persistent:
            self.stragglers.add(r)
            if self._rank == 0:
                median = statistics.median(c for i, c in enumerate(compute_ms) if i != r)
                line = (f"tfdp: straggler: rank {r} compute {compute_ms[r]:.1f} ms/step vs median "
                        f"{median:.1f} ms/step over the last {n} steps")
                log.warning(line)
        running = _running.backup()
        if persistent and self.evict and running is not None:
            allowed, why = elastic.membership_allows_eviction(self._num_workers)
            worst = max(persistent, key=lambda r: compute_ms[r])
            if allowed:
                running.request_restart(worst, f"straggler: compute {compute_ms[worst]:.1f} ms/step")
            elif self._rank == 0 and not getattr(self, "_said_no_evict", False):
                self._said_no_evict = True
                log.warning("tfdp: straggler rank %d not evicted: %s", worst, why)

    # The hooks: host callbacks in the graph when the replica has its batch (start of
    # train_step) and when its gradients exist (before optimizer.apply). Added per model and
    # optimizer instance only while the monitor is in use.
    def _install_hook(self):
        model, optimizer, timer = self.model, self.model.optimizer, self._timer
        original_apply, original_step = optimizer.apply, model.train_step

        def apply(grads, trainable_variables=None):
            dense = [g for g in grads if isinstance(g, tf.Tensor)]
            with tf.control_dependencies(dense):
                stamp = tf.py_function(timer.record_ready, [], tf.float32)
            with tf.control_dependencies([stamp]):
                grads = [tf.identity(g) if isinstance(g, tf.Tensor) else g for g in grads]
            return original_apply(grads, trainable_variables)

        def train_step(data):
            tensors = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
            with tf.control_dependencies(tensors):
                stamp = tf.py_function(timer.record_begin, [], tf.float32)
            with tf.control_dependencies([stamp]):
                data = tf.nest.map_structure(
                    lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, data)
            return original_step(data)

        self._hooked = (optimizer, model)
        optimizer.apply = apply
        model.train_step = train_step
        # A train function traced before the hooks existed would not call them.
        model.train_function = None
        model.make_train_function(force=True)

    def _remove_hook(self):
        optimizer, model = getattr(self, "_hooked", None) or (None, None)
        if optimizer is not None:
            for obj, name in ((optimizer, "apply"), (model, "train_step")):
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            self._hooked = None
            model.train_function = None
