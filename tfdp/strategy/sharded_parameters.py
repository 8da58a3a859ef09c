"""Sharded parameters: ZeRO stage 3 for ``DataParallelStrategy(shard_parameters=True)``.

Partition rule. A trainable floating-point variable of at least ``shard_min_elements``
elements, created in the strategy's scope, is flattened, padded with zeros to a multiple of R
(all replicas of all workers) and cut into R equal slices: replica g (worker rank w, local
replica i: g = w * local_replicas + i, the order of tfdp's collectives) stores elements
``[g * S, (g + 1) * S)`` with ``S = ceil(n / R)`` (``shard_layout``). A large variable is
split, never owned whole, so one embedding table spreads over every replica. Smaller
variables (biases, norms), non-trainable ones (BatchNorm statistics, counters) and integer
ones stay mirrored, as DeepSpeed's persistence threshold keeps them.

Optimizer state follows its parameter: a variable the optimizer creates for a sharded
parameter (``add_variable_from_reference``: Adam's moments, accumulators of
``gradient_accumulation_steps``) is sharded the same way. State of another shape (Adafactor's
factored moments) cannot be cut like its parameter and is refused when the optimizer builds.

What a read means (``ShardSpec``):

* a parameter read inside a replica (a layer's forward pass) is the whole tensor, all-gathered
  from every replica's slice; its gradient is the reduce-scatter of the whole tensor's
  gradient, so each replica's gradient for its slice is already the sum over all replicas
  (the global-batch gradient with Keras's per-replica loss scaling);
* the optimizer's update (``extended.update``) hands ``update_step`` the local slice and its
  local state slices: elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...) update shards as
  they would the whole tensor;
* outside any replica (``get_weights``, ``model.save``, checkpoints, ``numpy()``) a read is the
  whole tensor, gathered from every replica (with several workers: a collective, so every
  worker must take part, as with ShardedOptimizer's saves); assigning a whole tensor
  (``set_weights``, loading, restoring) gives each replica its slice. Checkpoints therefore
  hold whole tensors and restore on any replica count.

Gradients: tfdp's Keras hooks (gradient_hooks.install) all-reduce only the
mirrored variables' gradients; the sharded ones arrive reduce-scattered. Norms over whole
tensors (``clipnorm``, ``global_clipnorm``) add each replica's squared slice norms in one
scalar all-reduce (``clip_gradients``), so clipping equals one device's.

A sparse gradient of a sharded table (``tf.IndexedSlices``: an Embedding's looked-up rows)
is not made dense. One device's optimizers use its rows as they come (Adam squares each row
before rows at one index are added; ``clipnorm`` and ``global_clipnorm`` take the norm of
the rows), so the gather's gradient reduces the rows as unsharded tfdp does
(sparse_gradients.py: per-example lookups' rows concatenated in replica order, a lookup
shared by the batch summed position by position) and keeps this replica's elements of them:
a ``tf.IndexedSlices`` of the 1-D slice with one entry per element of every row, rows at one
index not added (``_slice_of_sparse_gradient``), which Keras's optimizer scatters into the
slice. Squares and norms are elementwise, so they are one device's; the squared norm of a
sparse gradient is that of its entries (``_squared_norm``), as Keras takes it. Every replica
holds the reduced rows while it cuts them (what unsharded tfdp holds: N x the lookups per
replica x the row width, which exceeds the dense table's gradient, the old rule's, where the
global batch looks up more rows than the table has); the slice's gradient, what stays until
the update, holds the elements of the rows that reach into the slice (about 1/N of them where
ids spread over the table; every row of a frequent id, such as padding, is its owner's).
Under XLA a unit called on integer ids runs uncompiled (sharded_units._compilable): a
compiled program's gradient loses the graph that tells the kinds of lookups apart.

Memory between steps, per replica: (parameters + gradients + optimizer state) / R for the
sharded variables. During a step this first stage keeps each gathered parameter until the
backward pass has used it (TensorFlow's gradient of a matmul holds its operand), i.e. the
whole model's parameters once per replica at the peak of a step; docs/zero.md has the numbers.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
import math

import keras
import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import (collectives, deadline, gradient_hooks, replica_ops, sparse_gradients,
                           whole_reads, wire)

__all__ = ["ShardSpec", "shard_layout", "owner_of", "DEFAULT_SHARD_MIN_ELEMENTS",
           "is_sharded", "clip_gradients", "sharded_bytes_per_replica", "slice_gradient",
           "gather_slice",
           "check_optimizer", "WHOLE_TENSOR_OPTIMIZERS"]

# Variables smaller than this stay mirrored: gathering a 1,000-element bias costs a collective
# round trip and saves a few kilobytes (DeepSpeed's stage3_param_persistence_threshold is 1e5).
DEFAULT_SHARD_MIN_ELEMENTS = 16384


def shard_layout(num_elements: int, num_shards: int) -> tuple[int, int]:
    """``(S, pad)``: each of ``num_shards`` slices holds S elements, the last ``pad`` of the
    flattened tensor's ``num_shards * S`` being zeros. Pure."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1.")
    size = max(1, math.ceil(num_elements / num_shards))
    return size, size * num_shards - num_elements


