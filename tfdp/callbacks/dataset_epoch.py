"""``DatasetEpoch``: epoch e's input order depends only on (seed, e)."""

from __future__ import annotations

import keras

from tfdp.callbacks import _running

__all__ = ["DatasetEpoch", "prepare_next_epoch"]


class DatasetEpoch(keras.callbacks.Callback):
    """Tells a ``tfdp.data.distribute`` dataset which epoch starts (its ``set_epoch``).

    With it, epoch e's shuffle order depends only on (seed, e), not on how many epochs this
    process has run: a job resumed at epoch e trains on exactly the order the uninterrupted
    job used. Keras creates each epoch's iterator after ``on_epoch_begin``, so the order
    applies to the epoch being started. ``BackupAndRestore`` does this itself; this callback
    is for jobs without it.

    Args:
        dataset: what ``tfdp.data.distribute`` returned.

    References:
        ``torch.utils.data.distributed.DistributedSampler.set_epoch``.
    """

    def __init__(self, dataset):
        super().__init__()
        if not hasattr(dataset, "set_epoch"):
            raise TypeError("DatasetEpoch needs a dataset from tfdp.data.distribute (it has set_epoch).")
        self._dataset = dataset

    def get_config(self):
        return {"dataset": self._dataset}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if not self._deferred():
            self._dataset.set_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if not self._deferred() and batch + 1 == self.params.get("steps"):
            prepare_next_epoch(self._dataset, self._epoch + 1)

    def _deferred(self):
        # BackupAndRestore positions the same dataset (possibly mid-epoch); do not reset that.
        running = _running.backup()
        return running is not None and running.training_dataset is self._dataset


def prepare_next_epoch(dataset, next_epoch):
    """Sets the epoch of the iterator Keras is about to create.

    With a known number of steps Keras creates the next epoch's iterator right after the last
    step of the current one, before ``on_epoch_end``/``on_epoch_begin`` (and the prefetching
    pipeline starts at once), so the epoch must be set at the last step. With unknown steps
    the iterator is created after ``on_epoch_begin``, which sets it there.
    """
    if hasattr(dataset, "set_position"):
        dataset.set_position(next_epoch, 0)
    else:
        dataset.set_epoch(next_epoch)
