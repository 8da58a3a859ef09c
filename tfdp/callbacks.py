"""Multi-worker-safe Keras callbacks: only the chief writes to the final place.

Keras 3 callbacks know nothing about workers: with several workers every process writes
the same files (a race that can corrupt an HDF5 file on a shared filesystem) and every one
deletes the backup at the end. tfdp follows TensorFlow's multi-worker convention instead:
the chief writes to the real path; the other workers write the same data to a private
temporary directory and delete it, so any collective that saving needs still runs on every
worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras
import tensorflow as tf

__all__ = ["BackupAndRestore", "DatasetEpoch", "is_chief", "write_path"]


def _cluster(strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    return getattr(strategy, "cluster", None)


def is_chief(strategy=None) -> bool:
    """True in single-process jobs and on the chief (rank 0) of a tfdp multi-worker job."""
    cluster = _cluster(strategy)
    return cluster is None or cluster.is_chief


def write_path(path: str, strategy=None) -> str:
    """Where this worker should write ``path``: ``path`` on the chief, else a private
    temporary directory (delete it after writing)."""
    if is_chief(strategy):
        return path
    cluster = _cluster(strategy)
    return os.path.join(tempfile.gettempdir(), f"tfdp-worker{cluster.rank}-{os.getpid()}",
                        os.path.basename(os.path.normpath(path)))


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` for multi-worker jobs.

    Every worker restores from ``backup_dir`` (a filesystem all workers can read, as in
    any multi-worker TensorFlow job); only the chief writes and deletes it. Backups are
    taken at epoch ends (or every ``save_freq`` batches): a job killed mid-epoch and
    relaunched restarts that epoch from its beginning with the state of the last epoch
    end, so it ends with the same weights as an uninterrupted run (given the same data
    order each epoch: unshuffled, or shuffled by epoch-independent seeds).

    Args:
        backup_dir: where the chief keeps the backup.
        save_freq: ``"epoch"`` or a number of batches (Keras restores at epoch
            granularity either way).
        double_checkpoint: keep the previous backup too.
        delete_checkpoint: delete the backup when training ends successfully.
        strategy: the strategy (default: the current one).
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True, strategy=None):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self._strategy = strategy

    def _save_model(self):
        if is_chief(self._strategy or self._model_strategy()):
            return super()._save_model()
        paths = (self.backup_dir, self._weights_path, self._training_metadata_path,
                 self._prev_weights_path, self._prev_training_metadata_path)
        temp = tempfile.mkdtemp(prefix="tfdp-backup-")
        try:
            self.backup_dir = temp
            self._weights_path = os.path.join(temp, os.path.basename(paths[1]))
            self._training_metadata_path = os.path.join(temp, os.path.basename(paths[2]))
            self._prev_weights_path = self._weights_path + ".bkp"
            self._prev_training_metadata_path = self._training_metadata_path + ".bkp"
            super()._save_model()
        finally:
            (self.backup_dir, self._weights_path, self._training_metadata_path,
             self._prev_weights_path, self._prev_training_metadata_path) = paths
            shutil.rmtree(temp, ignore_errors=True)

    def on_train_end(self, logs=None):
        if is_chief(self._strategy or self._model_strategy()):
            super().on_train_end(logs)

    def _model_strategy(self):
        model = getattr(self, "_model", None) or getattr(self, "model", None)
        return getattr(model, "distribute_strategy", None)


class DatasetEpoch(keras.callbacks.Callback):
    """Tells a ``tfdp.data.distribute`` dataset which epoch starts (its ``set_epoch``).

    With it, epoch e's shuffle order depends only on (seed, e), not on how many epochs this
    process has run: a job resumed by ``BackupAndRestore`` at epoch e trains on exactly the
    order the uninterrupted job used. Keras creates each epoch's iterator after
    ``on_epoch_begin``, so the order applies to the epoch being started.

    Args:
        dataset: what ``tfdp.data.distribute`` returned.
    """

    def __init__(self, dataset):
        super().__init__()
        if not hasattr(dataset, "set_epoch"):
            raise TypeError("DatasetEpoch needs a dataset from tfdp.data.distribute (it has set_epoch).")
        self._dataset = dataset

    def on_epoch_begin(self, epoch, logs=None):
        self._dataset.set_epoch(epoch)
