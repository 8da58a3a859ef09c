"""TensorFlow's gradient functions: which lookup each row of a sparse gradient comes from.

tfdp reduces a ``tf.IndexedSlices`` gradient as one device would have built it
(tfdp/strategy/sparse_gradients.py), and that depends on the lookups behind its rows: one row
per id of each lookup, in the lookups' order. No public API says which lookups a gradient's
rows come from; the graph that TensorFlow's registered gradient functions build does.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["lookup_ids", "GATHER_GRADIENT_OPS"]

# Why: TensorFlow 2.21 builds an axis-0 gather's gradient (``_GatherV2Grad`` in
# tensorflow/python/ops/array_grad.py, ``_GatherGrad`` for ResourceGather) as
# ``IndexedSlices(reshape(grad, [size(ids), ...]), reshape(ids, [size(ids)]))``: the indices are a
# ``Reshape`` whose first input is the lookup's ids, with their shape. Where a table is looked up
# several times, the tape (``backprop_util.AggregateIndexedSlicesGradients``) concatenates the
# pieces' indices and values in one order (``ConcatV2`` on axis 0), first casting int32 indices
# to int64 (``Cast``) when the pieces' dtypes differ. Keras's own steps between the tape and
# the optimizer (casts, loss-scale division) keep the indices tensor as it is. Anything else
# (an eager tensor, another op) is "not known": the caller falls back to TensorFlow's own
# reduction. tests/test_tf_private.py pins the structure.
GATHER_GRADIENT_OPS = {"reshape": "Reshape", "aggregate": "ConcatV2", "widen": "Cast",
                       "pass": "Identity"}


def lookup_ids(slices, max_depth: int = 16):
    """The ids tensor of each lookup whose rows ``slices`` (a ``tf.IndexedSlices`` traced in
    a graph) holds, in row order: piece k is ``tf.size(ids[k])`` rows. None where the indices
    were not built by TensorFlow's gather gradient and aggregation as described above."""
    return _pieces(slices.indices, max_depth)


def _pieces(indices, depth):
    if depth <= 0 or not hasattr(indices, "op") or tf.executing_eagerly():
        return None
    try:
        op = indices.op
    except AttributeError:  # an eager tensor
        return None
    kind = op.type
    if kind == GATHER_GRADIENT_OPS["reshape"]:
        ids = op.inputs[0]
        if not ids.dtype.is_integer:
            return None
        return [ids]
    if kind in (GATHER_GRADIENT_OPS["widen"], GATHER_GRADIENT_OPS["pass"]):
        return _pieces(op.inputs[0], depth - 1)
    if kind == GATHER_GRADIENT_OPS["aggregate"]:
        axis = tf.get_static_value(op.inputs[-1])
        if axis is None or int(axis) != 0:
            return None
        pieces = []
        for part in op.inputs[:-1]:
            found = _pieces(part, depth - 1)
            if found is None:
                return None
            pieces += found
        return pieces
    return None
