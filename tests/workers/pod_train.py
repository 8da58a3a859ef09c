"""A worker run as one pod of an emulated Kubernetes indexed Job or JobSet
(tests/test_kubernetes.py): it finds its cluster by itself, with no TF_CONFIG.

Builds ``tfdp.DataParallelStrategy()`` with no argument, trains the helpers' MLP for one epoch
on in-order ``tfdp.data`` input (Adam), prints
``rank R: source=S workers=N replicas=K address=A`` and writes OUT/weights-<rank>.npz.

Unlike tests/workers/cluster_train.py (256 rows) the row count is a knob, TFDP_TEST_ROWS
(default 240): with 3 workers no global batch divides 256, and the last, partial step gives
the replicas unequal rows, which Keras weighs equally (docs/limits.md), so it would not be one
device's step. Env: TFDP_TEST_OUT (required), TFDP_TEST_ROWS, TFDP_TEST_GLOBAL_BATCH (48).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras

import tfdp
from helpers import classification_data, initial_weights, mlp  # PYTHONPATH

out = os.environ["TFDP_TEST_OUT"]
rows = int(os.environ.get("TFDP_TEST_ROWS", "240"))
global_batch = int(os.environ.get("TFDP_TEST_GLOBAL_BATCH", "48"))

strategy = tfdp.DataParallelStrategy()
cluster = strategy.cluster
rank = cluster.rank
address = cluster.workers[rank] if cluster.workers else "-"
print(f"rank {rank}: source={cluster.source} workers={cluster.num_workers} "
      f"replicas={strategy.num_replicas_in_sync} address={address}", flush=True)

x, y = classification_data(n=rows)
w0 = initial_weights(mlp)
with strategy.scope():
    model = mlp()
    model.set_weights(w0)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), global_batch)
model.fit(train, epochs=1, verbose=0)
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
print(f"rank {rank}: done", flush=True)
