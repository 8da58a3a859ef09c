"""A worker for the recommender test on several workers, started by tfdp-run (real processes).

Trains tools/dlrm.py's model (tests/test_recommender.py's configuration) under
ShardedOptimizer(Adam) with rounds small enough that the large table goes from its owner by
broadcast, and writes this worker's final weights to OUT/weights-<rank>.npz.

Env knobs: TFDP_TEST_OUT.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tfdp  # noqa: E402
from recommender_cases import GLOBAL_BATCH, SMALL_ROUNDS_BUCKET_BYTES, build, data  # noqa: E402

rank = int(os.environ.get("TFDP_RANK", "0"))
out = os.environ["TFDP_TEST_OUT"]

from tfdp.strategy import collectives  # noqa: E402

bcasts = 0
_broadcast_row = collectives.broadcast_row


def counting_broadcast(*args, **kwargs):  # counts the broadcast rounds as the step is traced
    global bcasts
    bcasts += 1
    return _broadcast_row(*args, **kwargs)


collectives.broadcast_row = counting_broadcast
strategy = tfdp.DataParallelStrategy(bucket_bytes=SMALL_ROUNDS_BUCKET_BYTES)
x, y = data()
with strategy.scope():
    model = build()
    model.compile(tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01)), "binary_crossentropy")
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH)
history = model.fit(train, epochs=1, verbose=0)
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas, {bcasts} bcast rounds "
      f"traced, loss {history.history['loss']}", flush=True)
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