def owner_of(element: int, num_elements: int, num_shards: int) -> int:
    """The replica whose slice holds flat element ``element``. Pure."""
    if not 0 <= element < num_elements:
        raise ValueError(f"element {element} is outside [0, {num_elements}).")
    return element // shard_layout(num_elements, num_shards)[0]


def is_sharded(variable) -> bool:
    """True for a sharded parameter or state variable (Keras's, TensorFlow's or a slice)."""
    return _tf_private.is_sharded_variable(variable)


@dataclasses.dataclass(eq=False)
class ShardSpec:
    """One sharded variable: its whole shape, the layout, and what a read means.

    Attributes:
        shape: the whole tensor's shape.
        dtype: its dtype.
        num_shards: R, every replica of every worker.
        first_shard: the global replica id of this worker's first local replica.
        kind: ``"parameter"`` (a replica's read gathers) or ``"state"`` (a replica's read is
            its slice).
        strategy: the strategy that created it.
        name: the variable's name, for errors.
        read_id: its id for whole reads on several workers (whole_reads.py; "" otherwise).
    """

    shape: tf.TensorShape
    dtype: tf.DType
    num_shards: int
    first_shard: int
    kind: str
    strategy: object
    name: str = ""
    read_id: str = ""

    @property
    def num_elements(self) -> int:
        return int(self.shape.num_elements())

    @property
    def shard_size(self) -> int:
        return shard_layout(self.num_elements, self.num_shards)[0]

    @property
    def pad(self) -> int:
        return shard_layout(self.num_elements, self.num_shards)[1]

    # --- slices of a whole tensor (creation, assignment) ------------------------------------
    def flat_padded(self, value):
        flat = tf.reshape(tf.cast(tf.convert_to_tensor(value), self.dtype), [-1])
        if self.pad:
            flat = tf.concat([flat, tf.zeros([self.pad], self.dtype)], axis=0)
        return flat

    def slice_of(self, flat_padded, local_index: int):
        """Replica ``local_index``'s slice, in a buffer of its own.

        A slice of a tensor shares its buffer; a variable created or assigned from it would
        keep the whole tensor alive, and TensorFlow copies a shared buffer at the variable's
        first update (every slice of a model at once in the first step: measured, 15 bytes
        per parameter more at its peak). A copy owns its memory.
        """
        start = (self.first_shard + local_index) * self.shard_size
        return tf.raw_ops.DeepCopy(x=flat_padded[start:start + self.shard_size])

    def slices_of(self, value):
        value = tf.convert_to_tensor(value)
        if value.shape.num_elements() != self.num_elements:
            raise ValueError(f"Cannot assign a value of shape {value.shape} to a sharded "
                             f"variable of shape {self.shape}.")
        flat = self.flat_padded(value)
        local = len(self.strategy.extended.worker_devices)
        return [self.slice_of(flat, i) for i in range(local)]

    def whole_from_flat(self, flat):
        if self.pad:
            flat = flat[:self.num_elements]
        return tf.reshape(flat, self.shape)

    # --- reads ------------------------------------------------------------------------------
    def read_in_replica(self, component):
        if self.kind != "parameter":
            return component.value()
        given = getattr(_given_slices, "slices", {}).get(id(self))
        shard = component.value() if given is None else given
        return _gather_with_reduce_scatter_gradient(shard, self)

    def read_whole(self, components):
        components = list(components)
        if self.first_shard == 0 and len(components) == self.num_shards:
            # Every slice is in this process: no collective.
            with tf.device(components[0].device):
                return self.whole_from_flat(tf.concat([c.value() for c in components], axis=0))
        if not tf.executing_eagerly() and _tf_private.in_keras_symbolic_scope():
            # Keras learning output shapes: the value is never used; no collective.
            return tf.zeros(self.shape, self.dtype)
        if not tf.executing_eagerly():
            raise ValueError(
                "tfdp: a sharded variable cannot be read whole inside a tf.function outside "
                "strategy.run with several workers: its slices live on other workers. Read it "
                "inside strategy.run (a replica gathers it) or eagerly (every worker gathers "
                "it together, as get_weights and model.save do).")
        return _gather_across_workers(components, self)


