"""keras.distribution's TensorFlow backend, made real: each Distribution runs as one tfdp strategy.

Rule. ``set_distribution(d)`` (and ``d.scope()``, which calls it) maps ``d`` to one
``DataParallelStrategy`` (``plan.plan_mesh``: every mesh device a replica), built once per
distribution object and kept, and holds that strategy's ``scope()`` open until the
distribution is replaced or unset: Keras captures ``tf.distribute.get_strategy()`` when a
model and its optimizer are created, so models created while ``d`` is set have their variables
on the mesh's devices and ``fit``/``evaluate``/``predict`` and custom loops run through tfdp,
exactly as under ``with tfdp.DataParallelStrategy().scope():``. ``ModelParallel`` builds the
strategy with ``shard_parameters=True`` and a rule: a parameter whose layout
(``d.get_variable_layout``: the LayoutMap, or a variable's own layout) shards any axis is
stored 1/N (ZeRO-3), every other one is mirrored; compute stays data-parallel.

The backend functions Keras's front end asks for (``list_devices``, ``get_device_count``,
``num_processes``, ``process_id``, ``initialize``, ``distribute_tensor``) answer for tfdp's
job. What cannot be honored raises ``KerasDistributionError`` (a ``ValueError``) before
anything changes. Installed by ``tfdp.keras_distribution.install()``; ``tfdp.reset()`` undoes
it (``clear``: the held scope exited, the patches gone, Keras's distribution as found).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from tfdp import process_state
from tfdp import _tf_private
from tfdp.cluster import ClusterConfig
from tfdp.keras_distribution import plan as plan_lib
from tfdp.keras_distribution.plan import KerasDistributionError
from tfdp.strategy import devices as devices_lib

__all__ = ["install", "clear", "describe", "strategy_for", "list_devices", "initialize",
           "KerasDistributionError"]

log = logging.getLogger("tfdp")


class _State:
    def __init__(self):
        self.installed = False
        self.found = None  # Keras's distribution when tfdp installed
        self.strategies = {}  # id(distribution) -> (distribution, strategy)
        self.held = None  # (scope context manager, strategy) held open
        self.lock = threading.RLock()


_state = _State()
_creating = threading.local()  # .variable: the Keras variable whose tf.Variable is being made


# --- the job's devices ------------------------------------------------------------------------

def _job():
    """``(local device names, device type, cluster)``: what ``DataParallelStrategy()`` takes."""
    cluster = ClusterConfig.from_env()
    devices_lib.configure_from_env()
    if cluster.task_gpus is not None:
        requested = devices_lib.task_gpu_devices(cluster.task_gpus)
    else:
        requested = devices_lib.shared_host_gpu_devices(cluster)
    names, device_type = devices_lib.resolve_local_devices(requested)
    return names, device_type, cluster


def list_devices(device_type=None):
    """The job's devices, every worker's, in tfdp's replica order: ``"cpu:0"``, ... (GPUs if
    the workers have them, else logical CPUs). A type the job does not train on: []."""
    names, kind, cluster = _job()
    if device_type and str(device_type).upper() != kind:
        return []
    return plan_lib.device_names(kind, len(names), cluster.num_workers)


def get_device_count(device_type=None):
    """How many devices ``list_devices(device_type)`` lists."""
    return len(list_devices(device_type))


def num_processes():
    """The job's number of workers (TF_CONFIG, tfdp-run, Slurm, Kubernetes, initialize())."""
    return ClusterConfig.from_env().num_workers


def process_id():
    """This worker's rank in the job."""
    return ClusterConfig.from_env().rank


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """``keras.distribution.initialize`` on TensorFlow: writes this worker's ``TF_CONFIG`` from
    every worker's address (``plan.initialize_workers``), which the strategies built afterwards
    join. Under tfdp-run, TF_CONFIG, Slurm or Kubernetes the job is known already; arguments
    that contradict it are an error."""
    target = plan_lib.initialize_workers(job_addresses, num_processes, process_id)
    current = ClusterConfig.from_env()
    if target is None:
        return
    workers, rank = target
    if current.is_multi_worker:
        if list(current.workers) != workers or current.rank != rank:
            raise KerasDistributionError(
                f"keras.distribution.initialize(workers={workers}, rank={rank}) contradicts "
                f"the job this process already belongs to ({current.describe()}). Fix: call "
                "initialize() without arguments under tfdp-run/TF_CONFIG/Slurm/Kubernetes.")
        return
    if _state.strategies:
        raise KerasDistributionError(
            "keras.distribution.initialize() was called after a distribution was set in this "
            "process as a single worker. Fix: call initialize() first, as on JAX.")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                          "task": {"type": "worker", "index": rank}})
    log.info("tfdp: keras.distribution.initialize: worker %d of %d (TF_CONFIG written)",
             rank, len(workers))


def distribute_tensor(tensor, layout):
    """An activation's layout (``LayoutMap["<layer>/output"]``): compute is data-parallel, so
    each replica already holds its rows of the batch; the values are what the layout asks
    for, computed whole per replica (docs/keras_distribution.md)."""
    del layout
    return tensor


# --- Distribution -> strategy ---------------------------------------------------------------

def _kind(distribution):
    lib = _tf_private.keras_distribution_lib()
    if isinstance(distribution, lib.ModelParallel):
        return "model_parallel"
    if isinstance(distribution, lib.DataParallel):
        return "data_parallel"
    raise KerasDistributionError(
        f"keras.distribution.set_distribution({type(distribution).__name__}): tfdp runs "
        "DataParallel and ModelParallel on the TensorFlow backend, not other Distribution "
        "classes. Fix: use one of those two, or tfdp.DataParallelStrategy directly.")


