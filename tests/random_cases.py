"""Shared cases of the per-replica random draws (tests/test_replica_randomness.py and its
multi-worker script): the layers that draw, a global batch, and a Dropout model trained by fit."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import keras

from helpers import classification_data, initial_weights

GLOBAL_BATCH = 32


def global_inputs():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(GLOBAL_BATCH, 6)).astype("float32")
    images = rng.normal(size=(GLOBAL_BATCH, 5, 5, 1)).astype("float32")
    return tf.constant(x), tf.constant(images)


def draw_layers():
    """Layers that draw per example, keyed by name (seeded: every run starts alike)."""
    return {"dropout": keras.layers.Dropout(0.5, seed=3),
            "noise": keras.layers.GaussianNoise(1.0, seed=4),
            "gaussian_dropout": keras.layers.GaussianDropout(0.4, seed=6),
            "flip": keras.layers.RandomFlip("horizontal", seed=5)}


def replica_draws(strategy):
    """One step of every draw layer under ``strategy.run``, each replica on its rows of the
    global batch: ``{name: this worker's replicas' outputs, stacked in replica order}``."""
    x, images = global_inputs()
    per = GLOBAL_BATCH // strategy.num_replicas_in_sync
    with strategy.scope():
        layers = draw_layers()

    def rows(ctx):
        r = ctx.replica_id_in_sync_group
        return x[r * per:(r + 1) * per], images[r * per:(r + 1) * per]

    values = strategy.experimental_distribute_values_from_function(rows)

    @tf.function
    def step(batch):
        def replica(b):
            dense, image = b
            return tuple(layer(image if name == "flip" else dense, training=True)
                         for name, layer in layers.items())
        return strategy.run(replica, args=(batch,))

    outputs = step(values)
    return {name: np.stack([t.numpy() for t in strategy.experimental_local_results(out)])
            for name, out in zip(layers, outputs)}


def one_device_draws():
    """What one device draws with fresh layers on the whole global batch."""
    x, images = global_inputs()
    layers = draw_layers()
    step = tf.function(lambda: {name: layer(images if name == "flip" else x, training=True)
                                for name, layer in layers.items()})
    return {name: value.numpy() for name, value in step().items()}


def random_part(name, output, inputs):
    """The drawn part of a layer's output on ``inputs`` (NumPy): a Dropout keep-mask, the
    added noise, the multiplying noise, or per example whether the image was flipped."""
    if name == "dropout":
        return output != 0
    if name == "noise":
        return np.round(output - inputs, 5)
    if name == "gaussian_dropout":
        return np.round(output / inputs, 5)
    return np.all(output == inputs[:, :, ::-1, :], axis=(1, 2, 3))


def dropout_mlp():
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.3, seed=11),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.GaussianNoise(0.2, seed=12),
        keras.layers.Dense(3),
    ])


def train_dropout(strategy, model_fn, global_batch=GLOBAL_BATCH, epochs=2, plain_input=False):
    """Weights after ``fit`` of ``model_fn`` under ``strategy`` (None: one device).
    ``plain_input``: the batched ``tf.data.Dataset`` goes to ``fit`` as it is (TensorFlow's own
    distribution, which deals per-replica batches to the workers), not through tfdp.data."""
    x, y = classification_data(n=128)
    weights = initial_weights(model_fn)
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = model_fn()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if strategy is None or plain_input:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    else:  # replica r gets rows r*b .. (r+1)*b of every global batch, on any layout
        import tfdp

        data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                    global_batch)
    model.fit(data, epochs=epochs, verbose=0, shuffle=False)
    return model.get_weights()
