"""ZeRO-3's sharded variables: creation by the partition rule, and whole reads across workers.

Rule. Under ``shard_parameters=True`` the strategy's variable creator asks ``create`` for each
variable: when the partition rule (partition.py) shards it, the initial value (evaluated at
most once, so an initializer's random draw is never repeated) is cut into this worker's slices,
one variable per local replica, behind one ``ShardedVariable`` (_tf_private) whose reads its
layout.ShardSpec defines. With several workers every worker slices the chief's value (an
initializer may draw differently per worker), as a mirrored variable is broadcast from the
chief; optimizer state follows its parameter and is made on every worker alike. Read whole
outside a step on several workers, a variable's slices are gathered from every worker by
``WholeGather``: one traced function per strategy, led by the chief (whole_reads.py).

Memory between steps, per replica: (parameters + gradients + optimizer state) / R for the
sharded variables; docs/zero.md has the numbers.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import deadline, replica_ops
from tfdp.strategy.zero3 import partition, whole_reads
from tfdp.strategy.zero3.layout import ShardSpec, is_sharded

__all__ = ["create", "WholeGather", "is_sharded", "sharded_bytes_per_replica"]


class WholeGather:
    """Eagerly, every slice of a sharded variable from every worker: the collective all
    workers run together (the chief leads it and the other workers take part by the same
    call or by serving it, whole_reads.py).

    One traced function per strategy, taking the slices as arguments (shapes relaxed after
    the second size): saving a model gathers every variable, and neither a save nor a backup
    every few steps traces again per variable (a function per variable was traced once each,
    and TensorFlow warned of retracing at every job's first save).

    The strategy's extended object owns it (data_parallel.py), so the function lives as long
    as the strategy, and no module-level table keeps a strategy alive.
    """

    def __init__(self):
        self._function = None

    def _traced(self, strategy):
        """``(function, first)``: the traced gather, and whether this call makes it."""
        if self._function is not None:
            return self._function, False

        @tf.function(autograph=False, reduce_retracing=True)  # no tensor branches (agreement.py)
        def gather(slices):
            return strategy.run(replica_ops.all_gather, args=(slices,))

        self._function = gather
        return gather, True

    def __call__(self, components, spec: ShardSpec, serving: bool = False):
        """The whole tensor of ``spec``'s variable from this worker's ``components``.

        Args:
            components: this worker's slice variables, in local replica order.
            spec: the variable's layout.
            serving: this is a worker serving the chief's read (it takes no part in the
                read's announcement).
        """
        strategy = spec.strategy
        what = f"reading the sharded variable {spec.name!r} whole"
        if spec.read_id and not serving:
            whole_reads.take_part(strategy, spec.read_id, spec.name, what, WHOLE_READ_FIX)
        gather, first = self._traced(strategy)
        local = list(components)

        def local_slice(context):  # the global replica id -> this worker's slice of it
            index = context.replica_id_in_sync_group - spec.first_shard
            if not 0 <= index < len(local):
                raise ValueError(f"tfdp: replica {context.replica_id_in_sync_group} holds no "
                                 f"slice of {spec.name!r} on this worker (slices "
                                 f"{spec.first_shard}..{spec.first_shard + len(local) - 1}).")
            return local[index].value()

        slices = strategy.experimental_distribute_values_from_function(local_slice)
        with deadline.collective_outside_step(strategy, what, WHOLE_READ_FIX, kind="whole-read",
                                              first=first):
            flat = strategy.experimental_local_results(gather(slices))[0]
        return spec.whole_from_flat(flat)


WHOLE_READ_FIX = (
    "Under shard_parameters=True (ZeRO-3) each worker holds slices of the parameters, so "
    "reading one whole (model.save, save_weights, get_weights, a checkpoint, a callback that "
    "reads weights) gathers its slices from every worker: make that call on every worker, "
    "not under `if is_chief` / `if rank == 0` (tfdp's BackupAndRestore, and Keras's "
    "ModelCheckpoint under tfdp, already save on every worker and write on the chief), or make it "
    "on the chief alone only where the other workers have finished their script: they serve "
    "the chief's reads from their exit.")


def _evaluated_initial_value(kwargs: dict, device):
    """The creator's initial value as a tensor, evaluated here once; ``kwargs`` is updated in
    place so that a variable left mirrored is made from this value (no second draw)."""
    initial_value = kwargs["initial_value"]
    with tf.init_scope(), tf.device(device):
        value = initial_value() if callable(initial_value) else initial_value
        value = getattr(value, "wrapped_value", value)  # a CheckpointInitialValue
        value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
    kwargs["initial_value"] = value
    return value


def _shape_of(value):
    """The shape as the pure rule takes it: a tuple, or None for an unknown rank."""
    return None if value.shape.rank is None else tuple(value.shape.as_list())


def create(extended, next_creator, min_elements, kwargs: dict, whole_gather: WholeGather):
    """A ShardedVariable for the creator's ``kwargs`` when the partition rule shards it, else
    None (the caller then mirrors it from ``kwargs``, whose initial value this may have
    evaluated: see ``_evaluated_initial_value``).

    Args:
        extended: the strategy's extended object.
        next_creator: the next variable creator (one call per local slice).
        min_elements: the partition rule's size threshold (partition.size_threshold).
        kwargs: the creator's arguments.
        whole_gather: the strategy's WholeGather.

    Raises:
        ValueError: optimizer state shaped otherwise than its sharded parameter.
    """
    strategy = extended._container_strategy()  # our own extended object
    devices = list(extended.worker_devices)
    colocate_with = kwargs.get("colocate_with")
    parameter = (_tf_private.sharded_container(colocate_with) if colocate_with is not None
                 else None)
    if not partition.may_shard(
            on_read=kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ,
            trainable=kwargs.get("trainable"), follows_parameter=parameter is not None):
        return None
    value = _evaluated_initial_value(kwargs, devices[0])
    kind = partition.kind_of(
        shape=_shape_of(value), floating=value.dtype.is_floating, min_elements=min_elements,
        parameter_shape=None if parameter is None else tuple(parameter.shape.as_list()),
        parameter_name="" if parameter is None else parameter.name)
    if kind is None:
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("colocate_with", "shape")}
    layout = partition.Partition(int(value.shape.num_elements()), strategy.num_replicas_in_sync,
                                 strategy.cluster.rank * len(devices), len(devices))
    spec = ShardSpec(shape=value.shape, dtype=value.dtype, partition=layout, kind=kind,
                     strategy=strategy, whole_gather=whole_gather,
                     name=str(kwargs.get("name") or ""))
    if strategy.cluster.is_multi_worker and kind is partition.Kind.PARAMETER:
        value = _chiefs_value(extended, devices[0], value, kwargs)
    variable = _tf_private.create_sharded_variable(
        strategy, _component_maker(spec, value, devices, next_creator), spec, **kwargs)
    if strategy.cluster.is_multi_worker:
        components = variable.components
        spec.read_id = whole_reads.register(
            strategy, lambda: whole_gather(components, spec, serving=True))
    return variable


def _chiefs_value(extended, device, value, kwargs):
    """The chief's initial value, broadcast (every worker slices the same tensor)."""
    whole = _tf_private.broadcast_initial_value(extended, device,
                                                **dict(kwargs, initial_value=value))
    with tf.init_scope(), tf.device(device):
        return whole()


def _component_maker(spec: ShardSpec, value, devices, next_creator):
    """``make_components(**kwargs)``: one slice variable per local replica (what
    _tf_private.create_sharded_variable calls)."""

    def make_components(**component_kwargs):
        with tf.init_scope(), tf.device(devices[0]):
            flat = spec.flat_padded(value)
        components = []
        for i, device in enumerate(devices):
            args = dict(component_kwargs)
            if i:
                args["name"] = "%s/replica_%d/" % (components[0].name.split(":")[0], i)
            with tf.device(device):
                args["initial_value"] = spec.slice_of(flat, i)
                components.append(next_creator(**args))
        return components

    return make_components


def sharded_bytes_per_replica(variables, strategy=None) -> list[int]:
    """Bytes each local replica holds of ``variables``: a sharded one its slice, a mirrored one
    the whole tensor, a single-device one on its device only.

    Args:
        variables: Keras or TensorFlow variables.
        strategy: whose local replicas count (default: the current strategy).
    """
    strategy = strategy or tf.distribute.get_strategy()
    devices = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
    totals = [0] * len(devices)
    for variable in variables:
        value = getattr(variable, "value", variable)
        container = _tf_private.sharded_container(value)
        parts = (container.components if container is not None
                 else getattr(value, "values", None) or (value,))
        for part in parts:
            device = tf.DeviceSpec.from_string(part.device).to_string()
            size = int(part.shape.num_elements()) * tf.as_dtype(part.dtype).size
            for k, d in enumerate(devices):
                if d == device:
                    totals[k] += size
    return totals