def strategy_for(distribution):
    """The ``DataParallelStrategy`` that runs ``distribution`` (built once per object)."""
    with _state.lock:
        entry = _state.strategies.get(id(distribution))
        if entry is not None and entry[0] is distribution:
            return entry[1]
        kind = _kind(distribution)
        names, device_type, cluster = _job()
        mesh = distribution.device_mesh
        plan = plan_lib.plan_mesh([str(d) for d in mesh.devices.flatten()],
                                  device_type=device_type, per_worker=len(names),
                                  num_workers=cluster.num_workers, rank=cluster.rank)
        if kind == "model_parallel" and distribution.batch_dim_name not in mesh.axis_names:
            raise KerasDistributionError(
                f"ModelParallel batch_dim_name={distribution.batch_dim_name!r} is not an axis "
                f"of the mesh {tuple(mesh.axis_names)}. Fix: name one of the mesh's axes.")
        from tfdp.strategy.data_parallel import DataParallelStrategy

        local = [names[i] for i in plan.local_positions]
        strategy = DataParallelStrategy(devices=local, cluster=cluster,
                                        shard_parameters=kind == "model_parallel")
        if kind == "model_parallel":
            strategy.extended._tfdp_shard_rule = (  # tfdp's own engine
                lambda kwargs, d=distribution: _layout_shards_variable(d))
        _state.strategies[id(distribution)] = (distribution, strategy)
        log.info("tfdp: keras.distribution %s -> DataParallelStrategy over %d replica(s)%s",
                 type(distribution).__name__, plan.num_replicas,
                 " (layout-sharded variables stored 1/N)" if kind == "model_parallel" else "")
        return strategy


def _layout_shards_variable(distribution) -> bool:
    variable = getattr(_creating, "variable", None)
    if variable is None or not variable.trainable:
        return False  # tfdp shards trainable parameters only; the rest stay mirrored
    layout = distribution.get_variable_layout(variable)
    axes = getattr(layout, "axes", layout)
    if axes is not None and len(axes) != len(variable.shape):
        raise KerasDistributionError(
            f"the layout {tuple(axes)} of variable {variable.path!r} has {len(axes)} axes but "
            f"the variable has shape {tuple(variable.shape)}. Fix: give one axis (or None) per "
            "dimension in the LayoutMap.")
    return plan_lib.layout_shards(axes)


def _hold(strategy) -> None:
    """Holds ``strategy.scope()`` open (None: none), exiting the one held before."""
    with _state.lock:
        if _state.held is not None:
            if _state.held[1] is strategy:
                return
            scope, _ = _state.held
            _state.held = None
            scope.__exit__(None, None, None)
        if strategy is not None:
            scope = strategy.scope()
            scope.__enter__()
            _state.held = (scope, strategy)


def _make_set_distribution(original):
    def set_distribution(value):
        strategy = None if value is None else strategy_for(value)
        original(value)
        _hold(strategy)

    set_distribution.__doc__ = original.__doc__
    return set_distribution


def _make_initialize_variable(original):
    def _initialize(self, value):
        previous = getattr(_creating, "variable", None)
        _creating.variable = self
        try:
            return original(self, value)
        finally:
            _creating.variable = previous

    return _initialize


def _make_distribute_dataset(original):
    def distribute_dataset(self, dataset):
        entry = _state.strategies.get(id(self))
        if entry is None or entry[0] is not self:
            return original(self, dataset)
        if entry[1].cluster.is_multi_worker and not self.auto_shard_dataset:
            raise KerasDistributionError(
                "auto_shard_dataset=False with several workers is not supported by tfdp's "
                "keras.distribution: TensorFlow's input pipeline splits each worker's batches "
                "as global ones. Fix: keep auto_shard_dataset=True (tfdp's strategy shards a "
                "tf.data input across workers, each example once per epoch), or use "
                "tfdp.data.distribute.")
        # The strategy shards a tf.data input across workers itself (each example once per
        # epoch, TensorFlow's auto-shard); Keras's rebatch-and-shard on top would do it twice.
        return dataset

    return distribute_dataset


_BACKEND = {"list_devices": list_devices, "get_device_count": get_device_count,
            "num_processes": num_processes, "process_id": process_id,
            "initialize": initialize, "distribute_tensor": distribute_tensor}


def install() -> bool:
    """Puts keras.distribution on tfdp (idempotent); False when Keras's backend is not
    TensorFlow (nothing changes)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return False
    with _state.lock:
        if not _state.installed:
            _state.found = keras.distribution.distribution()
        _tf_private.patch_keras_backend_distribution(_BACKEND)
        _tf_private.patch_keras_set_distribution(_make_set_distribution)
        _tf_private.patch_keras_variable_initialize(_make_initialize_variable)
        _tf_private.patch_keras_distribute_dataset(_make_distribute_dataset)
        _state.installed = True
        current = keras.distribution.distribution()
    if current is not None:  # set before tfdp was imported: run it now
        keras.distribution.set_distribution(current)
    return True


def describe():
    """What this module holds: (installed, strategies built, a scope held)."""
    return _state.installed, len(_state.strategies), _state.held is not None


def clear() -> None:
    """``tfdp.reset()``'s part (after the patches are restored): the held scope exited, the
    strategies forgotten, Keras's distribution as it was when tfdp installed."""
    with _state.lock:
        try:
            _hold(None)
        finally:
            if _state.installed:
                _tf_private.set_keras_distribution_quietly(_state.found)
            _state.strategies.clear()
            _state.installed = False
            _state.found = None


process_state.register("keras.distribution", __name__, describe, clear)
