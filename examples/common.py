"""Shared by the examples and tools: real data that needs no download, and small timers.

The data is the UCI handwritten-digits set bundled with scikit-learn (1,797 8x8 images,
10 classes), so every example runs offline.
"""

from __future__ import annotations

import time

import keras
import numpy as np


def load_digits(test_fraction=0.2, seed=0, image=False):
    """Returns ((x_train, y_train), (x_test, y_test)) as float32 in [0, 1] and int32."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    if image:
        x = x.reshape(-1, 8, 8, 1)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = int(len(x) * test_fraction)
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def build_model(keras):
    """The examples' ConvNet for 8x8 digits (about 0.3M parameters)."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(10),
    ])


class Throughput(keras.callbacks.Callback):
    """Samples/s per epoch; the first epoch (tracing, warm-up) is left out of the median.

    Args:
        samples_per_epoch: examples one epoch trains on, across all replicas.
    """

    def __init__(self, samples_per_epoch):
        super().__init__()
        self.samples_per_epoch = samples_per_epoch
        self.rates = []
        self._started = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(self.samples_per_epoch / (time.perf_counter() - self._started))

    @property
    def samples_per_second(self):
        steady = self.rates[1:] or self.rates
        return float(np.median(steady)) if steady else float("nan")
