"""ShardedOptimizer's state outside the step: consolidated checkpoints, memory accounting,
and LossScaleOptimizer saving around it (see sharding.py's docstring, "State consolidation").

Rule: a sharded slot, accumulator or EMA copy is saved as one full array gathered from its
owner, so files do not depend on the replica or worker count.
"""

from __future__ import annotations


import numpy as np
import tensorflow as tf

from tfdp import _tf_private
from tfdp.optimizers import packing
from tfdp.strategy import collectives, is_data_parallel

__all__ = ["ConsolidatedState", "variable_bytes_per_device", "optimizer_state_bytes_per_replica",
           "install_loss_scale_saving_hooks"]


def _is_stand_in(variable) -> bool:
    """An empty placeholder for state that another worker's replica owns.

    The Keras wrapper reports the shape it was asked for; the placeholder's own (the
    TensorFlow variable's) is (0,).
    """
    return tuple(getattr(variable, "value", variable).shape) == (0,)


class ConsolidatedState:
    """ShardedOptimizer's Keras saving: its counters by position, then every sharded slot
    consolidated (a mixin: uses the optimizer's partition and bookkeeping)."""

    def _consolidated_slots(self) -> list[np.ndarray]:
        """Each slot as one full array, gathered from its owner (topology-free)."""
        strategy = _tf_private.optimizer_strategy(self)
        if self._num_replicas == 1 or strategy.cluster.num_workers == 1:
            return [np.asarray(v.value.numpy()) for v, _ in self._book.slots]
        return self._gather_slots_across_workers()

    def _gather_slots_across_workers(self):
        strategy = _tf_private.optimizer_strategy(self)
        slots_of = {r: [(k, v, i) for k, (v, i) in enumerate(self._book.slots) if self._owners[i] == r]
                    for r in range(self._num_replicas)}
        shapes = [tuple(self._book.model_variables[i].shape) for _, i in self._book.slots]
        dtype = self._book.slots[0][0].value.dtype if self._book.slots else tf.float32
        width = packing.row_width([[int(np.prod(shapes[k])) for k, _, _ in slots_of[r]]
                                   for r in range(self._num_replicas)])

        @tf.function
        def gather():
            def fn():
                me = collectives.global_replica_id(strategy)
                local = packing.pack([v.value for _, v, _ in slots_of[me]], width, dtype)
                return collectives.all_gather(local[tf.newaxis], axis=0)
            return strategy.run(fn)

        table = strategy.experimental_local_results(gather())[0].numpy()
        out = [None] * len(self._book.slots)
        for r in range(self._num_replicas):
            keys = [k for k, _, _ in slots_of[r]]
            for k, value in zip(keys, packing.unpack(table[r], [shapes[k] for k in keys])):
                out[k] = value
        return out

    def save_own_variables(self, store):
        # Own counters by position (Keras's layout), then every sharded slot, accumulator
        # and EMA copy consolidated; the wrapped optimizer saves its own counters itself.
        for i, variable in enumerate(_tf_private.optimizer_own_variables(self)):
            store[str(i)] = variable.numpy()
        for k, value in enumerate(self._consolidated_slots() if self.built else []):
            store[f"slot_{k}"] = value

    def load_own_variables(self, store):
        own = [k for k in store.keys() if not str(k).startswith("slot_")]
        slots = [k for k in store.keys() if str(k).startswith("slot_")]
        expected = len(self._book.slots) if self.built else 0
        counters = _tf_private.optimizer_own_variables(self)
        if len(own) != len(counters) or len(slots) != expected:
            raise ValueError(
                f"Cannot load optimizer state into {self.name}: the file has {len(own)} "
                f"variables and {len(slots)} slots, this optimizer {len(counters)} and "
                f"{expected}. Build it on the same model, with the same wrapped optimizer "
                "settings (gradient_accumulation_steps, use_ema), first.")
        for i, variable in enumerate(counters):
            variable.assign(store[str(i)])
        for k, (slot, index) in enumerate(self._book.slots):
            if _is_stand_in(slot):
                continue  # owned by another worker, which loads it itself
            slot.value.assign(np.asarray(store[f"slot_{k}"]))


def variable_bytes_per_device(variables, strategy=None) -> list[int]:
    """Bytes of ``variables`` on each local replica's device.

    Mirrored variables count on every device; single-device variables (ShardedOptimizer's
    slots, accumulators and EMA copies) on theirs only. Without a tfdp strategy and with one
    replica, everything counts on the one device.
    """
    strategy = strategy or tf.distribute.get_strategy()
    values = [getattr(v, "value", v) for v in variables]
    if not is_data_parallel(strategy) and strategy.num_replicas_in_sync == 1:
        return [sum(v.shape.num_elements() * v.dtype.size for v in values)]
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    keys = [(d.device_type, d.device_index) for d in devices]
    totals = [0] * len(devices)
    for value in values:
        for component in strategy.experimental_local_results(value):
            spec = tf.DeviceSpec.from_string(component.device)
            key = (spec.device_type, spec.device_index)
            if key in keys:
                totals[keys.index(key)] += component.shape.num_elements() * component.dtype.size
    return totals


def optimizer_state_bytes_per_replica(optimizer, strategy=None) -> list[int]:
    """Bytes of optimizer state on each local replica's device, for any Keras optimizer:
    the bytes of ``optimizer.variables`` (which, for a ShardedOptimizer, lists the sharded
    state on its owners' devices)."""
    return variable_bytes_per_device(optimizer.variables, strategy)


# --- LossScaleOptimizer around a ShardedOptimizer ---------------------------------------------

def install_loss_scale_saving_hooks(sharded_class):
    """Makes ``LossScaleOptimizer(ShardedOptimizer(...))`` save only its own variables.

    Keras's LossScaleOptimizer stores ``self.variables`` by position, and that includes every
    variable of the wrapped optimizer, which Keras saving stores again under the wrapped
    optimizer. For a ShardedOptimizer those are the per-device pieces, and with several
    workers which pieces a process holds depends on the topology, so the file would not
    restore on another worker count. The ShardedOptimizer saves its state consolidated
    itself; the LossScaleOptimizer keeps its loss scale and step counter. A file written
    with the positional layout still loads (its first entries are the LossScaleOptimizer's).
    Other LossScaleOptimizers are untouched. No public hook serves: the class is Keras's.
    Idempotent (``_tf_private``'s registry patches once); ``keras_integration.uninstall``
    removes them.
    """
    def make_save(original_save):
        def save_own_variables(self, store):
            if not isinstance(self.inner_optimizer, sharded_class):
                return original_save(self, store)
            for i, variable in enumerate(_tf_private.optimizer_own_variables(self)):
                store[str(i)] = variable.numpy()
        return save_own_variables

    def make_load(original_load):
        def load_own_variables(self, store):
            if not isinstance(self.inner_optimizer, sharded_class):
                return original_load(self, store)
            own = _tf_private.optimizer_own_variables(self)
            if len(store.keys()) < len(own):
                raise ValueError(
                    f"Cannot load {self.name}: the file has {len(store.keys())} variables, "
                    f"it needs its {len(own)} own. Build it on the same model first.")
            for i, variable in enumerate(own):
                variable.assign(store[str(i)])
        return load_own_variables

    _tf_private.patch_loss_scale_saving(make_save, make_load)
