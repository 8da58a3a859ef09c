"""``import tfdp.horovod.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` on tfdp.

The names of ``tfdp.horovod`` (the same functions: they take tensors or values), plus
``callbacks`` (``tfdp.horovod.keras.callbacks``) and ``load_model``. See docs/horovod.md.
"""

from tfdp.horovod import *  # noqa: F403 (hvd.keras is hvd's API)
from tfdp.horovod import __all__ as _hvd_all
from tfdp.horovod import _missing
from tfdp.horovod.keras import callbacks
from tfdp.horovod.optimizer import make_distributed, reduction_settings

__all__ = list(_hvd_all) + ["callbacks", "load_model"]


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=None, **kwargs):
    """``keras.models.load_model`` whose compiled optimizer (state included) averages its
    gradients over all ranks, as ``hvd.DistributedOptimizer`` (Horovod's ``load_model``).

    Args:
        filepath: the ``.keras`` file.
        custom_optimizers: optimizer classes the file names that Keras does not know.
        custom_objects: passed to ``keras.models.load_model``.
        compression: ``hvd.Compression.none`` (default) or ``fp16``.
    """
    import keras as _keras
    from tfdp.horovod.collectives import Average, Compression
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = _keras.models.load_model(filepath, custom_objects=objects or None, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        settings = reduction_settings(compression or Compression.none, False, Average, 1.0, 1,
                                      False, None)
        make_distributed(optimizer, settings, in_place=True)
    return model


def __getattr__(name):
    raise _missing.missing_attribute(__name__, name)
