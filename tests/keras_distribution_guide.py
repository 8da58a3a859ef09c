"""Keras's distributed-training guide (keras-io ``guides/distribution.py``, "Distributed training
with the Keras distribution API"), its code as the guide writes it, on the TensorFlow backend.

The guide sets ``KERAS_BACKEND="jax"``; here the backend line says ``"tensorflow"`` and
``import tfdp`` is the one line added (tests/test_keras_distribution.py, and under tfdp-run
tests/workers/keras_distribution_worker.py). Its two parts: ``DataParallel`` over the devices
(a 1-D mesh), then ``ModelParallel`` with a 2-D ``("data", "model")`` mesh and a LayoutMap
(``d1/kernel`` sharded on ``model``, ``d1/bias`` on ``model``, ``d2/output`` on ``data``).
Each builds the guide's model (Flatten, Dense(200) "d1", Dropout(0.4), Dense(10, softmax) "d2"),
``compile(loss="mse")``, ``fit(dataset, epochs=3)``, ``evaluate(dataset)``, on 128 random
28x28x1 images with random 10-vectors, batched 16 (the global batch).

Not a copy of the guide (no network here): written from its published code and Keras's
docstrings; ``SEED`` is added so two runs start from the same weights and Dropout seeds.
"""

import numpy as np
import tensorflow as tf
import keras
from keras import layers

SEED = 5
EPOCHS = 3


def dataset():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(128, 28, 28, 1)).astype("float32")
    labels = rng.normal(size=(128, 10)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(16)


def guide_model():
    keras.utils.set_random_seed(SEED)
    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = layers.Dropout(0.4)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    model = keras.Model(inputs=inputs, outputs=y)
    model.compile(loss="mse")
    return model


def fit_and_evaluate(model):
    model.fit(dataset(), epochs=EPOCHS, verbose=0)
    loss = model.evaluate(dataset(), verbose=0)
    return model, loss


def one_device():
    """The reference: the same code with no distribution set."""
    return fit_and_evaluate(guide_model())


def data_parallel(devices):
    """The guide's DataParallel part; the distribution is unset afterwards."""
    data_parallel = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(data_parallel)
    try:
        return fit_and_evaluate(guide_model())
    finally:
        keras.distribution.set_distribution(None)


def model_parallel_distribution(devices):
    mesh_2d = keras.distribution.DeviceMesh(
        shape=(2, len(devices) // 2), axis_names=["data", "model"], devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh_2d)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/output"] = ("data", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def model_parallel(devices):
    """The guide's ModelParallel part (``with distribution.scope():`` around the model)."""
    model_parallel = model_parallel_distribution(devices)
    with model_parallel.scope():
        model = guide_model()
    return fit_and_evaluate(model)
