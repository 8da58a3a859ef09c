"""The optimizers and data of the XLA equivalence tests (tests/test_xla.py, and the
multi-worker script tests/workers/mw_xla_worker.py): every optimizer path tfdp has, one model."""

import keras

import tfdp
from helpers import classification_data, initial_weights, mlp

GLOBAL_BATCH = 64
EPOCHS = 2

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
    "lamb": lambda: tfdp.optimizers.LAMB(0.01, weight_decay=0.01),
    "sharded": lambda: tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=0.5)),
    "accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
}


def data():
    return classification_data(n=256)


def weights():
    return initial_weights(mlp)
