"""Every worker takes the same training decisions.

Rule. A decision that ends training or changes it is the same on every worker, or the job
stops at once with an error that says why: a worker never leaves the training loop alone
(its peers would wait for it in the next collective until the timeout).

What Keras already gives (measured with TF 2.21 / Keras 3.15 on 2 workers x 2 replicas).
Under a ``MultiWorkerMirroredStrategy``, which ``DataParallelStrategy`` is, Keras reduces
every log over all replicas of all workers: batch logs through ``strategy.reduce`` (a NaN
loss on one worker makes the reduced loss NaN everywhere), epoch and validation logs by
reading its SUM-aggregated on-read metric variables (an all-reduce). Every worker's logs are
identical bit for bit, so ``EarlyStopping``, ``ReduceLROnPlateau``,
``ModelCheckpoint(save_best_only=True)`` and ``TerminateOnNaN`` decide alike.

What tfdp adds:

* The stop flag is agreed at every epoch end. After the callbacks' ``on_epoch_end``, if any
  worker's callbacks set ``model.stop_training``, every worker stops (one all-reduce of one
  number per epoch). A decision on worker-local information (a wall-clock limit, a file
  only one host sees) then stops the whole job at the same epoch instead of hanging it.
  Stops inside an epoch (``on_train_batch_end``) are not agreed, which would cost a
  collective per step: decide those on the logs Keras passes (they are reduced).
* Keras's ``BackupAndRestore``: every worker must restore the same epoch. A worker that
  restored another one (almost always: the backup directory is not on a filesystem all
  workers share) stops the job at once with an error naming what each worker found.
"""

from __future__ import annotations

import functools
import logging
import weakref

from tfdp.strategy import is_data_parallel
from typing import Sequence

__all__ = ["install", "agreed_stop", "restored_epochs_error"]

log = logging.getLogger("tfdp")


# --- pure policy ---------------------------------------------------------------------------

def agreed_stop(stop_votes: float) -> bool:
    """Whether training stops, given the number of workers whose callbacks stopped it."""
    return stop_votes > 0


def restored_epochs_error(epochs: Sequence[int | None], backup_dir) -> str | None:
    """The error for workers that restored different epochs (None = no backup), or None.

    Args:
        epochs: per rank, the epoch Keras's BackupAndRestore restored, or None.
        backup_dir: the callback's directory, for the message.
    """
    if len(set(epochs)) <= 1:
        return None
    found = ", ".join(f"worker {rank}: " + ("no backup" if e is None else f"epoch {e}")
                      for rank, e in enumerate(epochs))
    return (f"keras.callbacks.BackupAndRestore(backup_dir={backup_dir!r}): the workers "
            f"restored different states ({found}), so they would train different epochs and "
            "hang. Every worker reads the chief's backup at this path: it must be on a shared "
            "filesystem that every worker mounts at the same path (NFS, a cluster filesystem, "
            "a gs:// or s3:// bucket). Fix: put backup_dir there.")


# --- hooks ---------------------------------------------------------------------------------

_agreements: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _multi_worker_tfdp(strategy) -> bool:
    cluster = getattr(strategy, "cluster", None)
    return (is_data_parallel(strategy) and cluster is not None
            and cluster.num_workers > 1)


def _agreement(strategy):
    from tfdp.strategy.agreement import Agreement

    agreement = _agreements.get(strategy)
    if agreement is None:
        agreement = _agreements[strategy] = Agreement(strategy, strategy.cluster.num_workers)
    return agreement


def _agree_on_stop(callbacks, epoch):
    model = callbacks.model
    strategy = getattr(model, "distribute_strategy", None)
    if model is None or not _multi_worker_tfdp(strategy):
        return
    stop = bool(getattr(model, "stop_training", False))
    votes = _agreement(strategy).sum([1.0 if stop else 0.0])[0]
    if agreed_stop(votes) and not stop:
        log.info("tfdp: stopping after epoch %d: another worker's callbacks stopped training.",
                 epoch + 1)
    model.stop_training = agreed_stop(votes)


def _check_restored_epoch(callback):
    from tfdp import _tf_private

    strategy = getattr(callback.model, "distribute_strategy", None)
    if not _multi_worker_tfdp(strategy):
        return
    cluster = strategy.cluster
    epoch = _tf_private.keras_initial_epoch(callback.model)
    mine = [0.0] * cluster.num_workers
    mine[cluster.rank] = 0.0 if epoch is None else float(epoch) + 1.0
    epochs = [None if v == 0 else int(v) - 1 for v in _agreement(strategy).sum(mine)]
    message = restored_epochs_error(epochs, callback.backup_dir)
    if message:
        raise RuntimeError(message)


def install():
    """Installs the hooks (idempotent: ``_tf_private``'s registry patches once); they act only
    under a multi-worker tfdp strategy."""
    from tfdp import _tf_private

    def agree_at_epoch_end(original):
        @functools.wraps(original)
        def on_epoch_end(self, epoch, logs=None):
            original(self, epoch, logs)
            _agree_on_stop(self, epoch)
        return on_epoch_end

    def check_after_restore(original):
        @functools.wraps(original)
        def on_train_begin(self, logs=None):
            original(self, logs)
            _check_restored_epoch(self)
        return on_train_begin

    _tf_private.patch_keras_callback("CallbackList", "on_epoch_end", agree_at_epoch_end)
    _tf_private.patch_keras_callback("BackupAndRestore", "on_train_begin",
                                     check_after_restore)
