"""A worker for the multi-worker XLA test (tests/test_xla.py), started by tfdp-run.

Trains tests/xla_cases.py's model once per optimizer with ``jit_compile=True`` on one
DataParallelStrategy and writes OUT/<optimizer>-<rank>.npz: the final weights, the loss
history and whether tfdp's split (per-replica compiled) step ran. Also exchanges made-up
GPU placements through the coordination service, as the shared-GPU check does on GPUs,
and writes what it received to OUT/placements-<rank>.json.

Env knobs: TFDP_TEST_OUT.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras

import tfdp
from tfdp.strategy import devices
from tfdp.strategy import xla
import xla_cases
from helpers import mlp

rank = int(os.environ.get("TFDP_RANK", "0"))
out = os.environ["TFDP_TEST_OUT"]

strategy = tfdp.DataParallelStrategy()
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas", flush=True)
table = devices.exchange_gpu_placements(
    "tfdp/test/placements", rank, strategy.cluster.num_workers,
    [devices.Placement(rank, 0, "host", f"gpu-of-{rank}")], timeout_seconds=60)
with open(os.path.join(out, f"placements-{rank}.json"), "w") as f:
    json.dump([list(p) for p in table], f)
x, y = xla_cases.data()
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                             xla_cases.GLOBAL_BATCH)
for name, make_optimizer in sorted(xla_cases.OPTIMIZERS.items()):
    with strategy.scope():
        model = mlp()
        model.set_weights(xla_cases.weights())
        model.compile(optimizer=make_optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=True)
    history = model.fit(train, epochs=xla_cases.EPOCHS, verbose=0)
    np.savez(os.path.join(out, f"{name}-{rank}.npz"), *model.get_weights(),
             loss=np.asarray(history.history["loss"]),
             split=np.asarray(xla.compiled_train_step(model) is not None))
    print(f"rank {rank}: {name} done", flush=True)
