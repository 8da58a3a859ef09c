"""Horovod's TensorFlow 2 custom-loop example (tensorflow2_mnist.py, shrunk) with only its
import changed to tfdp.horovod, run by tests/test_horovod.py under tfdp-run.

Two loops on this rank's own random initial weights (no seed), data
``.shard(hvd.size(), hvd.rank())``:

1. ``tape``: a tf.function step with ``hvd.DistributedGradientTape`` and Adam, broadcasting
   the model's and optimizer's variables from rank 0 *after the first step*, as Horovod's
   example does;
2. ``optimizer``: eager steps of ``hvd.DistributedOptimizer(SGD(momentum))`` through
   ``optimizer.apply_gradients(zip(grads, vars))``, after ``hvd.broadcast_variables``.

Each rank writes OUT/loop-<rank>.npz: per loop its initial weights (``<loop>_init_<k>``) and
final weights (``<loop>_final_<k>``).

Env knobs: TFDP_TEST_OUT; HVD_LOCAL_BATCH (default 8); HVD_STEPS (default 5).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

import tfdp.horovod as hvd  # was: import horovod.tensorflow as hvd

from helpers import classification_data, mlp

hvd.init()
gpus = tf.config.experimental.list_physical_devices("GPU")
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

out = os.environ["TFDP_TEST_OUT"]
batch = int(os.environ.get("HVD_LOCAL_BATCH", "8"))
steps = int(os.environ.get("HVD_STEPS", "5"))
x, y = classification_data(n=96)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank()).batch(batch)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
arrays = {}

# --- 1. DistributedGradientTape, broadcast after the first step ---
model = mlp()
opt = keras.optimizers.Adam(0.01)
arrays.update({f"tape_init_{k}": w for k, w in enumerate(model.get_weights())})


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    # Horovod: broadcast after the first gradient step, so the optimizer's variables exist.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


for step, (images, labels) in enumerate(dataset.take(steps)):
    loss_value = training_step(images, labels, step == 0)
    if hvd.rank() == 0:
        print(f"Step #{step}\tLoss: {float(loss_value):.6f}", flush=True)
arrays.update({f"tape_final_{k}": w for k, w in enumerate(model.get_weights())})

# --- 2. DistributedOptimizer in an eager custom loop ---
model = mlp()
arrays.update({f"optimizer_init_{k}": w for k, w in enumerate(model.get_weights())})
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
hvd.broadcast_variables(model.variables, root_rank=0)
for images, labels in dataset.take(steps):
    with tf.GradientTape() as tape:
        loss_value = loss(labels, model(images, training=True))
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
arrays.update({f"optimizer_final_{k}": w for k, w in enumerate(model.get_weights())})

np.savez(os.path.join(out, f"loop-{hvd.rank()}.npz"), **arrays)
print(f"rank {hvd.rank()}: done", flush=True)
