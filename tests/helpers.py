"""Shared helpers: deterministic data, the models and optimizer lists several test modules
use, and a train-and-compare routine."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import keras

import tfdp


def cpu_devices(n):
    return [f"/device:CPU:{i}" for i in range(n)]


def classification_data(n=256, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, classes)), axis=1).astype("int32")
    return x, y


def image_data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int32")
    return x, y


def mlp(features=8, classes=3):
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(classes),
    ])


def convnet(classes=2):
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(classes),
    ])


def deep_mlp():
    """Six Dense layers of uneven widths: variables enough to shard over 4 replicas."""
    return keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(w, activation="tanh") for w in (24, 16, 12, 20, 8)] + [keras.layers.Dense(3)])


def many_variable_model():
    """26 variables of many sizes, for the per-replica memory of sharded optimizer state."""
    widths = [64, 48, 64, 32, 64, 40, 56, 32, 64, 48, 24, 64]
    return keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(w, activation="relu") for w in widths]
                            + [keras.layers.Dense(10)])


def mixed_precision_mlp(features=8, classes=3):
    """For the mixed_float16 policy: float32 logits, as Keras recommends."""
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(classes, dtype="float32")])


# The optimizers ShardedOptimizer must match (tests/test_sharding.py): every update rule and
# clipping path, each a factory of a fresh optimizer.
SHARDING_OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.3),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "lars": lambda: tfdp.optimizers.LARS(2.0, weight_decay=1e-3),
    "lamb": lambda: tfdp.optimizers.LAMB(0.02, weight_decay=1e-2, global_clipnorm=1.0),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
}

# The optimizers of the gradient-accumulation tests (tests/test_zero2.py, and
# tests/zero2_cases.py for two workers): factories taking Keras optimizer arguments such as
# gradient_accumulation_steps.
ACCUMULATION_OPTIMIZERS = {
    "adam_global_clipnorm": lambda **kw: keras.optimizers.Adam(0.01, global_clipnorm=0.3, **kw),
    "adamw": lambda **kw: keras.optimizers.AdamW(0.01, weight_decay=0.05, **kw),
    "lamb": lambda **kw: tfdp.optimizers.LAMB(0.02, weight_decay=1e-2, global_clipnorm=1.0, **kw),
    "lars": lambda **kw: tfdp.optimizers.LARS(2.0, weight_decay=1e-3, **kw),
}


def initial_weights(model_fn, seed=1234):
    keras.utils.set_random_seed(seed)
    return model_fn().get_weights()


def train(strategy, model_fn, optimizer_fn, x, y, global_batch, epochs=2, weights=None,
          compile_kwargs=None, fit_kwargs=None):
    """Trains under ``strategy`` (None = no strategy); returns (model, history dict)."""
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = model_fn()
        if weights is not None:
            model.set_weights(weights)
        model.compile(
            optimizer=optimizer_fn(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], **(compile_kwargs or {}))
    history = model.fit(ds, epochs=epochs, verbose=0, **(fit_kwargs or {}))
    return model, history.history


def assert_weights_close(a, b, atol=1e-5, rtol=1e-5):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, atol=atol, rtol=rtol, err_msg=f"weight {i}")


def replica_components(strategy, variable):
    """The per-replica numpy values of a mirrored variable."""
    var = getattr(variable, "value", variable)
    return [np.asarray(v) for v in strategy.experimental_local_results(var)]


def embedding_model(vocab=50, dim=8):
    """A model with sparse (IndexedSlices) gradients: Embedding -> Flatten -> Dense."""
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(vocab, dim),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def token_data(n=256, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(n, 4)).astype("int32")
    y = rng.integers(0, 3, size=n).astype("int32")
    return x, y
