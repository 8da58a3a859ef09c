"""The ZeRO-3 job of issue 57's hang report, run by tools/soak_jobs.py (job ``zero3``) under
``tfdp-run --workers 2 --cpu-replicas 2``.

A 16-64-64-4 MLP under ``DataParallelStrategy(shard_parameters=True, shard_min_elements=64)``,
``set_weights`` before ``compile``, Adam, a plain batched dataset (128 examples, global batch
16: 8 steps) for 2 epochs of ``fit``. Then, as users do, only the chief saves
(``OUT/model.keras``, served by the other worker from its exit) and every worker writes its
final weights (``get_weights``, a whole read every worker makes) to ``OUT/weights-<rank>.npz``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfdp

EXAMPLES, GLOBAL_BATCH, EPOCHS = 128, 16, 2


def model_fn():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(EXAMPLES, 16)).astype("float32"),
            rng.normal(size=(EXAMPLES, 4)).astype("float32"))


def initial_weights():
    keras.utils.set_random_seed(1234)
    return model_fn().get_weights()


def one_device():
    """The weights one device ends with (the soak's check)."""
    x, y = data()
    model = model_fn()
    model.set_weights(initial_weights())
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS,
              verbose=0)
    return model.get_weights()


if __name__ == "__main__":
    out = os.environ["TFDP_TEST_OUT"]
    # The strategy first: a multi-worker strategy configures TensorFlow's collectives, which
    # must happen before anything starts TensorFlow's runtime.
    strategy = tfdp.DataParallelStrategy(shard_parameters=True, shard_min_elements=64)
    start = initial_weights()
    rank = strategy.cluster.rank
    x, y = data()
    with strategy.scope():
        model = model_fn()
        model.set_weights(start)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS,
              verbose=0)
    print(f"rank {rank}: fit done", flush=True)
    np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
    if strategy.cluster.is_chief:
        model.save(os.path.join(out, "model.keras"))
    print(f"rank {rank}: done", flush=True)
