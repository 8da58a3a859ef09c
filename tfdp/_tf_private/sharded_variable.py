"""The variable behind ``DataParallelStrategy(shard_parameters=True)`` (ZeRO stage 3).

A ``ShardedVariable`` is a ``MirroredVariable`` whose per-replica components are not copies:
component r holds the flat slice r of the tensor (tfdp/strategy/zero3/layout.py states the
layout and the rule of each read). Everything TensorFlow's machinery does with a mirrored
variable per replica (its handle in a replica, ``extended.update`` handing the optimizer the
local component, tf.function capturing each component) then works on shards unchanged; what
differs is what a *read* of the whole variable means, so only the reads, the cross-replica
assignments and the checkpoint hooks are overridden, and each delegates to a policy object
(``spec``) that tfdp's strategy package supplies.

Why private: tf.distribute has no public way to define a distributed variable, nor to make a
strategy's ``scope()`` create one; ``MirroredVariable``, ``create_mirrored_variable`` and the
replica-id lookup are the machinery ``MirroredStrategy`` itself uses. Pinned by
tests/test_tf_private.py and tests/test_zero3.py.
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import values as _values
from tensorflow.python.distribute import values_util as _values_util

from tfdp._tf_private.core import require_attributes

# Why: the methods of MirroredVariable that ShardedVariable replaces; a TensorFlow that
# renames one would silently bypass the sharded read, so their presence is checked here.
SHARDED_VARIABLE_HOOKS = ("_dense_var_to_tensor", "value", "read_value", "numpy",
                          "_get_cross_replica", "_get_replica", "_serialize_to_tensors",
                          "_restore_from_tensors", "_gather_saveables_for_checkpoint")
require_attributes(_values.MirroredVariable, SHARDED_VARIABLE_HOOKS,
                   "tfdp's sharded parameters (shard_parameters=True)")
require_attributes(_distribute_utils, ("create_mirrored_variable",),
                   "creating tfdp's sharded parameters")
require_attributes(_values_util, ("get_current_replica_id_as_int",),
                   "reading a sharded parameter in a replica")


def current_replica_id():
    """This replica's local index as a Python int, or None in a cross-replica context.

    Why: the public ReplicaContext's ``replica_id_in_sync_group`` is a tensor in tf.function
    and counts every worker's replicas; a component is picked by local index, as
    DistributedVariable itself does.
    """
    return _values_util.get_current_replica_id_as_int()


def in_keras_symbolic_scope() -> bool:
    """True while Keras traces a model on symbolic inputs to learn output shapes
    (``compute_output_spec``, the symbolic build of ``fit``); values read there are never used.

    Why: no public API tells Keras's shape inference from a real computation, and with several
    workers a sharded variable's whole value needs a collective that shape inference must
    not launch.
    """
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return bool(in_symbolic_scope())


def in_update_context() -> bool:
    """True inside ``extended.update``'s per-device function in a cross-replica context."""
    return _distribute_lib.get_update_replica_id() is not None


_reads = threading.local()


class reading_slices(object):  # a context manager
    """Inside it, a sharded parameter read in a replica is that replica's slice, not the
    gathered tensor: the optimizer's step (Keras's EMA update reads the model variables)."""

    def __enter__(self):
        self._outer = getattr(_reads, "slices", False)
        _reads.slices = True

    def __exit__(self, *exc):
        _reads.slices = self._outer


class ShardedVariable(_values.MirroredVariable):
    """A mirrored variable whose components hold slices; ``spec`` says what a read is.

    ``spec`` provides ``shape`` (the whole tensor's), ``read_in_replica(component)`` (a
    parameter: all-gathered with a reduce-scatter gradient; optimizer state: the slice),
    ``read_whole(components)`` (the whole tensor, from every replica), and
    ``slices_of(value)`` (one slice per local component, for assignment).
    """

    def __init__(self, strategy, values, aggregation, spec):
        self._tfdp_spec = spec
        super().__init__(strategy, values, aggregation)

    # --- what the variable is --------------------------------------------------------------
    @property
    def tfdp_spec(self):
        return self._tfdp_spec

    @property
    def shape(self):
        return self._tfdp_spec.shape

    def get_shape(self):
        return self._tfdp_spec.shape

    @property
    def components(self):
        return tuple(self._values)

    def _replica_id(self):
        """This replica's index in a replica context of the variable's strategy, else None
        (outside any scope the default replica context is not one of its replicas)."""
        with _distribute_lib.enter_or_assert_strategy(self._distribute_strategy):
            return current_replica_id()

    # --- reads -------------------------------------------------------------------------------
    def _read(self):
        if _values_util.is_saving_non_distributed():
            return self._tfdp_spec.read_whole(self._values)
        replica_id = self._replica_id()
        if replica_id is None:
            return self._tfdp_spec.read_whole(self._values)
        component = self._get_replica(replica_id)
        if getattr(_reads, "slices", False):
            return component.value()
        return self._tfdp_spec.read_in_replica(component)

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        value = self._read()
        if dtype is not None and dtype != value.dtype:
            value = tf.cast(value, dtype)
        return value

    def value(self):
        return self._read()

    def read_value(self):
        return tf.identity(self._read())

    def _get_cross_replica(self):
        return self._tfdp_spec.read_whole(self._values)

    def numpy(self):
        return self._tfdp_spec.read_whole(self._values).numpy()

    def __array__(self, dtype=None):
        # Keras's saving converts variables with np.asarray; the delegate would give a slice.
        return np.asarray(self.numpy(), dtype=dtype)

    # --- writes of the whole tensor (set_weights, loading, restoring) --------------------------
    def _assign_whole(self, method, value, read_value):
        for component, piece in zip(self._values, self._tfdp_spec.slices_of(value)):
            getattr(component, method)(piece, read_value=False)
        return self if read_value else None

    def _in_replica(self, value):
        """A whole-shaped value assigned in a replica (Keras resetting its gradient
        accumulators with zeros of the variable's shape) means this replica's slice of it."""
        replica_id = self._replica_id()
        value = tf.convert_to_tensor(value)
        if (replica_id is not None and value.shape.is_fully_defined()
                and value.shape == self._tfdp_spec.shape
                and value.shape != self._values[replica_id].shape):
            value = self._tfdp_spec.slices_of(value)[replica_id]
        return value

    def assign(self, value, use_locking=False, name=None, read_value=True):
        if self._replica_id() is None and not in_update_context():
            return self._assign_whole("assign", value, read_value)
        return super().assign(self._in_replica(value), use_locking, name, read_value)

    def assign_add(self, value, use_locking=False, name=None, read_value=True):
        if self._replica_id() is None and not in_update_context():
            return self._assign_whole("assign_add", value, read_value)
        return super().assign_add(self._in_replica(value), use_locking, name, read_value)

    def assign_sub(self, value, use_locking=False, name=None, read_value=True):
        if self._replica_id() is None and not in_update_context():
            return self._assign_whole("assign_sub", value, read_value)
        return super().assign_sub(self._in_replica(value), use_locking, name, read_value)

    # --- checkpoints: the whole tensor, so a checkpoint restores on any replica count --------
    def _gather_saveables_for_checkpoint(self):
        return {}  # not the legacy saveable path: _serialize_to_tensors below

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._tfdp_spec.read_whole(self._values)}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors["VARIABLE_VALUE"]
        return self._assign_whole("assign", value, read_value=False) or tf.no_op()


