"""``BackupAndRestore``: atomic backups, a step-exact resume and preemption, on any worker count.

The mechanisms are in ``tfdp.resilience`` (backups, agreement, preemption, elastic); this
module is the Keras callback that drives them at ``fit``'s hooks.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings

import keras

from tfdp import _tf_private
from tfdp.strategy import keras_integration
from tfdp.callbacks import _running
from tfdp.callbacks.chief import cluster_of, write_path
from tfdp.callbacks.dataset_epoch import prepare_next_epoch
from tfdp.protocol import EXIT_PREEMPTED, restart_requested_exit_code
from tfdp.resilience import backups, compile_cache, elastic
from tfdp.strategy.agreement import Agreement
from tfdp.resilience.preemption import PreemptionWatcher, StopAgreement
from tfdp.resilience.preemption import preemption_signals as resolve_preemption_signals

__all__ = ["BackupAndRestore", "Preempted", "RestartRequested"]

log = logging.getLogger("tfdp")

# What Keras's own BackupAndRestore (and tfdp before step-exact backups) leaves in backup_dir.
_KERAS_LAYOUT_FILE = "training_metadata.json"


class Preempted(SystemExit):
    """Raised out of ``model.fit`` after the preemption backup: exit code
    ``tfdp.protocol.EXIT_PREEMPTED`` (143)."""

    def __init__(self, message=""):
        super().__init__(EXIT_PREEMPTED)
        self.message = message


class RestartRequested(SystemExit):
    """Raised out of ``model.fit`` after a backup when the job asks its launcher for a
    restart with another membership (straggler eviction): exit code
    ``tfdp.protocol.restart_requested_exit_code()`` (75 unless ``TFDP_EVICT_EXIT_CODE``)."""

    def __init__(self, message=""):
        super().__init__(restart_requested_exit_code())
        self.message = message


def _accumulation_steps(optimizer) -> int:
    """k of ``gradient_accumulation_steps`` through LossScaleOptimizer/ShardedOptimizer."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        k = getattr(optimizer, "gradient_accumulation_steps", None)
        if k:
            return int(k)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return 1


def _training_dataset(explicit, model):
    """``(the dataset to position, how to name it)``: ``dataset=`` if given, else the ``x`` of
    the running ``fit`` (never another pipeline, such as a validation set built later)."""
    if explicit is not None:
        return explicit, "the dataset given as dataset="
    running = keras_integration.fit_input(model)
    x = running[0] if running else None
    return x, f"the x of model.fit (a {type(x).__name__})"