_given_slices = threading.local()


class reading_given_slices(object):  # noqa: N801 (a context manager)
    """Inside it, a replica's read of the sharded parameters in ``slices`` (``{spec: slice
    tensor}``) gathers the given tensor instead of reading the variable: a unit passes its
    slices to its custom gradient as inputs (sharded_units.py)."""

    def __init__(self, slices):
        self._slices = {id(spec): value for spec, value in slices.items()}

    def __enter__(self):
        self._outer = getattr(_given_slices, "slices", {})
        _given_slices.slices = dict(self._outer)
        _given_slices.slices.update(self._slices)

    def __exit__(self, *exc):
        _given_slices.slices = self._outer


def _gather_with_reduce_scatter_gradient(shard, spec: ShardSpec):
    """The whole tensor from every replica's slice; backward: this slice's summed gradient."""

    @tf.custom_gradient
    def gather(x):
        whole = spec.whole_from_flat(replica_ops.all_gather(x))

        def grad(dy):
            return _slice_of_gradient(dy, spec)

        return whole, grad

    return gather(shard)


def _slice_of_gradient(whole_gradient, spec: ShardSpec):
    """This replica's slice of the sum over replicas of ``whole_gradient`` (a gradient of the
    whole tensor): a dense one reduce-scattered, a sparse one (``tf.IndexedSlices``) in one
    device's form (``_slice_of_sparse_gradient``)."""
    if isinstance(whole_gradient, tf.IndexedSlices):
        return _slice_of_sparse_gradient(whole_gradient, spec)
    flat = spec.flat_padded(tf.convert_to_tensor(whole_gradient))
    return replica_ops.reduce_scatter(tf.reshape(flat, [spec.num_shards, spec.shard_size]))


def _slice_of_sparse_gradient(slices, spec: ShardSpec):
    """This replica's slice of a sparse gradient (an Embedding's rows) as one device has it.

    The replicas' rows are reduced as unsharded tfdp reduces them (per-example lookups'
    rows concatenated in replica order, shared lookups' rows summed position by position:
    sparse_gradients.reduce_indexed_slices), then cut at element level: each row's elements
    of this replica's slice, one entry per element of every row, duplicates kept
    (sparse_gradients.elements_in_range). Every replica holds the reduced rows for a moment,
    as unsharded tfdp does; what stays (the gradient the optimizer applies) is the slice's.
    """
    strategy = spec.strategy
    rows = sparse_gradients.reduce_indexed_slices([slices], strategy,
                                                  wire.collective_options(strategy))[0]
    width = spec.num_elements // max(1, int(spec.shape[0])) if spec.shape.rank else 1
    start = replica_ops.global_replica_id(strategy) * spec.shard_size
    part = sparse_gradients.elements_in_range(rows, width, start, spec.shard_size)
    return tf.IndexedSlices(tf.cast(part.values, spec.dtype), part.indices, part.dense_shape)


def gather_slice(shard, spec: ShardSpec):
    """The whole parameter ``spec`` describes, all-gathered from this replica's ``shard``
    (a tensor); its gradient is this replica's slice of the sum over replicas (the
    reduce-scatter). What a unit compiled by XLA gathers outside its program
    (sharded_units.py)."""
    return _gather_with_reduce_scatter_gradient(shard, spec)


