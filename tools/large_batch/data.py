"""Datasets of the large-batch harness: scikit-learn's digits (the tiny default the tests use)
and Fashion-MNIST (70,000 28x28 images, Xiao et al. 2017).

Fashion-MNIST comes from the four standard IDX files
``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``: from ``--data_dir`` when given; otherwise
from Keras's cache ``~/.keras/datasets/fashion-mnist/`` (where
``keras.datasets.fashion_mnist.load_data()`` looks before downloading) or Debian's
``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist/``); otherwise through
``keras.datasets.fashion_mnist.load_data()`` with a short network timeout. When none of these
works the error names both ways to provide the files.

Split: the last ``validation_examples`` images of the (fixed-order) training split are the
validation set; the rest train. The official test split is not used: the harness measures
steps to a validation target, and no result here is a test-set claim.

Arrays are uint8 images (``scale`` turns them into [0, 1] floats on the fly) or float32
already in [0, 1] (digits), flattened to vectors, and int32 labels.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import socket

import numpy as np

FASHION_FILES = {"x_train": "train-images-idx3-ubyte.gz", "y_train": "train-labels-idx1-ubyte.gz",
                 "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}
KERAS_CACHE = os.path.join("~", ".keras", "datasets", "fashion-mnist")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
DOWNLOAD_TIMEOUT_S = 20


class DataUnavailableError(RuntimeError):
    """The dataset's files are nowhere the harness looks; the message says how to get them."""


@dataclasses.dataclass
class Split:
    """Training and validation arrays of one dataset."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    classes: int
    scale: float  # multiply x by this to get [0, 1] floats

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])


def read_idx(path: str) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array of its declared shape."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file.")
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    array = np.frombuffer(data, np.uint8, offset=4 + 4 * dims)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {array.size} bytes of data for shape {shape}.")
    return array.reshape(shape)


def _missing(directory: str) -> list[str]:
    return [name for name in FASHION_FILES.values()
            if not os.path.exists(os.path.join(directory, name))]


def _how_to_get_files(detail: str) -> str:
    return (f"Fashion-MNIST is not available: {detail}. Either run once with internet access "
            "(keras.datasets.fashion_mnist.load_data() saves the files in "
            f"{os.path.expanduser(KERAS_CACHE)}), or put the four files "
            f"{', '.join(FASHION_FILES.values())} in a directory and pass --data_dir=DIR "
            f"(Debian/Ubuntu: `apt-get install dataset-fashion-mnist` installs them in {DEBIAN_DIR}).")


def find_fashion_dir(data_dir: str = "", search=(KERAS_CACHE, DEBIAN_DIR)) -> str | None:
    """The directory holding the four files: ``data_dir`` if given (an error if files are
    missing there), else the first of ``search`` that has them, else None."""
    if data_dir:
        missing = _missing(data_dir)
        if missing:
            raise DataUnavailableError(_how_to_get_files(
                f"--data_dir={data_dir} lacks {', '.join(missing)}"))
        return data_dir
    for directory in search:
        directory = os.path.expanduser(directory)
        if not _missing(directory):
            return directory
    return None


def _download_with_keras():
    """``keras.datasets.fashion_mnist.load_data()`` with a bounded network wait."""
    import keras

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        (x_train, y_train), _ = keras.datasets.fashion_mnist.load_data()
    except Exception as error:  # any download failure gets the same advice
        raise DataUnavailableError(_how_to_get_files(
            f"none in {os.path.expanduser(KERAS_CACHE)} or {DEBIAN_DIR}, and the download "
            f"failed ({type(error).__name__}: {error})")) from error
    finally:
        socket.setdefaulttimeout(previous)
    return x_train, y_train


def load_fashion_mnist(validation_examples: int = 5000, data_dir: str = "",
                       download: bool = True, search=(KERAS_CACHE, DEBIAN_DIR)) -> Split:
    """Fashion-MNIST's training split as training + validation (see the module docstring)."""
    directory = find_fashion_dir(data_dir, search)
    if directory is not None:
        x = read_idx(os.path.join(directory, FASHION_FILES["x_train"]))
        y = read_idx(os.path.join(directory, FASHION_FILES["y_train"]))
    elif download:
        x, y = _download_with_keras()
    else:
        raise DataUnavailableError(_how_to_get_files(
            f"none in {', '.join(os.path.expanduser(d) for d in search)}"))
    x = x.reshape(len(x), -1)
    y = y.astype(np.int32)
    return _split("fashion_mnist", x, y, validation_examples, classes=10, scale=1.0 / 255.0)


def load_digits(validation_examples: int = 360) -> Split:
    """scikit-learn's 1,797 8x8 digits, shuffled once (seed 0), as training + validation."""
    from sklearn.datasets import load_digits as _load

    data = _load()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    return _split("digits", x[order], y[order], validation_examples, classes=10, scale=1.0)


def _split(name, x, y, validation_examples, *, classes, scale) -> Split:
    if not 0 < validation_examples < len(x):
        raise ValueError(f"--validation_examples={validation_examples} must be in (0, {len(x)}).")
    cut = len(x) - validation_examples
    return Split(name, x[:cut], y[:cut], x[cut:], y[cut:], classes, scale)


def load(name: str, validation_examples: int = 0, data_dir: str = "") -> Split:
    """Dataset by name; ``validation_examples`` 0 = the dataset's default."""
    if name == "digits":
        return load_digits(validation_examples or 360)
    if name == "fashion_mnist":
        return load_fashion_mnist(validation_examples or 5000, data_dir)
    raise ValueError(f"--dataset={name!r} is not 'digits' or 'fashion_mnist'.")
