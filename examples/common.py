"""Shared by the examples and tools: real data that needs no download, small timers, and a
quiet TensorFlow import.

The data is the UCI handwritten-digits set bundled with scikit-learn (1,797 8x8 images,
10 classes), so every example runs offline.

Importing this module imports TensorFlow first, without the startup notices TensorFlow 2.21
prints from C++ at import whatever ``TF_CPP_MIN_LOG_LEVEL`` says (the absl "All log messages
before absl::InitializeLog()" warning, the oneDNN and CPU-feature INFO lines): the examples
should print only what the user needs. Anything else written during the import is passed on.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's own INFO/WARNING lines

_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\] ")
_ABSL_PREINIT = ("WARNING: All log messages before absl::InitializeLog() is called are written "
                 "to STDERR")


def drop_startup_notices(text: str) -> str:
    """``text`` without TensorFlow's C++ INFO records (and their continuation lines) and
    absl's pre-initialisation warning; every other line is kept."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == _ABSL_PREINIT:
            continue
        if _RECORD.match(line):
            dropping = line.startswith("I")
        elif not line.startswith("To enable the following instructions"):
            dropping = False  # only the CPU-feature notice continues on a second line
        if not dropping:
            kept.append(line)
    return "".join(kept)


def import_tensorflow_quietly():
    """Imports TensorFlow with its C++ startup notices filtered out of stderr."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            rest = drop_startup_notices(captured.read().decode("utf-8", errors="replace"))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()
    return tensorflow


# tfdp before TensorFlow: importing tfdp decides XLA's persistent compilation cache (tfdp-run's
# --compile-cache) by setting TF_XLA_FLAGS, and in a script run by absl's app.run, as every
# example is, TensorFlow imported first has already read them: the cache stayed off and a
# restarted worker compiled again (measured, TF 2.21; tools/bench_restart.py).
import tfdp  # noqa: E402,F401 (before TensorFlow, see above)

import_tensorflow_quietly()

import keras  # noqa: E402 (after the quiet TensorFlow import)
import numpy as np  # noqa: E402 (after the quiet TensorFlow import)


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
