"""The source pipeline of a distributed dataset runs without tf.data's autotune model thread.

Rule: a dataset given to a tfdp strategy (``experimental_distribute_dataset``, what Keras's
``fit`` calls, and every pipeline ``distribute_datasets_from_function`` builds, tfdp.data's
included) has ``tf.data.Options().autotune.enabled = False`` added unless its own options
set ``autotune.enabled``, either way. Explicitly ``True`` keeps the model, and with it the
stall below.

Why: an iterator whose pipeline autotunes owns a model thread that re-optimizes at a period
doubling up to 60 s while the iterator lives. Destroying the iterator cancels that thread, but
TensorFlow wakes it before it marks the cancellation done; a thread that checks in between
goes back to sleep for the rest of its period, and the destructor waits for it (TF 2.21:
``Model::OptimizeLoop`` against ``CancellationManager::StartCancel``, which runs its callbacks
before setting ``is_cancelled_``). Every distributed iterator is such a pipeline (the
multi-device iterator's host side), and TensorFlow's per-device generator functions capture
its resource in reference cycles, so it outlives the epoch that made it until a full garbage
collection, its period grown to 60 s meanwhile. The collection that frees it then waits up to
60 s per iterator in its destructor: measured 89.8 s and 107.7 s in two collections of one
test process (tests/crash_records.py's record, the destructor named by the native stack of
the thread waiting: ``MultiDeviceIterator`` -> ``RootDataset::Iterator`` ->
``~LogicalThreadWrapper``), and worse where the thread collecting holds the GIL. The
per-replica stage already runs without autotune (``_tf_private.patch_device_datasets_without_
autotune``).

What is given up: autotune's search of the parallelism of ``num_parallel_calls=AUTOTUNE``
transformations, which then run at TensorFlow's default (min(16, cores)), and its RAM
budget; ``prefetch(AUTOTUNE)`` keeps growing its buffer as it did (its own, model-free tuning).
"""

from __future__ import annotations

import tensorflow as tf


def autotune_set_by_user(enabled_option: bool | None) -> bool:
    """Whether a source pipeline whose ``options().autotune.enabled`` is ``enabled_option``
    decides autotuning itself (tfdp then leaves it alone): set either way (``None``: unset)."""
    return enabled_option is not None


def without_autotune_model(dataset):
    """``dataset`` with tf.data's autotune model off, unless its options set ``autotune.enabled``
    (see the module's rule); anything but a ``tf.data.Dataset`` is returned as it is."""
    if not isinstance(dataset, tf.data.Dataset):
        return dataset
    if autotune_set_by_user(dataset.options().autotune.enabled):
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