def slice_gradient(variable, whole_gradient):
    """This replica's slice of the sum over replicas of ``whole_gradient`` (a gradient taken
    with respect to the gathered tensor, as tfdp's XLA step does): what a replica's read
    would have run in the backward pass (a sparse gradient kept sparse, in one device's
    form)."""
    spec = _tf_private.sharded_container(getattr(variable, "value", variable)).tfdp_spec
    return _slice_of_gradient(whole_gradient, spec)


# strategy -> the one traced function that gathers a sharded variable whole across workers.
_whole_reads = weakref.WeakKeyDictionary()


def _gather_across_workers(components, spec: ShardSpec, serving: bool = False):
    """Eagerly, every slice from every worker (a collective all workers run together; the
    chief leads it and the other workers take part by the same call or by serving it,
    whole_reads.py; ``serving``: this is a worker serving the chief's read).

    One traced function per strategy, taking the slices as arguments (shapes relaxed after
    the second size): saving a model gathers every variable, and neither a save nor a backup
    every few steps traces again per variable (a function per variable was traced once each,
    and TensorFlow warned of retracing at every job's first save).
    """
    strategy = spec.strategy
    what = f"reading the sharded variable {spec.name!r} whole"
    if spec.read_id and not serving:
        whole_reads.take_part(strategy, spec.read_id, spec.name, what, _WHOLE_READ_FIX)
    gather = _whole_reads.get(strategy)
    first = gather is None
    if first:
        @tf.function(autograph=False, reduce_retracing=True)  # no tensor branches (agreement.py)
        def gather(slices):
            return strategy.run(replica_ops.all_gather, args=(slices,))
        _whole_reads[strategy] = gather
    local = list(components)

    def local_slice(context):  # the global replica id -> this worker's slice of it
        index = context.replica_id_in_sync_group - spec.first_shard
        if not 0 <= index < len(local):
            raise ValueError(f"tfdp: replica {context.replica_id_in_sync_group} holds no slice "
                             f"of {spec.name!r} on this worker (slices {spec.first_shard}.."
                             f"{spec.first_shard + len(local) - 1}).")
        return local[index].value()

    slices = strategy.experimental_distribute_values_from_function(local_slice)
    with deadline.collective_outside_step(strategy, what, _WHOLE_READ_FIX, kind="whole-read",
                                          first=first):
        flat = strategy.experimental_local_results(gather(slices))[0]
    return spec.whole_from_flat(flat)


_WHOLE_READ_FIX = (
    "Under shard_parameters=True (ZeRO-3) each worker holds slices of the parameters, so "
    "reading one whole (model.save, save_weights, get_weights, a checkpoint, a callback that "
    "reads weights) gathers its slices from every worker: make that call on every worker, "
    "not under `if is_chief` / `if rank == 0` (tfdp's BackupAndRestore, and Keras's "
    "ModelCheckpoint under tfdp, already save on every worker and write on the chief), or make it "
    "on the chief alone only where the other workers have finished their script: they serve "
    "the chief's reads from their exit.")


