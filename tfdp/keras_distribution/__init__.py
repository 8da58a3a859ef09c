"""Keras's own distribution API (``keras.distribution``) made real on TensorFlow by tfdp.

Rule. ``import tfdp`` is the one line a script adds: ``install()`` runs then if Keras is
imported (with the TensorFlow backend), or as soon as Keras finishes importing
(``install_when_keras_loads``: a one-shot import hook, pure Python). After it, ``DataParallel``
and ``ModelParallel`` set with ``keras.distribution.set_distribution`` (or entered with
``scope()``) run through a ``tfdp.DataParallelStrategy`` (tfdp/keras_distribution/backend.py);
how a mesh and a layout map onto tfdp is decided by pure functions (``plan``).
``tfdp.reset()`` undoes it; ``install()`` puts it back. See docs/keras_distribution.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from tfdp.keras_distribution.plan import KerasDistributionError

__all__ = ["install", "install_when_keras_loads", "KerasDistributionError"]


def install() -> bool:
    """Puts ``keras.distribution`` on tfdp (idempotent); False when Keras's backend is not
    TensorFlow (nothing changes, nothing of TensorFlow is imported). Imports Keras."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return False
    from tfdp.keras_distribution import backend

    return backend.install()


class _AfterKeras(importlib.abc.MetaPathFinder):
    """Finds ``keras`` as the other finders do, and runs ``install`` once it has loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        _remove_hook()
        spec = _spec_from_the_other_finders(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _install_quietly()

        loader.exec_module = exec_module
        return spec


def _spec_from_the_other_finders(name, path, target):
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is not None:
            spec = find_spec(name, path, target)
            if spec is not None:
                return spec
    return importlib.machinery.PathFinder.find_spec(name, path)


_hook = _AfterKeras()


def _remove_hook():
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def _install_quietly():
    # Keras is loaded; another backend, or no TensorFlow, leaves everything as it is.
    try:
        install()
    except ImportError:
        pass


def install_when_keras_loads() -> None:
    """``install()`` now if Keras is imported, else right after Keras's import (one-shot)."""
    if sys.modules.get("keras") is not None:
        _install_quietly()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
