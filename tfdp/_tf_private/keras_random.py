"""Keras's random numbers: the TensorFlow backend's draw functions and its seeds.

What lives here: the patches that make each replica draw what one device draws on the global
batch (tfdp/strategy/randomness.py), and the two seed internals they need. Each entry says
why no public API serves; tests/test_tf_private.py pins them.
"""

from __future__ import annotations

import functools

from tfdp._tf_private.core import patch_attribute

# Why: every Keras random op (keras.random.*, Dropout, GaussianNoise, the augmentation layers)
# ends in one of these functions of the TensorFlow backend's random module, looked up at call
# time (``backend.random.uniform``); no public hook lets a strategy change what a replica draws.
# Functions whose first argument is the shape of the draw:
KERAS_SHAPED_DRAWS = ("normal", "uniform", "randint", "truncated_normal", "gamma", "binomial",
                      "beta")
# Functions whose first argument is a tensor the draw follows row by row:
KERAS_INPUT_DRAWS = ("dropout", "categorical")


def _random_module():
    from keras.src.backend.tensorflow import random

    return random


def patch_keras_random(make_shaped, make_input_led) -> None:
    """Module patches of the Keras TensorFlow backend's random draws (see the Why above)."""
    module = _random_module()
    for name in KERAS_SHAPED_DRAWS:
        patch_attribute(module, name, make_shaped, "replica draws as on one device")
    for name in KERAS_INPUT_DRAWS:
        patch_attribute(module, name, make_input_led, "replica draws as on one device")


def keras_draw_seed(seed):
    """The seed tensor Keras's draw would use for ``seed`` (advances a SeedGenerator once).

    Why: ``keras.random`` has no public function that resolves a seed argument (an int, a
    ``SeedGenerator`` or None: the global generator) to the tensor a draw uses.
    """
    from keras.src.random.seed_generator import draw_seed

    return draw_seed(seed)


def drawn_seed(value):
    """A ``keras.random.SeedGenerator`` whose every draw is the seed tensor ``value``.

    Why: Keras's backend draws accept a seed as an int or a SeedGenerator only, and resolve
    it themselves; tfdp resolves it once (``keras_draw_seed``) and hands the same tensor to
    the draw it makes instead, so the generator advances once, as on one device. The
    subclass skips SeedGenerator's constructor, which would create a state variable.
    """
    return _drawn_seed_class()(value)


@functools.cache
def _drawn_seed_class():
    import keras

    class _DrawnSeed(keras.random.SeedGenerator):
        def __init__(self, seed_value):  # no state variable: see above
            self._tfdp_value = seed_value

        def next(self, ordered=True):
            return self._tfdp_value

    return _DrawnSeed
