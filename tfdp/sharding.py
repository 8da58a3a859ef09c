"""ShardedOptimizer: ZeRO stage 1 (optimizer-state sharding) for any Keras 3 optimizer.

Partition rule (whole variables, like PyTorch's ZeroRedundancyOptimizer): variables are
sorted by size, largest first, and each goes to the replica whose partition is currently
smallest (greedy LPT); ties go to the lower replica id. A variable is never split, so every
optimizer sees whole tensors: layer-wise norms (LARS, LAMB) and per-tensor clipping stay
exact with no extra communication. With many variables the largest partition stays within
a few percent of total/N; a variable larger than total/N is a partition of its own, so one
dominant variable limits the saving but never correctness.

Each step, in every replica:

1. pack the local gradients into one buffer ``[N, S]``, row k holding (zero-padded)
   the gradients of the variables replica k owns, and reduce-scatter it: replica k
   receives the global sum of row k (all-to-all + local sum; see collectives.py);
2. clip the owned reduced gradients (``clipvalue``/``clipnorm`` per tensor; the norm
   for ``global_clipnorm`` is one scalar all-reduce of the owned squared norms);
3. update the owned variables with the wrapped optimizer (decoupled weight decay
   included); its state exists only for the owned variables, on this device;
4. all-gather the owned new values, so every replica holds identical weights.

State consolidation: Keras saving (``save_weights``, ``model.save``, BackupAndRestore)
stores each slot of each variable as one full array, gathered from its owner: the files
do not depend on the replica count, and loading them into any number of replicas
(4 -> 2, 2 -> 1, 1 -> 4) hands each new owner its slots. With several workers, saving
gathers over the network, so every worker must save (the chief to the real path, the
others to a temporary one: tfdp.callbacks does this).

Sparse gradients (``IndexedSlices`` from ``Embedding``) are not reduce-scattered: they are
all-gathered as IndexedSlices (what TensorFlow does for them unsharded) and the owner
applies them, so optimizers with their own sparse update rule behave exactly as unsharded.
Their state is still sharded; their communication is not reduced.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
import tensorflow as tf
import keras

from tfdp import _tf_private, collectives

__all__ = ["ShardedOptimizer", "partition", "optimizer_state_bytes_per_replica"]


def partition(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Owner (0..num_shards-1) of each variable under the greedy largest-first rule. Pure."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1.")
    owners = [0] * len(sizes)
    heap = [(0, shard) for shard in range(num_shards)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, shard = heapq.heappop(heap)
        owners[index] = shard
        heapq.heappush(heap, (load + sizes[index], shard))
    return owners


def _num_elements(variable) -> int:
    return int(np.prod(variable.shape)) if len(variable.shape) else 1


class _Bookkeeping:
    """Plain holder: Keras's attribute tracker would add listed variables to ``variables``."""

    def __init__(self, slots, model_variables):
        self.slots = slots  # [(keras slot variable, model variable index)], creation order
        self.model_variables = model_variables


