"""A Horovod-style Keras script (horovod.tensorflow.keras's MNIST example, shrunk), with
only its import changed to tfdp.horovod.keras, run by tests/test_horovod.py under tfdp-run.

The model is built outside any strategy scope from this process's own random weights (no
seed); the dataset is ``.shard(hvd.size(), hvd.rank())``; DistributedOptimizer(Adam with
global_clipnorm) + BroadcastGlobalVariablesCallback(0) + MetricAverageCallback. Rank 0 saves
the model once. Each rank writes OUT/fit-<rank>.npz: its initial and final weights and its
epoch losses (arrays ``init_<k>``, ``final_<k>``, ``loss``), the weights after one more
epoch with ``backward_passes_per_step=2`` (``passes_<k>``), and ``ranks``: rank, size,
local rank, local size, cross rank, cross size.

Env knobs: TFDP_TEST_OUT; HVD_LOCAL_BATCH (default 8); HVD_EPOCHS (default 2); HVD_LATE
"rank:seconds": that rank waits before its first collective, after TensorFlow's runtime started
(the other ranks then build their collective engine first: issue 40's hang).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

import tfdp.horovod.keras as hvd  # was: import horovod.tensorflow.keras as hvd

from helpers import classification_data, mlp

hvd.init()
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

out = os.environ["TFDP_TEST_OUT"]
batch = int(os.environ.get("HVD_LOCAL_BATCH", "8"))
x, y = classification_data(n=96)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank()).batch(batch)

model = mlp()  # this rank's own random initial weights
initial = model.get_weights()
optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=0.5))
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
late_rank, late_seconds = (os.environ.get("HVD_LATE") or "-1:0").split(":")
if hvd.rank() == int(late_rank):
    time.sleep(float(late_seconds))  # the order of arrival under test, not a synchronisation
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback()]
history = model.fit(dataset, epochs=int(os.environ.get("HVD_EPOCHS", "2")), callbacks=callbacks,
                    verbose=2 if hvd.rank() == 0 else 0)
if hvd.rank() == 0:
    model.save(os.path.join(out, "model.keras"))
arrays = {f"init_{k}": w for k, w in enumerate(initial)}
arrays.update({f"final_{k}": w for k, w in enumerate(model.get_weights())})

# backward_passes_per_step=2: one reduced update per two batches, the passes summed
# (Horovod's average_aggregated_gradients=False), from the weights fit ended with.
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                 backward_passes_per_step=2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(dataset, epochs=1, verbose=0)
arrays.update({f"passes_{k}": w for k, w in enumerate(model.get_weights())})
ranks = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
         hvd.cross_size()]
np.savez(os.path.join(out, f"fit-{hvd.rank()}.npz"), loss=np.array(history.history["loss"]),
         ranks=np.array(ranks), **arrays)
print(f"rank {hvd.rank()} of {hvd.size()}: done", flush=True)