def create(extended, next_creator, min_elements, kwargs: dict):
    """A ShardedVariable for the creator's ``kwargs`` when the partition rule shards it, else
    None.

    ``kwargs["initial_value"]`` is evaluated at most once: when the variable is not sharded
    the caller passes the evaluated value on (``kwargs`` is updated in place), so an
    initializer's random draw is never repeated.
    """
    strategy = extended._container_strategy()  # noqa: SLF001 (our own extended object)
    devices = list(extended.worker_devices)
    rank = strategy.cluster.rank
    colocate_with = kwargs.get("colocate_with")
    container = _tf_private.sharded_container(colocate_with) if colocate_with is not None else None
    trainable = kwargs.get("trainable")
    synchronization = kwargs.get("synchronization")
    if synchronization == tf.VariableSynchronization.ON_READ:
        return None
    if container is None and trainable is False:
        return None
    initial_value = kwargs["initial_value"]
    dtype = kwargs.get("dtype")
    with tf.init_scope(), tf.device(devices[0]):
        value = initial_value() if callable(initial_value) else initial_value
        value = getattr(value, "wrapped_value", value)  # a CheckpointInitialValue
        value = tf.convert_to_tensor(value, dtype=dtype)
    kwargs["initial_value"] = value
    if not value.dtype.is_floating or not value.shape.is_fully_defined():
        return None
    if container is not None:
        if value.shape != container.shape:
            raise ValueError(
                f"tfdp: the optimizer creates state of shape {value.shape} for the sharded "
                f"parameter {container.name} of shape {container.shape}; with "
                "shard_parameters=True each replica updates only its slice, so optimizer "
                "state must be elementwise (shaped like its parameter: SGD, Adam, AdamW, "
                "RMSprop, Adagrad, Lion, ...). Factored or matrix-wise optimizers (Adafactor, "
                "Muon) cannot update a slice: use an elementwise optimizer, or "
                "shard_parameters=False with tfdp.ShardedOptimizer.")
        kind = "state"
    elif value.shape.num_elements() < max(1, min_elements):
        return None
    else:
        kind = "parameter"
    kwargs = {k: v for k, v in kwargs.items() if k not in ("colocate_with", "shape")}
    num_shards = strategy.num_replicas_in_sync
    spec = ShardSpec(shape=value.shape, dtype=value.dtype, num_shards=num_shards,
                     first_shard=rank * len(devices), kind=kind, strategy=strategy,
                     name=str(kwargs.get("name") or ""))
    if strategy.cluster.is_multi_worker and container is None:
        # Every worker slices the chief's value (initializers may draw differently per worker).
        whole = _tf_private.broadcast_initial_value(
            extended, devices[0], **dict(kwargs, initial_value=value))
        with tf.init_scope(), tf.device(devices[0]):
            value = whole()

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

    variable = _tf_private.create_sharded_variable(strategy, make_components, spec, **kwargs)
    if strategy.cluster.is_multi_worker:
        components = variable.components
        spec.read_id = whole_reads.register(
            strategy, lambda: _gather_across_workers(components, spec, serving=True))
    return variable


# --- Updates one slice at a time ----------------------------------------------------------------
_updates = threading.local()


class one_update_at_a_time(object):  # noqa: N801 (a context manager)
    """Around one variable's update in a replica: its ops run after the previous sharded
    variable's update in this replica's traced step. Keras's optimizer builds every variable's
    update independently, and a graph runs independent updates at once: their temporaries
    (Adam's new moments, the step) would then all exist together, several bytes per parameter
    of the whole model at the end of every step. One at a time, they exist for one slice."""

    def __enter__(self):
        graph = tf.compat.v1.get_default_graph()
        if getattr(_updates, "graph", None) is not graph:
            _updates.graph, _updates.last = graph, None
        self._graph, self._first = graph, _tf_private.operation_count(graph)
        self._deps = tf.control_dependencies([] if _updates.last is None else [_updates.last])
        self._deps.__enter__()

    def __exit__(self, *exc):
        self._deps.__exit__(*exc)
        if exc[0] is None and not tf.executing_eagerly():
            created = _tf_private.operations_since(self._graph, self._first)
            if created:
                _updates.last = tf.group(*created)


# --- Which optimizers can update slices --------------------------------------------------------
# Keras optimizers whose update of a variable needs the whole tensor: a norm over it (Lamb's
# trust ratio), its matrix shape (Muon's orthogonalisation) or factored moments (Adafactor).
# On a slice they would run and silently compute something else, so they are refused.
# tfdp's own LARS and LAMB take their norms over whole tensors (optimizers/_layerwise.py).
WHOLE_TENSOR_OPTIMIZERS = tuple(getattr(keras.optimizers, name) for name in
                                ("Lamb", "Muon", "Adafactor") if hasattr(keras.optimizers, name))


def check_optimizer(optimizer) -> None:
    """Raises ValueError when ``optimizer`` cannot update slices of sharded parameters."""
    if isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS):
        name = type(optimizer).__name__
        raise ValueError(
            f"tfdp: keras.optimizers.{name} cannot train sharded parameters "
            "(shard_parameters=True): its update of a variable needs the whole tensor (a norm, "
            "a matrix shape or factored moments), and each replica holds a slice. Use "
            "tfdp.optimizers.LAMB / tfdp.optimizers.LARS (their norms span replicas) or an "
            "elementwise optimizer (SGD, Adam, AdamW, RMSprop, Lion, ...), or "
            f"shard_parameters=False with tfdp.ShardedOptimizer({name}(...)).")


