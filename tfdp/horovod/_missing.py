"""What ``tfdp.horovod`` does not implement, each with the tfdp way.

Rule: a Horovod name tfdp does not implement is never silently wrong. A function is
defined and raises ``NotImplementedError`` naming the alternative when called; a module or
class (``SyncBatchNormalization``) is reached through the package's
``__getattr__``, which raises ``AttributeError`` with the same explanation.
"""

from __future__ import annotations

import warnings

from tfdp import said_once

__all__ = ["UNAVAILABLE", "missing_attribute", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "start_timeline", "stop_timeline",
           "broadcast_global_variables", "BroadcastGlobalVariablesHook"]

UNAVAILABLE = {
    "SyncBatchNormalization": "use keras.layers.BatchNormalization(synchronized=True) in a "
                              "model built in tfdp.DataParallelStrategy().scope().",
    "PartialDistributedGradientTape": "not implemented; reduce the shared gradients with "
                                      "hvd.DistributedGradientTape and leave local ones out.",
    "PartialDistributedOptimizer": "not implemented; see PartialDistributedGradientTape.",
}


def missing_attribute(module: str, name: str):
    """The AttributeError for ``module.name`` when ``name`` is a Horovod name tfdp lacks."""
    if name in UNAVAILABLE:
        return AttributeError(f"{module}.{name}: {UNAVAILABLE[name]}")
    return AttributeError(f"module {module!r} has no attribute {name!r}")


class ProcessSet:
    """Horovod's process set: only the global one (every rank) exists in tfdp."""

    def __init__(self, ranks=None):
        if ranks is not None:
            raise NotImplementedError("tfdp.horovod: process sets are not supported; every "
                                      "collective spans all ranks (hvd.global_process_set).")
        self.ranks = None
        self.process_set_id = 0

    def __repr__(self):
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def add_process_set(process_set):
    raise NotImplementedError("tfdp.horovod: process sets are not supported; every collective "
                              "spans all ranks.")


def remove_process_set(process_set):
    raise NotImplementedError("tfdp.horovod: process sets are not supported.")


def _once(what, message):
    if said_once.first_time("tfdp.horovod", what):
        warnings.warn(message, stacklevel=3)


def start_timeline(file_path, mark_cycles=False):
    """Does nothing (with a warning): Horovod's timeline has no tfdp counterpart; use the
    TensorBoard profiler (``keras.callbacks.TensorBoard(profile_batch=...)``)."""
    _once("timeline", "tfdp.horovod.start_timeline does nothing: use the TensorBoard profiler "
                      "(keras.callbacks.TensorBoard(profile_batch=...)).")


def stop_timeline():
    """Does nothing (see ``start_timeline``)."""


def broadcast_global_variables(root_rank):
    raise NotImplementedError(
        "broadcast_global_variables is TensorFlow 1 (global variables, sessions): use "
        "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) or "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank).")


class BroadcastGlobalVariablesHook:
    """TensorFlow 1's session hook: not available."""

    def __init__(self, *args, **kwargs):
        broadcast_global_variables(None)
