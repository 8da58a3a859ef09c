"""The gradient all-reduce: buckets launched in the order backprop produces them, and paced.

Rule: gradients are summed over all replicas in buckets (tfdp/strategy/buckets.py), one
collective each, launched last layers first and each as soon as backprop has finished its
layers, so that the exchange overlaps the rest of backprop. ``all_reduce`` is the plain sum of
one tensor. What rides in the gradient all-reduce is tfdp/strategy/riders.py; Keras's
optimizer calls it through tfdp/strategy/gradient_hooks.py; the dtypes and compression are
tfdp/strategy/wire.py's; gather, scatter and broadcast are tfdp/strategy/replica_ops.py.

Everything here runs inside ``strategy.run`` (a replica context) of a tfdp strategy.

Launch order (issue 43): the buckets are filled from the last layers back and their
collectives are created, hence launched, in that order: the last layers' gradients, which
backprop produces first, are exchanged while backprop goes on to the earlier layers.
Creation order is launch order because each replica's collectives share its launcher's
ordering token (a resource), and tf.function's automatic control dependencies chain the ops
of one resource in the order they were created: a collective starts only after the one
created before it has finished. TensorFlow's own ``ReplicaContext.all_reduce`` reverses the
list it is given (cross_device_ops.CollectiveAllReduce._all_reduce), which made the first
layers' bucket, produced last, launch first and hold every other bucket behind it; tfdp
therefore launches each bucket itself through the replica's launcher.

Backward pacing (issue 43): launching early is not enough. TensorFlow's executor decides
when each backward op runs, and with one inter-op thread (one core per worker) it runs the
chain of input gradients down to the first layer before any weight gradient it left behind
(measured on the 20-layer MLP: the last layer's kernel gradient ran last of all, so its
bucket was ready only when backprop had finished). So each bucket's packed tensor is made a
control input of the backward ops that go on past its layers (the ops that read a tensor the
bucket needed but that the bucket does not need): backprop completes the bucket's layers,
the bucket is packed and its collective can launch, and only then do the earlier layers'
gradients proceed, as in PyTorch's autograd. No op is added or moved across a collective,
and no edge can close a cycle (an op is delayed only behind a tensor it is not an ancestor
of). Only a trace whose gradients were computed in the same graph is paced (not a
gradient handed into a tf.cond branch, nor one that comes out of an XLA-compiled function).
A packed bucket makes two expensive ops ready, its collective and the paced backward op; the
executor runs one on its thread and hands the other to the inter-op pool, so the collective
launches at once only if the pool has a second thread. TensorFlow sizes the pool to the
process's cores: a worker restricted to one core has one thread, and its collectives launch
when backprop ends, as before. tfdp leaves it so (measured in issue 43: on one core a second
thread made the overlap happen but not pay, since the loopback exchange is CPU work on the
same core; set TF_NUM_INTEROP_THREADS=2 to see the overlap there).

Compression (``"fp16"``/``"bf16"``, wire.py): each floating bucket travels and is summed in
that dtype and is cast back to the gradient's dtype afterwards.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import sparse_gradients
from tfdp.strategy import riders as _riders_lib
from tfdp.strategy.buckets import plan_buckets
from tfdp.strategy.options import DEFAULT_FIRST_BUCKET_BYTES
from tfdp.strategy.replica_ops import local_replica_index
from tfdp.strategy.wire import COMPRESSION_DTYPES, collective_options, reduce_dtype, to_wire

__all__ = [
    "all_reduce_gradients",
    "all_reduce",
]


# One collective per listed tensor: TensorFlow's packer opens a new pack once the current
# one holds at least this many bytes, and every tensor we hand it holds at least one byte.
_ONE_COLLECTIVE_PER_TENSOR = 1


def all_reduce_gradients(grads, strategy=None):
    """Sums ``grads`` (a list, ``None`` allowed) over all replicas of all workers.

    Uses the strategy's ``bucket_bytes`` and ``compression``. Sparse gradients
    (``tf.IndexedSlices``, e.g. from ``Embedding``) are reduced into the rows one device has
    (sparse_gradients.py: an all-gather, and an all-reduce for lookups shared by the batch)
    and are never compressed.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx.num_replicas_in_sync == 1:
        return list(grads)  # nothing to reduce: skip the packing and the group-of-one collective
    strategy = strategy or ctx.strategy
    bucket_bytes = strategy.bucket_bytes
    compression = strategy.compression
    grads = list(grads)
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    out = list(grads)
    if dense:
        # Reverse so the last layers' gradients, which backprop produces first, go first.
        order = dense[::-1]
        tensors = [grads[i] for i in order]
        buckets = plan_buckets(
            [t.shape.num_elements() * t.dtype.size if t.shape.is_fully_defined() else 0
             for t in tensors],
            [t.dtype for t in tensors], bucket_bytes, DEFAULT_FIRST_BUCKET_BYTES)
        # The riders (e.g. the preemption stop flag) join the last floating bucket's own
        # concatenation and leave by its own split: no extra copy of the bucket.
        carrier, riders = _riders_lib.board(strategy, [tensors[b[0]].dtype for b in buckets],
                                            COMPRESSION_DTYPES[compression])
        flat, extra = [], []
        for k, bucket in enumerate(buckets):  # packed in launch order: see the module's doc
            parts = [tf.reshape(tensors[j], [-1]) for j in bucket]
            if k == carrier:
                extra = [r.contribution() for r in riders]
                for rider, value in zip(riders, extra):
                    if value.shape.num_elements() is None:
                        raise ValueError(f"tfdp: a gradient rider's contribution needs a static "
                                         f"shape (got {value.shape} from "
                                         f"{type(rider).__name__}).")
                parts += [tf.reshape(tf.cast(v, parts[0].dtype), [-1]) for v in extra]
            packed = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
            flat.append(to_wire(packed, compression))
        if LAUNCH_ORDER == "last_layers_first":
            _pace_backward(flat)
        reduced = _launch_buckets(ctx, strategy, flat)
        for k, (bucket, value) in enumerate(zip(buckets, reduced)):
            # Gradient shapes are static at trace time; fall back to runtime shapes otherwise.
            sizes = [_size(tensors[j]) for j in bucket]
            riding = extra if k == carrier else []
            sizes += [v.shape.num_elements() for v in riding]
            pieces = [value] if len(sizes) == 1 else tf.split(value, sizes, axis=0)
            for rider, v, piece in zip(riders if riding else [], riding, pieces[len(bucket):]):
                rider.receive(tf.reshape(piece, v.shape))
            for j, piece in zip(bucket, pieces):
                src = tensors[j]
                shape = src.shape if src.shape.is_fully_defined() else tf.shape(src)
                out[order[j]] = tf.reshape(tf.cast(piece, src.dtype), shape)
    if sparse:  # in the form one device builds them (sparse_gradients.py)
        reduced = sparse_gradients.reduce_indexed_slices([grads[i] for i in sparse], strategy,
                                                         collective_options(strategy))
        for i, value in zip(sparse, reduced):
            out[i] = value
    return out


