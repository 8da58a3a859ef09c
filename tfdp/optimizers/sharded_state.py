"""ShardedOptimizer's state outside the step: where the wrapped optimizer's state lives,
consolidated checkpoints, memory accounting, and LossScaleOptimizer saving around it (see
sharded.py's docstring, "Optimizer state" and "State consolidation").

Rules. A state variable the wrapped optimizer creates while it builds belongs to model
variable i when it is made by ``add_variable_from_reference(variable_i)`` (placed on the
owner's device as it is created) or when it sits at position i of one of the optimizer's lists
indexed like the variables (made with ``add_variable``, any shape: Adafactor's factored
moments; created on every replica, then moved to the owner's device). Anything else it
creates is shared by all variables and stays on every replica. A sharded slot, accumulator or
EMA copy is saved as one full array gathered from its owner, whatever its shape, so files do
not depend on the replica or worker count.

Saving on several workers (``check_every_worker_saves``). That gather is a collective: every
worker must save (tfdp writes only the chief's file at the script's path). Before it, each
worker posts its arrival in the coordination service's key-value store, and the chief waits at
most ``save_wait_seconds`` for the others': a chief that saves alone (Horovod's ``if
hvd.rank() == 0: model.save(...)``) fails then, without having entered the collective, with an
error naming the fix, instead of waiting in the gather forever.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import tensorflow as tf
import keras

from tfdp import _tf_private
from tfdp.optimizers import packing
from tfdp.strategy import is_data_parallel, replica_ops

__all__ = ["StatePlacement", "ConsolidatedState", "variable_bytes_per_device",
           "optimizer_state_bytes_per_replica", "install_loss_scale_saving_hooks",
           "save_wait_seconds", "check_every_worker_saves", "SAVE_WAIT_ENV", "is_stand_in"]

# Seconds the chief waits at a save for the other workers to reach it (a number > 0); the
# default is save_wait_seconds's.
SAVE_WAIT_ENV = "TFDP_SAVE_WAIT_SECONDS"
# Workers that all save arrive at the gather apart by what they did differently since their
# last common step: callbacks' and Keras's writing of the layers, which happen first (to the
# script's path on the chief, to a local temporary directory on the others), at no less than
# a slow disk's rate. The base covers the rest: 10 s was measured too short (a worker on a
# loaded 2-core host reached a legitimate save more than 10 s after the chief).
_SAVE_WAIT_BASE_SECONDS = 60.0
_SAVE_WAIT_BYTES_PER_SECOND = 50e6
_SAVE_KEY = "tfdp/sharded-save"
_saves = itertools.count()  # this process's consolidations, in order: the same on every worker


def is_stand_in(variable) -> bool:
    """An empty placeholder for state that another worker's replica owns.

    The Keras wrapper reports the shape it was asked for; the placeholder's own (the
    TensorFlow variable's) is (0,).
    """
    return tuple(getattr(variable, "value", variable).shape) == (0,)


class StatePlacement:
    """Builds the wrapped optimizer with its per-variable state on the owners' devices, and
    sorts what it built into sharded slots and shared variables (the module's rules).

    ``owners[i]`` is model variable i's replica; ``strategy`` None means one device and no
    placement; ``first_local`` is the global id of this worker's first replica.
    """

    def __init__(self, sharded, var_list, owners, strategy, local_devices, first_local):
        self._sharded = sharded
        self._keys = {_tf_private.variable_key(sharded, v): i for i, v in enumerate(var_list)}
        self._num_variables = len(var_list)
        self._owners = owners
        self._strategy = strategy
        self._local_devices = local_devices
        self._first_local = first_local
        self._building_for = []   # the reference variable of the slot being created, if any
        self._slot_owner = {}     # id(tf.Variable) -> model variable index, for sharded state
        self._created = set()     # id(tf.Variable) of everything else created while building
        self._local = set()       # id(tf.Variable) of "local" accumulators (full, on every replica)

    def _on_owner(self, kwargs, index, dtype):
        """Variable-creator arguments that put state of variable ``index`` on its owner."""
        if self._strategy is None:
            return kwargs  # one device: the state goes wherever the optimizer puts it
        local = self._owners[index] - self._first_local
        if 0 <= local < len(self._local_devices):
            kwargs["colocate_with"] = _tf_private.SingleDevice(self._local_devices[local])
        else:
            # Owned by another worker: an empty stand-in keeps the wrapped optimizer's
            # lists aligned with the variables; this worker never updates it.
            kwargs["initial_value"] = tf.zeros([0], dtype=dtype)
            kwargs["shape"] = tf.TensorShape([0])
            kwargs["colocate_with"] = _tf_private.SingleDevice(self._local_devices[0])
        return kwargs

    def _place(self, next_creator, **kwargs):
        reference = self._building_for[-1] if self._building_for else None
        index = (self._keys.get(_tf_private.variable_key(self._sharded, reference))
                 if reference is not None else None)
        if index is None:
            variable = next_creator(**kwargs)
            self._created.add(id(variable))
            return variable
        dtype = kwargs.get("dtype") or tf.as_dtype(reference.dtype)
        variable = next_creator(**self._on_owner(kwargs, index, dtype))
        self._slot_owner[id(variable)] = index
        return variable

    def build(self, inner, var_list, local_accumulators):
        """``inner.build(var_list)``, noting the model variable each reference slot is for."""
        add_from_reference = inner.add_variable_from_reference

        def tracking_add(reference_variable, name=None, *args, **kwargs):
            if local_accumulators and name == "gradient_accumulator":
                # A full copy on every replica (mirrored; each replica writes its own).
                variable = add_from_reference(reference_variable, name, *args, **kwargs)
                self._local.add(id(variable.value))
                return variable
            self._building_for.append(reference_variable)
            try:
                return add_from_reference(reference_variable, name, *args, **kwargs)
            finally:
                self._building_for.pop()

        inner.add_variable_from_reference = tracking_add
        try:
            with tf.variable_creator_scope(self._place):
                inner.build(var_list)
        finally:
            del inner.add_variable_from_reference

    def _positions(self, inner) -> dict:
        """id(Keras variable) -> model variable index, for state the optimizer made without a
        reference and keeps at that position of a list indexed like the variables."""
        positions = {}
        for items in _tf_private.optimizer_state_lists(inner).values():
            if len(items) != self._num_variables:
                continue
            for index, item in enumerate(items):
                if isinstance(item, keras.Variable) and id(item.value) in self._created:
                    positions.setdefault(id(item), index)
        return positions

    def move_to_owner(self, variable, index):
        """Moves state made on every replica to its owner's device: the same Keras variable
        (the optimizer's lists keep it), new storage holding the same value."""
        if self._strategy is None:
            return
        current = variable.value
        value = tf.convert_to_tensor(current)  # identical on every replica at build
        placed = self._on_owner({}, index, current.dtype)

        def creator(next_creator, **kwargs):
            kwargs.update(placed)
            return next_creator(**kwargs)

        with tf.variable_creator_scope(creator):
            storage = tf.Variable(value, trainable=False, dtype=current.dtype,
                                  name=current.name.split(":")[0])
        _tf_private.replace_variable_storage(variable, storage)
        self._slot_owner[id(storage)] = index

    def sort(self, inner):
        """(slots, kept): the sharded state as ``[(Keras variable, model variable index)]`` and
        the shared variables the wrapped optimizer keeps saving itself, in creation order.
        Refuses state that belongs to no variable unless the optimizer advances it once per
        update (Keras's Nadam)."""
        positions = self._positions(inner)
        slots, kept, unowned = [], [], []
        for variable in _tf_private.optimizer_own_variables(inner):
            storage = id(variable.value)
            index = self._slot_owner.get(storage)
            if index is None and storage in self._created and storage not in self._local:
                index = positions.get(id(variable))
                if index is None:
                    unowned.append(variable)
                else:
                    self.move_to_owner(variable, index)
            if index is None:
                kept.append(variable)
            else:
                slots.append((variable, index))
        if unowned and not _tf_private.advances_shared_state(inner):
            name = type(inner).__name__
            raise ValueError(
                f"ShardedOptimizer cannot shard {name}: its build() creates state that belongs "
                f"to no model variable ({', '.join(v.path for v in unowned)}): made neither by "
                "add_variable_from_reference(variable) nor kept in a list indexed like the "
                "variables (Keras's convention), so no replica can be told to keep and update "
                f"it. Keep per-variable state in such lists, or use {name} unsharded (compile "
                "with it directly).")
        return slots, kept


def save_wait_seconds(model_bytes: int, environ=None) -> float:
    """How long the chief waits at a save for the other workers; pure.

    ``TFDP_SAVE_WAIT_SECONDS`` when set, else 60 s plus the time to write ``model_bytes`` (the
    layers, written before the optimizer) at 50 MB/s.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(SAVE_WAIT_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{SAVE_WAIT_ENV}={text!r} must be a number of seconds > 0.")
        return value
    return round(_SAVE_WAIT_BASE_SECONDS + model_bytes / _SAVE_WAIT_BYTES_PER_SECOND, 1)


def check_every_worker_saves(cluster, wait_seconds: float) -> None:
    """Returns when every worker has reached this save (the chief waits at most
    ``wait_seconds``; the others post their arrival and return); see the module docstring.

    Raises:
        RuntimeError (on the chief): some worker did not arrive; the message names the fix.
    """
    if not _tf_private.coordination_service_configured():
        return  # no job-wide service: nothing to ask (not a tfdp-run / TF_CONFIG job)
    key = f"{_SAVE_KEY}/{next(_saves)}"
    _tf_private.publish_to_coordination_service(f"{key}/{cluster.rank}", "1")
    if cluster.rank != 0:
        return  # the chief decides; a worker that saves while the chief does not is unheard of
    deadline = time.monotonic() + wait_seconds
    missing = []
    for rank in range(1, cluster.num_workers):
        try:
            _tf_private.read_from_coordination_service(
                f"{key}/{rank}", max(0.001, deadline - time.monotonic()))
        except tf.errors.OpError:
            missing.append(rank)
    if missing:
        workers = ", ".join(map(str, missing))
        raise RuntimeError(
            f"ShardedOptimizer: saving gathers the optimizer state, which is sharded across "
            f"the {cluster.num_workers} workers, from every worker, but worker(s) {workers} "
            f"did not reach this save within {wait_seconds:g} s. Call model.save / "
            "save_weights (and add ModelCheckpoint) on every worker, not only on the chief: "
            "drop the `if is_chief(...)` / `if hvd.rank() == 0` around the save. tfdp writes "
            "the file only on the chief, at its path; the other workers write to a temporary "
            "directory that is removed. If every worker does save and some reach the save "
            f"later than that, set {SAVE_WAIT_ENV} above {wait_seconds:g}.")


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
        """Every slot from its owner, one all-gather per dtype; rows packed by element count
        with each slot's own shape (a factored moment is not its variable's shape)."""
        strategy = _tf_private.optimizer_strategy(self)
        model_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                          for v in self._book.model_variables)
        check_every_worker_saves(strategy.cluster, save_wait_seconds(model_bytes))
        slots = self._book.slots
        shapes = [tuple(v.shape) for v, _ in slots]  # the Keras shape, stand-ins included
        out = [None] * len(slots)
        for dtype in sorted({tf.as_dtype(v.dtype) for v, _ in slots}, key=lambda d: d.name):
            slots_of = {r: [k for k, (v, i) in enumerate(slots)
                            if self._owners[i] == r and tf.as_dtype(v.dtype) == dtype]
                        for r in range(self._num_replicas)}
            width = packing.row_width([[int(np.prod(shapes[k])) for k in slots_of[r]]
                                       for r in range(self._num_replicas)])

            @tf.function(autograph=False)  # no tensor branches (agreement.py says why)
            def gather(slots_of=slots_of, width=width, dtype=dtype):
                def fn():
                    me = replica_ops.global_replica_id(strategy)
                    local = packing.pack([slots[k][0].value for k in slots_of[me]], width, dtype)
                    return replica_ops.all_gather(local[tf.newaxis], axis=0)
                return strategy.run(fn)

            table = strategy.experimental_local_results(gather())[0].numpy()
            for r in range(self._num_replicas):
                keys = slots_of[r]
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
            if is_stand_in(slot):
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
