"""What tests/test_epoch_order.py and its two-worker script (tests/workers/epoch_order_worker.py)
share: a layer that records which examples each replica's steps saw, the shuffled datasets and
the model."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import keras

TRAIN_IDS = np.arange(16)  # 2 steps of 8 per epoch
VAL_IDS = 100 + np.arange(12)  # a last partial batch of 4
PREDICT_IDS = 200 + np.arange(8)
BATCH = 8
EPOCHS = 3

seen: list = []  # (replica, example ids) in the order the steps ran


def _record(replica, ids):
    seen.append((int(replica), ids.numpy()[:, 0].astype(int).tolist()))
    return np.float32(0)


class Recorder(keras.layers.Layer):
    """Passes its input through and records the example ids (column 0) each replica saw."""

    def call(self, x):
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group if context is not None else 0
        done = tf.py_function(_record, [replica, x], tf.float32)
        done.set_shape(())
        return x + 0.0 * done

    def compute_output_shape(self, shape):
        return shape


def steps(replicas):
    """The recorded global batches: each step's replica slices in replica order."""
    assert len(seen) % replicas == 0, seen
    out = []
    for i in range(0, len(seen), replicas):
        step = sorted(seen[i:i + replicas])
        assert [r for r, _ in step] == list(range(replicas)), step  # one slice per replica
        out.append(sum((ids for _, ids in step), []))
    return out


def dataset(ids, seeded=True, unknown_length=False, repeat=False):
    x = np.asarray(ids, "float32")[:, None]
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros_like(x)))
    if unknown_length:
        ds = ds.filter(lambda a, b: True)
    ds = ds.shuffle(len(ids), seed=5 if seeded else None)
    if repeat:
        ds = ds.repeat()
    return ds.batch(BATCH)


def model_in(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), Recorder(), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return model