# The order in which all_reduce_gradients launches its buckets: "last_layers_first" (the
# order backprop produces them, see the module's doc) or "first_layers_first", the order of
# tfdp before issue 43, kept only so that a test can show the overlap check failing on it.
LAUNCH_ORDER = "last_layers_first"


def _ancestors(tensors, seen):
    """Adds to ``seen`` (a dict: op name -> op) every op ``tensors`` depend on, data and
    control inputs alike, in their graph; returns it."""
    stack = [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen[op.name] = op
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def _pace_backward(packed):
    """Makes backprop finish each bucket before it goes on past the bucket's layers (the
    module's doc, "Backward pacing"). ``packed``: the buckets' packed tensors in launch
    order. Returns how many ops now wait for a bucket (for the tests)."""
    if len(packed) < 2 or tf.executing_eagerly():
        return 0
    graph = packed[0].graph
    if any(t.graph is not graph for t in packed):
        return 0
    needed = _ancestors(packed, {})  # the whole backward (and forward) behind the buckets
    done: dict = {}
    paced = 0
    for bucket in packed[:-1]:
        _ancestors([bucket], done)
        for name, op in needed.items():
            if name in done or bucket.op in op.control_inputs:
                continue
            # An op the later buckets need, not this one, reading something this one
            # needed: where backprop would run past the bucket. Ops already after an
            # earlier bucket wait for this one too, which keeps the buckets in order.
            # Only stateless ops wait: tf.function's automatic control dependencies chain
            # stateful ones by creation order afterwards, and an edge here could then close
            # a cycle through them.
            if not op.op_def.is_stateful and any(t.op.name in done for t in op.inputs):
                _tf_private.add_control_input(op, bucket.op)
                paced += 1
    return paced


def _launch_buckets(ctx, strategy, flat):
    """Sums each tensor of ``flat`` over all replicas, one collective each, created (hence
    launched, the ordering token chains them) in list order; returns the sums in list order."""
    options = collective_options(strategy, bytes_per_pack=_ONE_COLLECTIVE_PER_TENSOR)
    launch = list(range(len(flat)))
    if LAUNCH_ORDER == "first_layers_first":
        launch.reverse()
    elif LAUNCH_ORDER != "last_layers_first":
        raise ValueError(f"collectives.LAUNCH_ORDER={LAUNCH_ORDER!r}: 'last_layers_first' or "
                         "'first_layers_first'.")
    if tf.executing_eagerly():
        # Eagerly TensorFlow runs the replicas one after another and must go through
        # merge_call (blocking collectives launched in turn would hang); nothing overlaps
        # there. Its all_reduce reverses the list it is given, so it is handed reversed.
        given = launch[::-1]
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [flat[k] for k in given],
                                 options=options)
        out = [None] * len(flat)
        for k, value in zip(given, reduced):
            out[k] = value
        return out
    launcher = _tf_private.collective_launchers(strategy.extended)[local_replica_index()]
    device_type = strategy.extended._tfdp_reduce_device_type  # tfdp's own
    out = [None] * len(flat)
    for k in launch:
        value = flat[k]
        wire = reduce_dtype(value.dtype, device_type)  # e.g. int64 for int32 on GPUs
        # The scope names the bucket in profiles (tools/profile_step.py): bucket 0 holds
        # the last layers' gradients.
        with tf.name_scope(f"tfdp_bucket_{k}"):
            summed = _tf_private.all_reduce(
                launcher, value if wire is None else tf.cast(value, wire), options)
        out[k] = summed if wire is None else tf.cast(summed, value.dtype)
    return out


def _size(t):
    return t.shape.num_elements() if t.shape.is_fully_defined() else tf.size(t)


def all_reduce(value, op=tf.distribute.ReduceOp.SUM):
    """All-reduce of one tensor over every replica of every worker."""
    ctx = tf.distribute.get_replica_context()
    return ctx.all_reduce(op, value, options=collective_options(ctx.strategy))
