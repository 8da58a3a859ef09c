"""tfdp: data-parallel training for TensorFlow 2 and Keras 3.

Public names only; see README.md for the tour and the guides in docs/.

The TensorFlow side loads lazily (PEP 562) so that the launcher (``tfdp-run``,
``python -m tfdp.run``) and ``tfdp.cluster`` stay pure Python: importing them does not import
TensorFlow. Everything loads on first use of any TensorFlow-side name, or at ``import tfdp``
when Keras or TensorFlow is already imported, which registers tfdp's Keras classes (LARS,
LAMB, ShardedOptimizer, schedules) for ``keras.models.load_model``. It also puts Keras's own
``keras.distribution`` API on tfdp (``tfdp.keras_distribution``), undone by ``tfdp.reset()``.
"""

import importlib as _importlib
import os as _os
import sys as _sys

from tfdp.cluster import ClusterConfig, ClusterConfigError
from tfdp.process_state import reset

__version__ = "0.5.0"

_NAMES = {
    "configure_cpu_replicas": "tfdp.strategy.devices",
    "DataParallelStrategy": "tfdp.strategy.data_parallel",
    "scale_learning_rate": "tfdp.optimizers.schedules",
    "ShardedOptimizer": "tfdp.optimizers.sharded",
    "compile_gradients": "tfdp.strategy.xla",
}
_SUBMODULES = ("callbacks", "data", "optimizers", "schedules")
_TF_SIDE = ("tfdp.strategy.data_parallel", "tfdp.optimizers", "tfdp.schedules", "tfdp.data",
            "tfdp.callbacks")

__all__ = ["callbacks", "ClusterConfig", "ClusterConfigError", "compile_gradients",
           "configure_cpu_replicas", "data",
           "DataParallelStrategy", "optimizers", "reset", "scale_learning_rate", "schedules",
           "ShardedOptimizer"]


def _load_tensorflow_side():
    try:
        import tensorflow  # noqa: F401 (only whether it imports)
        import keras  # noqa: F401 (only whether it imports)
    except ImportError as error:
        # The launcher and tfdp.cluster need neither, so TensorFlow is an extra of the package.
        raise ImportError(
            f"tfdp needs TensorFlow 2.20/2.21 and Keras 3 for this ({error}). Install them with "
            "tfdp: pip install 'tfdp[cpu]' (CPU) or 'tfdp[and-cuda]' (GPUs), or pip install "
            "tensorflow next to it.") from error
    for module in _TF_SIDE:
        _importlib.import_module(module)
    for name, module in _NAMES.items():
        globals()[name] = getattr(_sys.modules[module], name)


def __getattr__(name):
    if name in _NAMES or name in _SUBMODULES:
        _load_tensorflow_side()
        return globals()[name] if name in _NAMES else _sys.modules[f"tfdp.{name}"]
    raise AttributeError(f"module 'tfdp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _configure_compile_cache():
    """XLA's persistent compilation cache (tfdp.resilience.compile_cache), decided before
    TensorFlow initialises its devices: it reads TF_XLA_FLAGS then, once."""
    from tfdp.resilience import compile_cache
    started = False
    if _sys.modules.get("tensorflow") is not None:
        from tfdp import _tf_private
        started = _tf_private.eager_context_initialized()
    if not started:
        compile_cache.configure()
    elif compile_cache.resolve(_os.environ).directory is not None:
        compile_cache.log.info("tfdp: XLA compile cache not on: TensorFlow initialised its "
                               "devices before tfdp was imported.")


_configure_compile_cache()

if _sys.modules.get("keras") is not None or _sys.modules.get("tensorflow") is not None:
    _load_tensorflow_side()

# keras.distribution on the TensorFlow backend runs through tfdp (docs/keras_distribution.md):
# now if Keras is imported, else when it is (a one-shot import hook; nothing of TensorFlow
# is imported here).
from tfdp import keras_distribution as _keras_distribution  # noqa: E402 (after the exports it wraps)

_keras_distribution.install_when_keras_loads()