@keras.saving.register_keras_serializable(package="tfdp")
class ShardedOptimizer(keras.optimizers.Optimizer):
    """Shards the state of any Keras 3 optimizer across data-parallel replicas (ZeRO-1).

    Use it inside ``strategy.scope()`` of a ``tfdp.DataParallelStrategy``::

        optimizer = tfdp.ShardedOptimizer(keras.optimizers.Adam(1e-3, global_clipnorm=1.0))
        model.compile(optimizer=optimizer, loss=...)

    Training is equivalent to the wrapped optimizer unsharded; with N replicas each keeps
    about 1/N of the optimizer state (``state_bytes_per_replica()``). The module docstring
    states the partition rule, the step, and how state is consolidated for checkpoints.

    Args:
        optimizer: the Keras 3 optimizer to shard (its learning rate, schedule, clipping
            and weight-decay settings are used as they are). ``use_ema``,
            ``gradient_accumulation_steps`` and ``loss_scale_factor`` on it are not
            supported: wrap the ShardedOptimizer in ``LossScaleOptimizer`` for loss scaling.
        name: defaults to ``"sharded_" + optimizer.name``.

    References:
        - Rajbhandari et al., 2019. ZeRO: Memory Optimizations Toward Training Trillion
          Parameter Models. https://arxiv.org/abs/1910.02054
        - PyTorch ``torch.distributed.optim.ZeroRedundancyOptimizer`` (partition rule).
    """

    # Tells tfdp's Keras hooks not to all-reduce: this optimizer reduce-scatters itself.
    _tfdp_reduces_itself = True

    def __init__(self, optimizer, name=None, **kwargs):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"ShardedOptimizer wraps a keras.optimizers.Optimizer, got "
                            f"{type(optimizer).__name__}.")
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("The optimizer is already a ShardedOptimizer.")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError("Wrap the other way round: "
                            "LossScaleOptimizer(ShardedOptimizer(optimizer)).")
        for attr in ("use_ema", "gradient_accumulation_steps", "loss_scale_factor"):
            if getattr(optimizer, attr, None):
                raise ValueError(f"ShardedOptimizer does not support {attr} on the wrapped "
                                 f"optimizer ({attr}={getattr(optimizer, attr)!r}).")
        super().__init__(learning_rate=0.0, name=name or f"sharded_{optimizer.name}", **kwargs)
        self.inner_optimizer = optimizer
        self._owners = None

    # --- the wrapped optimizer's hyper-parameters ----------------------------------------
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    # --- partition and state ---------------------------------------------------------------
    def _topology(self):
        """(tfdp strategy or None, replicas in sync, worker rank, local device names)."""
        strategy = self._distribution_strategy
        if getattr(strategy, "_is_tfdp_strategy", False):
            return (strategy, strategy.num_replicas_in_sync, strategy.cluster.rank,
                    list(strategy.extended.worker_devices))
        if strategy.num_replicas_in_sync == 1:
            return None, 1, 0, ["/device:CPU:0"]
        raise ValueError(
            f"ShardedOptimizer needs tfdp.DataParallelStrategy (or no strategy); it was "
            f"created under {type(strategy).__name__}. Create it inside "
            "tfdp.DataParallelStrategy().scope().")

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        strategy, num_replicas, rank, local_devices = self._topology()
        self._num_replicas = num_replicas
        first_local = rank * len(local_devices)
        sizes = [_num_elements(v) for v in var_list]
        self._owners = partition(sizes, num_replicas)
        keys = {self._var_key(v): i for i, v in enumerate(var_list)}
        slot_owner = {}  # id(tf.Variable) -> model variable index

        def place_slot(next_creator, **kwargs):
            reference = building_slot_for[-1] if building_slot_for else None
            index = keys.get(self._var_key(reference)) if reference is not None else None
            if index is None:
                return next_creator(**kwargs)
            local = self._owners[index] - first_local
            if strategy is None:
                pass  # one device: the slot goes wherever the optimizer puts it
            elif 0 <= local < len(local_devices):
                kwargs["colocate_with"] = _tf_private.SingleDevice(local_devices[local])
            else:
                # Owned by another worker: an empty stand-in keeps the wrapped optimizer's
                # slot lists aligned with the variables; this worker never updates it.
                dtype = kwargs.get("dtype") or tf.as_dtype(reference.dtype)
                kwargs["initial_value"] = tf.zeros([0], dtype=dtype)
                kwargs["shape"] = tf.TensorShape([0])
                kwargs["colocate_with"] = _tf_private.SingleDevice(local_devices[0])
            variable = next_creator(**kwargs)
            slot_owner[id(variable)] = index
            return variable

        inner = self.inner_optimizer
        # Slots are made by add_variable_from_reference(model variable, ...): note which
        # model variable each one belongs to while the wrapped optimizer builds.
        building_slot_for = []
        add_from_reference = inner.add_variable_from_reference

        def tracking_add(reference_variable, *args, **kwargs):
            building_slot_for.append(reference_variable)
            try:
                return add_from_reference(reference_variable, *args, **kwargs)
            finally:
                building_slot_for.pop()

        inner.add_variable_from_reference = tracking_add
        try:
            with tf.variable_creator_scope(place_slot):
                inner.build(var_list)
        finally:
            del inner.add_variable_from_reference
        slots, kept = [], []
        for v in inner._variables:  # noqa: SLF001
            index = slot_owner.get(id(v.value))
            if index is None:
                kept.append(v)
            else:
                slots.append((v, index))
        # The slots are per-device partitions; they are saved consolidated by this
        # wrapper (save_own_variables), not as the wrapped optimizer's own variables.
        inner._variables = kept  # noqa: SLF001
        self._book = _Bookkeeping(slots, list(var_list))

    def owner_of(self, variable) -> int:
        """The replica that keeps ``variable``'s optimizer state."""
        return self._owners[self._get_variable_index(variable)]

    def _owned_indices(self, replica_id):
        return [i for i, owner in enumerate(self._owners) if owner == replica_id]

    # --- the step ----------------------------------------------------------------------------
    def _clip_gradients(self, grads):
        return grads  # clipping happens on the reduced, owned gradients (see module doc)

    def _apply_weight_decay(self, variables):
        return  # the wrapped optimizer's decay is applied to owned variables in the step

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        variables = list(trainable_variables)
        indices = [self._get_variable_index(v) for v in variables]
        by_index = dict(zip(indices, variables))
        if self._num_replicas == 1:
            self._update_owned(dict(zip(indices, grads)), variables, indices)
            return
        dtypes = {v.dtype for v in variables}
        if len(dtypes) > 1:
            raise TypeError("ShardedOptimizer needs all trainable variables in one dtype, got "
                            f"{sorted(str(d) for d in dtypes)}.")
        me = collectives.global_replica_id(self._distribution_strategy)
        owned_grads = self._reduce_to_owners(dict(zip(indices, grads)), by_index, me)  # step 1
        owned = [i for i in indices if i in owned_grads]
        self._update_owned(owned_grads, [by_index[i] for i in owned], owned,         # steps 2-3
                           distributed=True)
        self._gather_from_owners(indices, by_index, me)                              # step 4

    def _rows(self, indices, by_index):
        """Variable indices per owner, and the padded row width in elements."""
        rows = [[i for i in indices if self._owners[i] == r] for r in range(self._num_replicas)]
        width = max(1, max(sum(_num_elements(by_index[i]) for i in row) for row in rows))
        return rows, width

    def _reduce_to_owners(self, grad_of, by_index, me):
        """Step 1: this replica's owned gradients, summed over all replicas."""
        strategy = self._distribution_strategy
        sparse = [i for i, g in grad_of.items() if isinstance(g, tf.IndexedSlices)]
        owned = {}
        if sparse:
            # Sparse gradients travel as IndexedSlices (an all-gather of rows, as TensorFlow
            # reduces them unsharded), so optimizers with sparse update rules stay exact.
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [grad_of[i] for i in sparse])
            owned.update((i, g) for i, g in zip(sparse, reduced) if self._owners[i] == me)
        dense = [i for i in grad_of if i not in sparse]
        rows, width = self._rows(dense, by_index)
        dtype = by_index[dense[0]].dtype if dense else tf.float32
        packed = tf.stack([self._pack([grad_of[i] for i in row], width, dtype) for row in rows])
        packed = collectives.to_wire(packed, strategy.compression)
        mine = tf.cast(collectives.reduce_scatter(packed, strategy), dtype)
        owned.update(zip(rows[me], self._unpack(mine, [by_index[i] for i in rows[me]])))
        return owned

    def _gather_from_owners(self, indices, by_index, me):
        """Step 4: every replica receives every owner's new values."""
        rows, width = self._rows(indices, by_index)
        dtype = by_index[indices[0]].dtype
        new_values = self._pack([by_index[i].value for i in rows[me]], width, dtype)
        gathered = tf.reshape(collectives.all_gather(new_values[tf.newaxis], axis=0),
                              [self._num_replicas, width])
        for r, row in enumerate(rows):
            if r == me or not row:
                continue
            for i, value in zip(row, self._unpack(gathered[r], [by_index[i] for i in row])):
                by_index[i].assign(value)

    def _update_owned(self, grad_of, variables, indices, distributed=False):
        inner = self.inner_optimizer
        grads = [grad_of[i] for i in indices]
        grads = self._clip_owned(grads, distributed)
        lr = inner.learning_rate
        if type(inner)._apply_weight_decay is not _tf_private.TFOptimizer._apply_weight_decay:
            inner._apply_weight_decay(variables)  # noqa: SLF001  its own rule (LARS/LAMB: none here)
        elif inner.weight_decay is not None:
            # Keras's decoupled decay (AdamW...), on the owned variables only.
            for v in variables:
                if inner._use_weight_decay(v):  # noqa: SLF001
                    wd = tf.cast(inner.weight_decay, v.dtype)
                    v.assign(v - v * wd * tf.cast(lr, v.dtype))
        for g, v in zip(grads, variables):
            inner.update_step(g, v, lr)
        inner.iterations.assign_add(1)

    def _clip_owned(self, grads, distributed):
        inner = self.inner_optimizer
        if inner.clipnorm and inner.clipnorm > 0:
            return [tf.clip_by_norm(g, inner.clipnorm) for g in grads]
        if inner.global_clipnorm and inner.global_clipnorm > 0:
            squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
                                for g in grads] or [tf.constant(0.0)])
            if distributed:
                squares = collectives.all_reduce(squares)
            norm = tf.sqrt(squares)
            clip = tf.constant(inner.global_clipnorm, tf.float32)
            scale = clip / tf.maximum(norm, clip)  # Keras's clip_by_global_norm
            return [tf.IndexedSlices(g.values * tf.cast(scale, g.dtype), g.indices, g.dense_shape)
                    if isinstance(g, tf.IndexedSlices) else g * tf.cast(scale, g.dtype) for g in grads]
        if inner.clipvalue and inner.clipvalue > 0:
            return [tf.clip_by_value(g, -inner.clipvalue, inner.clipvalue) for g in grads]
        return grads

    @staticmethod
    def _pack(tensors, width, dtype):
        parts = [tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors]
        used = sum(int(p.shape[0]) for p in parts)
        parts.append(tf.zeros([width - used], dtype))
        return tf.concat(parts, axis=0)

    @staticmethod
    def _unpack(flat, variables):
        out, offset = [], 0
        for v in variables:
            n = _num_elements(v)
            out.append(tf.reshape(flat[offset:offset + n], v.shape))
            offset += n
        return out

    # --- memory --------------------------------------------------------------------------------
    def state_bytes_per_replica(self) -> list[int]:
        """Optimizer-state bytes held on each local replica's device, measured from the
        variables that exist there (sharded slots plus the small mirrored counters)."""
        if not self.built:
            raise ValueError("The optimizer is not built yet; train a step or call build().")
        return optimizer_state_bytes_per_replica(self, self._distribution_strategy)

    # --- consolidated checkpoints ----------------------------------------------------------------
    def _consolidated_slots(self) -> list[np.ndarray]:
        """Each slot as one full array, gathered from its owner (topology-free)."""
        if self._num_replicas == 1 or self._distribution_strategy.cluster.num_workers == 1:
            return [np.asarray(v.value.numpy()) for v, _ in self._book.slots]
        return self._gather_slots_across_workers()

    def _gather_slots_across_workers(self):
        strategy = self._distribution_strategy
        slots_of = {r: [(k, v, i) for k, (v, i) in enumerate(self._book.slots) if self._owners[i] == r]
                    for r in range(self._num_replicas)}
        shapes = [tuple(self._book.model_variables[i].shape) for _, i in self._book.slots]
        dtype = self._book.slots[0][0].value.dtype if self._book.slots else tf.float32
        width = max(1, max(sum(int(np.prod(shapes[k])) for k, _, _ in slots_of[r])
                           for r in range(self._num_replicas)))

        @tf.function
        def gather():
            def fn():
                me = collectives.global_replica_id(strategy)
                local = self._pack([v.value for _, v, _ in slots_of[me]], width, dtype)
                return collectives.all_gather(local[tf.newaxis], axis=0)
            return strategy.run(fn)

        table = strategy.experimental_local_results(gather())[0].numpy()
        out = [None] * len(self._book.slots)
        for r in range(self._num_replicas):
            offset = 0
            for k, _, _ in slots_of[r]:
                n = int(np.prod(shapes[k]))
                out[k] = table[r, offset:offset + n].reshape(shapes[k])
                offset += n
        return out

    def save_own_variables(self, store):
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable.numpy()
        for k, value in enumerate(self._consolidated_slots() if self.built else []):
            store[f"slot_{k}"] = value

    def load_own_variables(self, store):
        own = [k for k in store.keys() if not str(k).startswith("slot_")]
        slots = [k for k in store.keys() if str(k).startswith("slot_")]
        if len(own) != len(self.variables) or len(slots) != len(self._book.slots if self.built else []):
            raise ValueError(
                f"Cannot load optimizer state into {self.name}: the file has {len(own)} "
                f"variables and {len(slots)} slots, this optimizer {len(self.variables)} and "
                f"{len(self._book.slots) if self.built else 0}. Build it on the same model first.")
        for i, variable in enumerate(self.variables):
            variable.assign(store[str(i)])
        for k, (slot, index) in enumerate(self._book.slots):
            if tuple(slot.value.shape) == (0,):
                continue  # owned by another worker, which loads it itself
            slot.value.assign(np.asarray(store[f"slot_{k}"]))

    def get_config(self):
        config = super().get_config()
        config.pop("learning_rate", None)  # the wrapped optimizer's, serialized with it
        config["optimizer"] = keras.optimizers.serialize(self.inner_optimizer)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.optimizers.deserialize(config.pop("optimizer"), custom_objects=custom_objects)
        allowed = {"name"}
        return cls(inner, **{k: v for k, v in config.items() if k in allowed})