# --- Keras's moving averages (use_ema=True) ---------------------------------------------------

def install_keras_hooks():
    """Keras's EMA update assigns slices of the averages of sharded parameters (idempotent)."""
    def make(original):
        def _update_model_variables_moving_average(self, trainable_variables):
            averages = _tf_private.moving_averages(self) if self.use_ema else []
            if not any(_tf_private.is_sharded_variable(a) for a in averages if a is not None):
                return original(self, trainable_variables)
            # Keras's arithmetic; the assignment goes to the TensorFlow variable, which in a
            # replica writes this replica's slice (both reads are slices in the step).
            for variable, average in zip(trainable_variables, averages):
                if average is None:
                    continue
                not_first_step = tf.not_equal(self.iterations, 0)
                momentum = tf.cast(not_first_step, variable.dtype) * self.ema_momentum
                average.value.assign(momentum * average + (1 - momentum) * variable)
        return _update_model_variables_moving_average

    _tf_private.patch_keras_moving_average_update(make)


# --- Clipping with sharded gradients -----------------------------------------------------------

def _sum_over_replicas(value):
    return collectives.all_reduce(value)


def _squared_norm(g):
    """Keras's squared norm of a gradient: of a sparse one, of its rows (or elements) as they
    are, duplicates not added first (``ops.square`` keeps IndexedSlices), as one device
    takes it for ``global_clipnorm`` and tf.clip_by_norm for ``clipnorm``."""
    if isinstance(g, tf.IndexedSlices):
        g = g.values
    return tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))


def clip_gradients(optimizer, grads, variables, original_clip):
    """Keras's ``_clip_gradients`` when some of ``variables`` are sharded.

    ``grads`` of sharded variables are this replica's slices, already summed over replicas;
    the others are already all-reduced. A whole tensor's squared norm is the sum of its slices'
    squared norms over all replicas: one scalar all-reduce per clipped tensor (``clipnorm``) or
    one in all (``global_clipnorm``). The arithmetic is Keras's own (tf.clip_by_norm and
    Keras's clip_by_global_norm), with the norm replaced.
    """
    sharded = [_tf_private.is_sharded_variable(v) for v in variables]
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        out = []
        for g, is_shard in zip(grads, sharded):
            if g is None or not is_shard:
                out.append(None if g is None else optimizer._clip_by_norm(g))  # noqa: SLF001
                continue
            l2sum = _sum_over_replicas(_squared_norm(g))
            out.append(_clip_by_norm_with(g, optimizer.clipnorm, l2sum))
        return out
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        mirrored = [_squared_norm(g) for g, s in zip(grads, sharded) if g is not None and not s]
        slices = [_squared_norm(g) for g, s in zip(grads, sharded) if g is not None and s]
        total = _sum_over_replicas(tf.add_n(slices)) if slices else 0.0
        if mirrored:
            total = total + tf.add_n(mirrored)
        norm = tf.sqrt(total)
        clip = tf.cast(optimizer.global_clipnorm, norm.dtype)
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
    return original_clip(optimizer, grads)


def _clip_by_norm_with(t, clip_norm, l2sum):
    """tf.clip_by_norm's arithmetic for ``t`` whose squared norm is ``l2sum`` (a sparse ``t``
    stays sparse, its values clipped, as tf.clip_by_norm keeps it)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(_clip_by_norm_with(t.values, clip_norm, l2sum), t.indices,
                                t.dense_shape)
    l2sum = tf.cast(l2sum, t.dtype)
    positive = l2sum > 0
    safe = tf.where(positive, l2sum, tf.ones_like(l2sum))
    l2norm = tf.where(positive, tf.sqrt(safe), l2sum)
    clip_norm = tf.cast(clip_norm, t.dtype)
    return t * clip_norm / tf.maximum(l2norm, clip_norm)


def sharded_bytes_per_replica(variables, strategy=None) -> list[int]:
    """Bytes each local replica holds of ``variables``: a sharded one its slice, a mirrored one
    the whole tensor, a single-device one on its device only."""
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


gradient_hooks.SHARDED_HOOKS.update(clip_gradients=clip_gradients, check_optimizer=check_optimizer)