def create_sharded_variable(strategy, make_components, spec, **kwargs):
    """A ``ShardedVariable`` from ``make_components(**kwargs) -> [component variables]``.

    Why: ``create_mirrored_variable`` is what MirroredStrategy's scope uses to turn per-device
    variables into one distributed variable (collections, synchronization checks, no tape
    recording); only the class differs.
    """
    def make(strategy_, values, aggregation, var_policy=None):
        return ShardedVariable(strategy_, values, aggregation, spec)

    classes = {tf.VariableSynchronization.ON_WRITE: make, tf.VariableSynchronization.ON_READ: make,
               "VariableClass": make, "LazyVariableClass": make}
    return _distribute_utils.create_mirrored_variable(strategy, make_components, classes, {},
                                                      **kwargs)


def broadcast_initial_value(extended, device, **kwargs):
    """A function computing ``kwargs["initial_value"]`` on ``device``, with several workers
    broadcast from the chief so every worker slices the same tensor.

    Why: CollectiveAllReduceExtended's ``_get_variable_creator_initial_value`` for the first
    local replica is exactly that (the broadcast MultiWorkerMirroredStrategy gives every
    mirrored variable); no public API broadcasts a value at variable creation.
    """
    return extended._get_variable_creator_initial_value(
        replica_id=0, device=device, primary_var=None, **kwargs)


def is_sharded_variable(variable) -> bool:
    """True for a ShardedVariable, a Keras variable over one, or one of its components."""
    return sharded_container(variable) is not None


def sharded_container(variable):
    """The ShardedVariable ``variable`` is a component of (or is), else None.

    Why: ``extended.update`` hands the optimizer a component; TensorFlow records the container
    on the component's handle (``_distributed_container``) and Keras's ``_var_key`` reads it
    the same way.
    """
    if isinstance(variable, ShardedVariable):
        return variable
    # Why ``_value``: a Keras variable's ``value`` is cast to the compute dtype inside a
    # mixed-precision layer's call (Keras's autocast scope), a new tensor; its storage, the
    # ShardedVariable, is only in ``_value`` (no public getter).
    for value in (getattr(variable, "_value", None), getattr(variable, "value", None)):
        if isinstance(value, ShardedVariable):
            return value
    if not isinstance(variable, tf.Variable) or isinstance(variable, _values.DistributedValues):
        return None
    for holder in (variable, getattr(variable, "handle", None)):
        ref = getattr(holder, "_distributed_container", None)
        if ref is not None:
            container = ref()
            if isinstance(container, ShardedVariable):
                return container
    return None


# --- Units: where gathered parameters live (strategy/zero3/units.py) --------------------------

def patch_keras_layer_call(make) -> None:
    """Class patch of ``keras.layers.Layer.__call__``: ``make(original) -> replacement``.

    Why: with ``shard_parameters=True`` a unit (a layer with sharded weights) runs under a
    custom gradient that gathers its parameters again in the backward pass instead of keeping
    them from the forward pass; every layer call goes through ``Layer.__call__`` and Keras has
    no public hook around it.
    """
    from keras.src.layers.layer import Layer

    from tfdp._tf_private.core import patch_attribute

    patch_attribute(Layer, "__call__", make, "gathering sharded parameters per unit")


def own_trainable_variables(layer) -> list:
    """The trainable variables a layer created itself, not its sublayers'.

    Why: ``trainable_weights`` includes every sublayer's; a unit is the layer that owns the
    weights, and Keras keeps a layer's own in ``_trainable_variables`` (no public getter).
    """
    from tfdp._tf_private.core import get_private

    return list(get_private(layer, "_trainable_variables", "a layer's own weights"))


def in_keras_stateless_scope() -> bool:
    """True inside a ``keras.StatelessScope`` (tfdp's XLA step maps variables to values).
    Why: Keras exports the scope but not the test of being in one."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return bool(in_stateless_scope())