def optimizer_state_bytes_per_replica(optimizer, strategy=None) -> list[int]:
    """Bytes of optimizer state on each local replica's device, for any Keras optimizer.

    Mirrored variables count on every device; single-device variables (ShardedOptimizer's
    slots) on theirs only.
    """
    strategy = strategy or tf.distribute.get_strategy()
    variables = list(optimizer.variables)
    if isinstance(optimizer, ShardedOptimizer):
        variables += [v for v, _ in optimizer._book.slots] + list(optimizer.inner_optimizer.variables)
    if not getattr(strategy, "_is_tfdp_strategy", False) and strategy.num_replicas_in_sync == 1:
        # One device (no strategy): everything lives there.
        values = [getattr(v, "value", v) for v in variables]
        return [sum(v.shape.num_elements() * v.dtype.size for v in values)]
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    keys = [(d.device_type, d.device_index) for d in devices]
    totals = [0] * len(devices)
    for variable in variables:
        value = getattr(variable, "value", variable)
        for component in strategy.experimental_local_results(value):
            spec = tf.DeviceSpec.from_string(component.device)
            key = (spec.device_type, spec.device_index)
            nbytes = component.shape.num_elements() * component.dtype.size
            if key in keys:
                totals[keys.index(key)] += nbytes
    return totals
