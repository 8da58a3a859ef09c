"""A worker for the recommender test on several workers, started by tfdp-run (real processes).

Trains tools/dlrm.py's model (tests/test_recommender.py's configuration) under
ShardedOptimizer(Adam): each table goes whole from its owner by broadcast, the other
variables in rounds. Writes this worker's final weights to OUT/weights-<rank>.npz.

Env knobs: TFDP_TEST_OUT.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras

import tfdp
from tfdp.optimizers import exchange
from recommender_cases import GLOBAL_BATCH, SMALL_ROUNDS_BUCKET_BYTES, build, data

rank = int(os.environ.get("TFDP_RANK", "0"))
out = os.environ["TFDP_TEST_OUT"]

tables = 0
_broadcast_whole = exchange._broadcast_whole


def counting_broadcast_whole(*args, **kwargs):  # counts the whole-table broadcasts as traced
    global tables
    tables += 1
    return _broadcast_whole(*args, **kwargs)


exchange._broadcast_whole = counting_broadcast_whole
strategy = tfdp.DataParallelStrategy(bucket_bytes=SMALL_ROUNDS_BUCKET_BYTES)
x, y = data()
with strategy.scope():
    model = build()
    model.compile(tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01)), "binary_crossentropy")
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH)
history = model.fit(train, epochs=1, verbose=0)
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas, {tables} whole-table broadcasts "
      f"traced, loss {history.history['loss']}", flush=True)
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