class BackupAndRestore(keras.callbacks.Callback):
    """Atomic backups and a step-exact resume for ``model.fit``, on one or many workers.

    Every worker restores from ``backup_dir`` (a filesystem all workers can read, as in any
    multi-worker TensorFlow job: a shared volume, or a ``gs://``/``s3://`` path through
    ``tf.io.gfile``); only the chief writes and deletes it.

    **Resume.** A relaunched job loads the newest complete backup (the chief's choice, agreed
    by all workers), and continues at exactly the next step: the same epoch, the same batch,
    the same optimizer state. With input from ``tfdp.data.distribute`` the dataset is
    positioned at the next element too (its order is a function of (seed, epoch)), so no
    element is trained twice or skipped; this callback also calls the dataset's
    ``set_epoch``, so ``DatasetEpoch`` is not needed beside it. Other input cannot be
    positioned: the interrupted epoch then restarts from its first batch, with a warning that
    says so. Metrics of a resumed epoch average only its remaining steps.

    **Atomic.** A backup is complete or absent whenever the process dies
    (``tfdp.resilience.backups``): a rename on local filesystems, the metadata written last on
    object stores.

    **Preemption.** SIGTERM to any worker (Kubernetes eviction, spot reclaim, ``tfdp-run``
    forwarding its own SIGTERM) sets a flag; at a step boundary the workers agree
    (``tfdp.resilience.preemption``), all back up at that step and leave ``fit`` with
    ``Preempted`` (``SystemExit(143)``). If that cannot happen within ``grace_seconds`` the
    process exits 143 without a new backup. Inside a Slurm job SIGUSR1 and SIGUSR2 (``sbatch
    --signal=USR1@120``, submitit's USR2) take the same path; ``preemption_signals`` (or
    ``TFDP_PREEMPTION_SIGNALS``) chooses the set (``tfdp.resilience.preemption`` says why
    this default). A preemption signal whose handler before ``fit`` was a Python function
    (submitit's requeue) is handed to it after the backup. Signals outside the set, SIGINT
    among them, are left alone.

    **Gradient accumulation.** Backups (and preemption stops) fall on optimizer-update
    boundaries, where the accumulators are empty.

    **Another topology.** A backup resumes on any worker/replica count at the same global
    batch: the model and (sharded) optimizer state are topology-free, and ``tfdp.data``
    re-shards the rest of the epoch so every element is still seen once (exactly the same
    computation for ``"data"``/``"off"`` sharding; a warning for ``"file"`` sharding on a
    different worker count).

    Args:
        backup_dir: where the chief keeps the backups (a local path or a ``tf.io.gfile`` URL).
        save_freq: ``"epoch"`` or an integer number of training steps between backups.
        double_checkpoint: keep the previous backup as well as the newest.
        delete_checkpoint: delete the backups when training ends successfully.
        strategy: the strategy (default: the model's).
        dataset: the ``tfdp.data.distribute`` result to position (default: the ``x`` of the
            ``fit`` call this callback runs in, never a validation or test pipeline; give it
            for a dataset ``fit`` does not receive directly).
        grace_seconds: preemption grace period (default: ``TFDP_GRACE_SECONDS`` set by
            tfdp-run's ``--grace-period``, else ``tfdp.protocol.DEFAULT_GRACE_SECONDS``).
        check_every: steps between stop agreements of their own across workers (one scalar
            all-reduce each), used only where the stop flag cannot ride in the gradient
            all-reduce (``ShardedOptimizer``); see docs/resilience.md.
        preemption_signals: the signals that mean "preempted", e.g. ``("SIGTERM",
            "SIGUSR1")``; must include SIGTERM (default: ``TFDP_PREEMPTION_SIGNALS``, else
            SIGTERM, plus SIGUSR1 and SIGUSR2 inside a Slurm job).

    References:
        TensorFlow's ``BackupAndRestore`` and ``PreemptionCheckpointHandler``; torchrun's
        restart model (PyTorch elastic).
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True, strategy=None, dataset=None, grace_seconds=None,
                 check_every=1, preemption_signals=None):
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"save_freq={save_freq!r}: use 'epoch' or a positive number of steps.")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every={check_every!r} must be a positive integer.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.grace_seconds = grace_seconds
        self.check_every = check_every
        resolve_preemption_signals(preemption_signals)  # a wrong set fails here, not in fit
        self.preemption_signals = preemption_signals
        self._strategy = strategy
        self._dataset = dataset
        self._data, self._data_name = None, None
        keras_integration.require("fit_input")  # before fit runs: the callback exists first
        self._watcher = None
        self._restart_request = None
        self.restored_step = None  # global step of the backup this run resumed from
        self.last_backup_seconds = None
        # XLA's compiled programs beside the backups, where every restart and relaunch finds
        # them: under tfdp-run's default (TFDP_COMPILE_CACHE=auto) the cache moves there now,
        # else only if TensorFlow has not read its flags yet (tfdp.resilience.compile_cache).
        compile_cache.configure_beside_backups(self.backup_dir,
                                               _tf_private.eager_context_initialized())
        self._first_step = None
        self._align_names = False

    def get_config(self):
        return {"backup_dir": self.backup_dir, "save_freq": self.save_freq,
                "double_checkpoint": self.double_checkpoint,
                "delete_checkpoint": self.delete_checkpoint, "strategy": self._strategy,
                "dataset": self._dataset, "grace_seconds": self.grace_seconds,
                "check_every": self.check_every, "preemption_signals": self.preemption_signals}

    @property
    def training_dataset(self):
        """The ``tfdp.data`` dataset this callback positions (None outside ``fit``)."""
        return self._data

    # --- reading backups without a strategy -------------------------------------------------
    @staticmethod
    def saved_info(backup_dir) -> dict | None:
        """The metadata of the newest complete backup in ``backup_dir`` (None if none): epoch,
        step, workers, replicas, global batch. Lets a script choose its batch policy
        (``tfdp.resilience.elastic_batch_size``) before building its pipeline."""
        store = backups.BackupStore(backup_dir)
        step = store.latest()
        return None if step is None else store.read_meta(step)

    # --- fit hooks --------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        strategy = self._strategy or self.model.distribute_strategy
        cluster = cluster_of(strategy)
        self._num_workers, self._rank = cluster.num_workers, cluster.rank
        self._num_replicas = strategy.num_replicas_in_sync
        self._chief = cluster.is_chief
        self._agreement = Agreement(strategy, self._num_workers)
        self._store = backups.BackupStore(self.backup_dir, keep=2 if self.double_checkpoint else 1)
        self._private_dir = None if self._chief else os.path.dirname(write_path(self.backup_dir, strategy))
        self._k = _accumulation_steps(self.model.optimizer)
        self._data, self._data_name = _training_dataset(self._dataset, self.model)
        self._global_step = 0
        self._last_backup = 0
        self._resume = None
        self._stop_agreed = None
        self._restart_request = None
        self._marked = False
        self._restore()
        self._watcher = PreemptionWatcher(self.grace_seconds, signals=self.preemption_signals)
        self._watcher.install()
        self._stop = StopAgreement(self._watcher, self._agreement, self.check_every, strategy)
        # The step's functions get the same names (XLA's cache keys) in every attempt, whether
        # or not a backup was restored first: the names are aligned right before the first
        # step is traced (on_train_batch_begin), after the epoch's iterator is made (a resumed
        # plain tf.data.Dataset took one name more there: measured, tools/bench_restart.py).
        self._align_names = compile_cache.active() is not None
        if self._num_workers > 1:  # a step traced before would not carry the stop flag
            self.model.make_train_function(force=True)
        _running.set_backup(self)
        self._first_step = compile_cache.FirstStep()  # says where its XLA programs came from
        self._first_step.begin()
        # A fit left by an exception (the preemption's own SystemExit included) gets no
        # on_train_end: without this the process would keep our SIGTERM handler and a live
        # backstop timer, which ends the process with os._exit once its grace period passes.
        keras_integration.at_fit_exit(self.model, self._release_signals)

    def _draw_orders_before(self, epoch):
        """A resumed job's first epoch, on a plain ``tf.data.Dataset``: its random stages (a
        reshuffling ``shuffle``) draw their seeds once per iterator, and a relaunched process
        starts from the first draw. Making (and dropping) the iterators the uninterrupted
        ``fit`` made before this epoch gives this epoch the order it had there."""
        running = keras_integration.fit_input(self.model)
        if running is None or running[0] is not self._data:
            return
        _, steps_per_epoch, initial_epoch = running
        known = _tf_private.keras_epoch_length(self._data) is not None
        draws = _tf_private.keras_iterators_before_epoch(
            epoch - (initial_epoch or 0), known, steps_per_epoch)
        _tf_private.make_draws_of_iterators(self._data, draws or 0)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        offset = 0
        if self._resume is not None and epoch == self._resume.epoch:
            offset = self._resume.step
        why_not = f"{self._data_name} is not a tfdp.data.distribute dataset"
        positioned = False
        if self._data is not None and hasattr(self._data, "set_position"):
            try:
                self._data.set_position(epoch, offset)
                positioned = True
            except ValueError as e:  # e.g. a tf.data service input cannot skip mid-epoch
                why_not = str(e)
                self._data.set_position(epoch, 0)
        elif self._data is not None and hasattr(self._data, "set_epoch"):
            self._data.set_epoch(epoch)
        elif self._resume is not None and epoch == self._resume.epoch:
            self._draw_orders_before(epoch)
        if offset and not positioned:
            warnings.warn(
                f"tfdp BackupAndRestore: resuming epoch {epoch} after step {offset}, but {why_not}, "
                f"so the input cannot be positioned: this epoch restarts from its first batch and "
                f"its first {offset} steps are trained a second time. Use tfdp.data.distribute "
                "(pass dataset=) for a step-exact resume, or save_freq='epoch'.", stacklevel=2)
            offset = 0
        self._offset = offset
        self._step_in_epoch = offset
        if offset:
            # Keras expects a whole epoch; this one has only its remaining steps.
            length = _tf_private.keras_epoch_length(self._data)
            if length is not None and not _tf_private.set_keras_epoch_length(
                    self._data, length - offset):
                raise RuntimeError(
                    f"tfdp BackupAndRestore: could not find Keras's epoch iterator over "
                    f"{self._data_name}: fit does not train on it. Pass the dataset model.fit "
                    "trains on as dataset=, or none.")

    def on_train_batch_begin(self, batch, logs=None):
        if self._align_names:
            self._align_names = False
            _tf_private.align_function_names()

    def on_train_batch_end(self, batch, logs=None):
        done = self._offset + batch + 1
        self._global_step += done - self._step_in_epoch
        self._step_in_epoch = done
        if done == self.params.get("steps") and hasattr(self._data, "set_epoch"):
            prepare_next_epoch(self._data, self._epoch + 1)
        if not self._marked:
            elastic.mark_progress(self._rank)
            self._marked = True
            if self._first_step is not None:
                self._first_step.end()
        if self._stop_agreed is None and self._stop.stop_after(self._global_step):
            self._stop_agreed = "preempted"
        if self._stop_agreed is None and self._restart_request is not None:
            # Every worker reaches the same request at the same step (StragglerMonitor decides
            # from gathered numbers), so no agreement is needed.
            self._stop_agreed = "restart"
        if self._stop_agreed is not None and backups.is_update_boundary(self._global_step, self._k):
            self._leave()
        if isinstance(self.save_freq, int) and backups.should_back_up(
                self._global_step, self.save_freq, self._k, self._last_backup):
            self._back_up()

    def on_epoch_end(self, epoch, logs=None):
        if self._offset and self._data is not None:
            # Later epochs are whole again (None: unknown, as the data adapter says).
            _tf_private.set_keras_epoch_length(self._data, _tf_private.keras_epoch_length(self._data))
        if self.save_freq == "epoch" and backups.is_update_boundary(self._global_step, self._k):
            self._back_up(epoch_complete=True)

    def on_train_end(self, logs=None):
        self._release_signals()
        if self.delete_checkpoint and self._chief:
            self._store.delete()

    def _release_signals(self):
        """Puts back the signal handlers, stops the backstop, forgets this fit (idempotent)."""
        if self._watcher is not None:
            self._watcher.uninstall()
            self._watcher.cancel_backstop()
            self._stop.close()
            if self._num_workers > 1:
                self.model.train_function = None  # retraced without the stop flag next time
            self._watcher = None
        if _running.backup() is self:
            _running.set_backup(None)

    # --- used by StragglerMonitor -----------------------------------------------------------
    def request_restart(self, rank: int, reason: str):
        """Back up at the next update boundary and exit 75, asking to drop ``rank``."""
        if self._restart_request is None:
            self._restart_request = {"rank": int(rank), "reason": reason}

    # --- internals ----------------------------------------------------------------------------
    def _restore(self):
        mine = self._store.latest() if self._chief else None
        if self._chief:
            self._store.prune()
            if mine is None and self._store.holds(_KERAS_LAYOUT_FILE):
                warnings.warn(
                    f"tfdp BackupAndRestore: {self.backup_dir} holds a backup in the layout of Keras's "
                    "BackupAndRestore (or tfdp before step-exact backups), which this version does not "
                    "resume: training starts from the beginning. Resume it with the previous version, "
                    "or use a new backup_dir.", stacklevel=3)
        agreed = int(round(self._agreement.sum([(mine + 1) if mine is not None else 0])[0])) - 1
        if agreed < 0:
            return
        if not self._store.readable(agreed):
            raise RuntimeError(
                f"tfdp BackupAndRestore: the chief resumes from {self._store.path(agreed)}, which "
                f"this worker (rank {self._rank}) cannot see. backup_dir must be a filesystem every "
                "worker can read (shared volume, NFS, GCS/S3 path).")
        meta = self._store.read_meta(agreed)
        self._check_topology(meta)
        self.model.load_weights(self._store.weights_path(agreed))
        steps = meta.get("steps_per_epoch")
        self._resume = backups.resume_position(meta["epoch"], meta["step_in_epoch"], steps)
        self._global_step = self._last_backup = int(meta["global_step"])
        self.restored_step = self._global_step
        _tf_private.set_keras_initial_epoch(self.model, self._resume.epoch)
        log.info("tfdp: resuming from backup at global step %d: epoch %d, step %d",
                 self._global_step, self._resume.epoch, self._resume.step)

    def _check_topology(self, meta):
        saved = meta.get("sharding") or {}
        current = getattr(self._data, "sharding_info", None) or {}
        if saved and current and saved.get("global_batch_size") != current.get("global_batch_size"):
            raise ValueError(
                f"tfdp BackupAndRestore: the backup was trained at global batch "
                f"{saved.get('global_batch_size')}, this job uses {current.get('global_batch_size')}. "
                "A step-exact resume needs the same global batch (tfdp.resilience.elastic_batch_size "
                "gives it for the new replica count); to change it on purpose, start from the "
                "weights with a new backup_dir.")
        if saved and current:
            from tfdp import data as tfdp_data

            exact, reason = tfdp_data.resume_is_exact(saved, current)
            if not exact:
                warnings.warn(f"tfdp BackupAndRestore: resuming on a different topology is not "
                              f"the same computation: {reason}", stacklevel=3)
        if meta.get("num_workers") != self._num_workers or meta.get("num_replicas") != self._num_replicas:
            log.info("tfdp: backup written by %s worker(s) x %s replicas resumes on %d x %d",
                     meta.get("num_workers"), meta.get("num_replicas"), self._num_workers,
                     self._num_replicas)

    def _meta(self, epoch_complete):
        steps = self._step_in_epoch if epoch_complete else self.params.get("steps")
        return {
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "steps_per_epoch": steps,
            "num_workers": self._num_workers,
            "num_replicas": self._num_replicas,
            "accumulation_steps": self._k,
            "sharding": getattr(self._data, "sharding_info", None),
            "wall_time": time.time(),
        }

    def _back_up(self, epoch_complete=False):
        start = time.monotonic()
        meta = self._meta(epoch_complete)
        if self._chief:
            self._store.write(self._global_step, self.model.save_weights, meta)
        else:  # same work (saving may run collectives), private place, then discarded
            os.makedirs(self._private_dir, exist_ok=True)
            temp = tempfile.mkdtemp(prefix="backup-", dir=self._private_dir)
            try:
                backups.BackupStore(temp).write(self._global_step, self.model.save_weights, meta)
            finally:
                shutil.rmtree(temp, ignore_errors=True)
        self._last_backup = self._global_step
        self.last_backup_seconds = time.monotonic() - start

    def _leave(self):
        self._back_up()
        if self._stop_agreed == "preempted":
            waited = time.monotonic() - self._watcher.received_at if self._watcher.requested else None
            message = (f"tfdp: preempted: all workers backed up at global step {self._global_step} "
                       f"(epoch {self._epoch}, step {self._step_in_epoch})"
                       + (f", {waited:.1f} s after {self._watcher.received_signal.name}"
                          if waited is not None else "")
                       + f"; exiting with {EXIT_PREEMPTED}")
            log.warning(message)
            try:
                # Whoever had the signal before fit (submitit: requeue, then exit) acts now that
                # the backup exists; a hang there still meets the backstop.
                self._watcher.pass_on()
            finally:
                self._watcher.cancel_backstop()
            raise Preempted(message)
        request = self._restart_request
        if self._chief:
            elastic.request_eviction(request["rank"], request["reason"])
        message = (f"tfdp: restart requested without rank {request['rank']} ({request['reason']}); "
                   f"backed up at global step {self._global_step}; exiting with "
                   f"{restart_requested_exit_code()}")
        log.warning(message)
        raise RestartRequested(message)
