"""Keras's distribution API (``keras.distribution``) on the TensorFlow backend.

What lives here: the patches that make ``keras.distribution`` run through tfdp
(tfdp/keras_distribution/): the TensorFlow backend's ``distribution_lib`` functions Keras's
front end calls (``list_devices``; ``num_processes``, ``process_id``, ``initialize``,
``get_device_count``, ``distribute_tensor``, which that backend lacks), ``set_distribution``
in every namespace that binds it, the Keras TensorFlow ``Variable``'s creation (to know which
Keras variable a ``tf.Variable`` is made for), and ``Distribution.distribute_dataset``.

Why no public API serves: Keras's TensorFlow backend module says "DO NOT USE" and ignores a
distribution (variables and ``fit`` never consult it), and Keras offers no hook for a
backend to take one over; the front end looks the backend's functions up at call time
(``distribution_lib.list_devices(...)``), so replacing them there is the one way in.
tests/test_tf_private.py pins every entry.
"""

from __future__ import annotations

import sys

from tfdp._tf_private.core import patch_attribute, provide_attribute

# Functions of keras.src.backend.tensorflow.distribution_lib tfdp replaces (present) or
# provides (absent in Keras 3.15: the JAX backend has them, the front end asks for them).
BACKEND_REPLACED = ("list_devices",)
BACKEND_PROVIDED = ("num_processes", "process_id", "initialize", "get_device_count",
                    "distribute_tensor")


def keras_distribution_lib():
    """Keras's front-end module (``keras.distribution``'s home)."""
    from keras.src.distribution import distribution_lib

    return distribution_lib


def keras_backend_distribution_lib():
    """The TensorFlow backend's ``distribution_lib`` module."""
    from keras.src.backend.tensorflow import distribution_lib

    return distribution_lib


def keras_distribution_base():
    """``keras.src.distribution.distribution_lib.Distribution`` (DataParallel's and
    ModelParallel's base; not exported by Keras)."""
    return keras_distribution_lib().Distribution


def patch_keras_backend_distribution(functions: dict) -> None:
    """Puts ``functions`` (name -> function) into the TensorFlow backend's distribution_lib:
    ``BACKEND_REPLACED`` names replace Keras's, ``BACKEND_PROVIDED`` ones are added."""
    module = keras_backend_distribution_lib()
    for name, function in functions.items():
        if name in BACKEND_REPLACED:
            patch_attribute(module, name, lambda original, f=function: _wrapping(f, original),
                   "keras.distribution through tfdp")
        elif name in BACKEND_PROVIDED:
            provide_attribute(module, name, function, "keras.distribution through tfdp")
        else:
            raise ValueError(f"not a backend distribution function tfdp handles: {name}")


def _wrapping(function, original):
    def replacement(*args, **kwargs):
        return function(*args, **kwargs)

    replacement.__name__ = original.__name__
    replacement.__doc__ = function.__doc__
    return replacement


def patch_keras_set_distribution(make) -> None:
    """Replaces ``set_distribution`` by ``make(original)`` in every loaded module that binds
    Keras's (the front end, ``keras.distribution``, ``keras.src.distribution``, tf_keras's);
    ``Distribution.scope()`` calls the front end's."""
    original = keras_distribution_lib().set_distribution
    original = getattr(original, "__wrapped__", original)
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "set_distribution", None) is original:
            patch_attribute(module, "set_distribution", make, "keras.distribution through tfdp")


def patch_keras_variable_initialize(make) -> None:
    """Replaces the Keras TensorFlow ``Variable._initialize(self, value)`` (where the
    ``tf.Variable`` is created, inside ``self``'s path) by ``make(original)``."""
    from keras.src.backend.tensorflow.core import Variable

    patch_attribute(Variable, "_initialize", make, "which Keras variable a tf.Variable is made for")


def patch_keras_distribute_dataset(make) -> None:
    """Replaces ``Distribution.distribute_dataset`` by ``make(original)``."""
    patch_attribute(keras_distribution_base(), "distribute_dataset", make,
           "each example once per epoch across workers")


def set_keras_distribution_quietly(value) -> None:
    """Sets Keras's global distribution without calling ``set_distribution`` (tfdp's reset
    puts the one found at install back after its patches are gone)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(keras_distribution_lib().GLOBAL_ATTRIBUTE_NAME, value)
