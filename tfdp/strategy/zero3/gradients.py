"""ZeRO-3's gather and its gradient: what a replica's read of a sharded parameter runs.

Rule. A replica's read of a sharded parameter is the whole tensor, all-gathered from every
replica's slice; its gradient is this replica's slice of the sum over replicas of the whole
tensor's gradient: a dense gradient reduce-scattered, so each replica's gradient for its slice
is already the global-batch gradient (with Keras's per-replica loss scaling); a sparse one
(``tf.IndexedSlices``: an Embedding's looked-up rows) is not made dense. One device's
optimizers use its rows as they come (Adam squares each row before rows at one index are
added; ``clipnorm`` and ``global_clipnorm`` take the norm of the rows), so the replicas' rows
are reduced as unsharded tfdp reduces them (sparse_gradients.py: per-example lookups' rows
concatenated in replica order, a lookup shared by the batch summed position by position) and
this replica keeps its elements of them: a ``tf.IndexedSlices`` of the 1-D slice with one entry
per element of every row, rows at one index not added (``slice_of_sparse_gradient``), which
Keras's optimizer scatters into the slice. Every replica holds the reduced rows while it cuts
them (what unsharded tfdp holds); the slice's gradient, what stays until the update, holds the
elements of the rows that reach into the slice (about 1/N of them where ids spread over the
table; every row of a frequent id, such as padding, is its owner's).

``spec`` below is a layout.ShardSpec (duck typed: this module imports no layout).
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import replica_ops, sparse_gradients, wire

__all__ = ["gather_slice", "slice_gradient", "slice_of_gradient", "slice_of_sparse_gradient"]


def gather_slice(shard, spec):
    """The whole parameter ``spec`` describes, all-gathered from this replica's ``shard``
    (a tensor); its gradient is this replica's slice of the sum over replicas (the
    reduce-scatter). What a read in a replica runs, and what a unit compiled by XLA gathers
    outside its program (units.py).

    Args:
        shard: this replica's slice, a 1-D tensor of ``spec.shard_size`` elements.
        spec: the variable's layout.ShardSpec.
    """

    @tf.custom_gradient
    def gather(x):
        whole = spec.whole_from_flat(replica_ops.all_gather(x))

        def grad(dy):
            return slice_of_gradient(dy, spec)

        return whole, grad

    return gather(shard)


def slice_of_gradient(whole_gradient, spec):
    """This replica's slice of the sum over replicas of ``whole_gradient`` (a gradient of the
    whole tensor): a dense one reduce-scattered, a sparse one (``tf.IndexedSlices``) in one
    device's form (``slice_of_sparse_gradient``).

    Args:
        whole_gradient: a tensor of the whole shape, or a ``tf.IndexedSlices`` of its rows.
        spec: the variable's layout.ShardSpec.
    """
    if isinstance(whole_gradient, tf.IndexedSlices):
        return slice_of_sparse_gradient(whole_gradient, spec)
    flat = spec.flat_padded(tf.convert_to_tensor(whole_gradient))
    return replica_ops.reduce_scatter(tf.reshape(flat, [spec.num_shards, spec.shard_size]))


def slice_of_sparse_gradient(slices, spec):
    """This replica's slice of a sparse gradient (an Embedding's rows) as one device has it.

    The replicas' rows are reduced as unsharded tfdp reduces them
    (sparse_gradients.reduce_indexed_slices), then cut at element level: each row's elements
    of this replica's slice, one entry per element of every row, duplicates kept
    (sparse_gradients.elements_in_range).

    Args:
        slices: this replica's ``tf.IndexedSlices`` of the whole tensor's rows.
        spec: the variable's layout.ShardSpec.
    """
    strategy = spec.strategy
    rows = sparse_gradients.reduce_indexed_slices([slices], strategy,
                                                  wire.collective_options(strategy))[0]
    width = spec.num_elements // max(1, int(spec.shape[0])) if spec.shape.rank else 1
    start = replica_ops.global_replica_id(strategy) * spec.shard_size
    part = sparse_gradients.elements_in_range(rows, width, start, spec.shard_size)
    return tf.IndexedSlices(tf.cast(part.values, spec.dtype), part.indices, part.dense_shape)


def slice_gradient(variable, whole_gradient):
    """This replica's slice of the sum over replicas of ``whole_gradient`` (a gradient taken
    with respect to the gathered tensor, as tfdp's XLA step does): what a replica's read
    would have run in the backward pass (a sparse gradient kept sparse, in one device's form).

    Args:
        variable: a sharded variable (Keras's or TensorFlow's).
        whole_gradient: its whole tensor's gradient in this replica.
    """
    spec = _tf_private.sharded_container(getattr(variable, "value", variable)).tfdp_spec
    return slice_of_gradient(whole_gradient, spec)
