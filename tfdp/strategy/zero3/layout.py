"""ZeRO-3's layout of one sharded variable: its whole shape, its partition, and what a read is.

Rule. A ``ShardSpec`` is made once per sharded variable, when it is created
(parameters.create), and never changes but for its whole-read id (several workers: set once
the variable exists). What a read of the variable means depends on where it is made:

* inside a replica, a ``Kind.PARAMETER`` read is the whole tensor, gathered
  (gradients.gather_slice; inside a unit from the slice the unit passes in,
  ``reading_given_slices``); a ``Kind.STATE`` read (the optimizer's update) is the slice;
* outside any replica (``get_weights``, ``model.save``, checkpoints, ``numpy()``) a read is the
  whole tensor: concatenated where this process holds every slice, else gathered from every
  worker by the spec's ``whole_gather`` (a collective every worker takes part in,
  whole_reads.py); assigning a whole tensor gives each local replica its slice.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy.zero3 import gradients
from tfdp.strategy.zero3.partition import Kind, Partition

__all__ = ["ShardSpec", "is_sharded", "reading_given_slices"]


def is_sharded(variable) -> bool:
    """True for a sharded parameter or state variable (Keras's, TensorFlow's or a slice)."""
    return _tf_private.is_sharded_variable(variable)


@dataclasses.dataclass(eq=False)
class ShardSpec:
    """One sharded variable: its whole shape, the partition, and what a read means.

    Attributes:
        shape: the whole tensor's shape (fully defined).
        dtype: its dtype.
        partition: where its elements live (partition.Partition).
        kind: ``Kind.PARAMETER`` (a replica's read gathers) or ``Kind.STATE`` (a replica's read
            is its slice).
        strategy: the strategy that created it.
        whole_gather: ``(components, spec) -> whole tensor``: the collective that reads it
            whole from every worker's slices (parameters.WholeGather; used only when this
            process does not hold every slice).
        name: the variable's name, for errors.
        read_id: its id for whole reads on several workers (whole_reads.py; "" otherwise).
    """

    shape: tf.TensorShape
    dtype: tf.DType
    partition: Partition
    kind: Kind
    strategy: object
    whole_gather: Callable
    name: str = ""
    read_id: str = ""

    # The partition's numbers, read through the layout (what every caller holds).
    num_elements = property(lambda self: self.partition.num_elements)
    num_shards = property(lambda self: self.partition.num_shards)
    first_shard = property(lambda self: self.partition.first_shard)
    shard_size = property(lambda self: self.partition.shard_size)
    pad = property(lambda self: self.partition.pad)

    # --- slices of a whole tensor (creation, assignment) ------------------------------------
    def flat_padded(self, value):
        """``value`` flattened and padded with zeros to R slices."""
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
        start, stop = self.partition.bounds(local_index)
        return tf.raw_ops.DeepCopy(x=flat_padded[start:stop])

    def slices_of(self, value):
        """One slice of the whole ``value`` per local replica."""
        value = tf.convert_to_tensor(value)
        if value.shape.num_elements() != self.num_elements:
            raise ValueError(f"Cannot assign a value of shape {value.shape} to a sharded "
                             f"variable of shape {self.shape}.")
        flat = self.flat_padded(value)
        return [self.slice_of(flat, i) for i in range(self.partition.local_shards)]

    def whole_from_flat(self, flat):
        """The whole tensor from the padded flat one."""
        if self.pad:
            flat = flat[:self.num_elements]
        return tf.reshape(flat, self.shape)

    # --- reads ------------------------------------------------------------------------------
    def read_in_replica(self, component):
        """A replica's read: its slice (state), or the whole tensor gathered (a parameter)."""
        if self.kind is not Kind.PARAMETER:
            return component.value()
        given = getattr(_given_slices, "slices", {}).get(id(self))
        shard = component.value() if given is None else given
        return gradients.gather_slice(shard, self)

    def read_whole(self, components):
        """A read outside any replica: the whole tensor."""
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
        return self.whole_gather(components, self)


_given_slices = threading.local()


class reading_given_slices(object):  # a context manager
    """Inside it, a replica's read of the sharded parameters in ``slices`` (``{spec: slice
    tensor}``) gathers the given tensor instead of reading the variable: a unit passes its
    slices to its custom gradient as inputs (units.py).

    Args:
        slices: ``{ShardSpec: this replica's slice tensor}``.
    """

    def __init__(self, slices):
        self._slices = {id(spec): value for spec, value in slices.items()}

    def __enter__(self):
        self._outer = getattr(_given_slices, "slices", {})
        _given_slices.slices = dict(self._outer)
        _given_slices.slices.update(self._slices)

    def __exit__(self, *exc):
        _given_slices.slices = self._outer
