"""Replica-context collectives: gradient all-reduce with buckets and compression,
reduce-scatter, all-gather and broadcast for sharded optimizers. What rides in the gradient
all-reduce is tfdp/strategy/riders.py; Keras's optimizer calls the all-reduce through
tfdp/strategy/gradient_hooks.py.

Everything here runs inside ``strategy.run`` (a replica context) of a tfdp strategy.

Bucketing: gradients of one dtype are flattened and concatenated into buckets of about
``bucket_bytes`` (a bucket closes once it reaches the size, so one large tensor is one
bucket), and each bucket is one collective. ``bucket_bytes=0`` means one collective per
tensor. Fewer, larger collectives amortise the per-collective latency that dominates small
models; smaller buckets start communicating earlier on large ones. A gradient that fits in
one bucket is one fused collective; a larger one gets a small first bucket
(``options.DEFAULT_FIRST_BUCKET_BYTES``), as PyTorch DDP does.

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

Compression: ``"fp16"``/``"bf16"`` casts each floating bucket to that dtype for the
collective and back to the gradient's dtype afterwards, halving bytes on the wire. The
ring sum itself runs in the wire dtype, so the result carries that dtype's rounding error
(fp16: ~1e-3 relative; bf16: ~1e-2); gradients in Keras are already divided by the
replica count, which keeps fp16 sums far from overflow in practice.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import sparse_gradients
from tfdp.strategy import riders as _riders_lib
from tfdp.strategy.options import DEFAULT_FIRST_BUCKET_BYTES
# The riders' names stay importable from here (their home is tfdp/strategy/riders.py).
from tfdp.strategy.riders import (LogsRider, add_gradient_rider, is_reduced,  # noqa: F401
                                  mark_reduced, remove_gradient_rider, riding_with_gradients)

__all__ = [
    "COMPRESSION_DTYPES",
    "reduce_dtype",
    "plan_buckets",
    "all_reduce_gradients",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_gather_rows",
    "broadcast_row",
    "reduce_scatter_rows",
    "group_rank_order",
]

COMPRESSION_DTYPES = {None: None, "fp16": tf.float16, "bf16": tf.bfloat16}

# What TensorFlow 2.21's collective executor sums (base_collective_executor.cc,
# CreateCollective; the same for ring and NCCL): half, float, double and int64 on every
# device; int32 and bfloat16 everywhere but on GPUs; bool and all other dtypes nowhere.
_SUMMABLE = frozenset({tf.float16, tf.float32, tf.float64, tf.int64})
_SUMMABLE_OFF_GPU = frozenset({tf.int32, tf.bfloat16})


def reduce_dtype(dtype, device_type: str):
    """The dtype in which values of ``dtype`` are summed across replicas; pure policy.

    Returns None when TensorFlow's collectives sum ``dtype`` on ``device_type`` devices as
    it is; otherwise a dtype that holds every value exactly and that they do sum: int64 for
    bool and integers of up to 32 bits (int32 labels on GPUs), float32 for bfloat16 on GPUs.
    The result is cast back to ``dtype``. MultiWorkerMirroredStrategy's RING trains with
    int32 labels on GPUs because Keras reduces nothing there; tfdp reduces Keras's batch nest.

    Raises:
        TypeError: for dtypes no exact widening serves (uint64, complex, strings).
    """
    dtype = tf.as_dtype(dtype)
    if dtype in _SUMMABLE or (device_type != "GPU" and dtype in _SUMMABLE_OFF_GPU):
        return None
    if dtype == tf.bfloat16:
        return tf.float32
    if dtype == tf.bool or (dtype.is_integer and dtype.size <= 4):
        return tf.int64
    raise TypeError(
        f"tfdp cannot reduce {dtype.name} values across replicas: TensorFlow's collectives "
        "sum float16/32/64 and int64 (int32 and bfloat16 off GPUs), and no exact widening "
        f"of {dtype.name} exists. Cast them to float32 or int64 first.")

# One collective per listed tensor: TensorFlow's packer opens a new pack once the current
# one holds at least this many bytes, and every tensor we hand it holds at least one byte.
_ONE_COLLECTIVE_PER_TENSOR = 1


def plan_buckets(num_bytes: Sequence[int], dtypes: Sequence, bucket_bytes: int,
                 first_bucket_bytes: int | None = None) -> list[list[int]]:
    """Groups tensor indices into buckets; pure function, no TensorFlow ops.

    Tensors of one dtype are bucketed in order; a bucket closes as soon as it holds at
    least ``bucket_bytes`` (so no bucket is split and a tensor larger than the bucket size
    is a bucket of its own). ``bucket_bytes == 0``: one bucket per tensor.
    ``first_bucket_bytes``: where the tensors do not all fit in ``bucket_bytes``, the first
    bucket (the first tensors', launched first) closes at this smaller size instead, so
    that the exchange starts early; when they all fit they stay one bucket per dtype (one
    collective, no extra latency).

    Returns:
        A list of buckets, each a list of indices into the inputs.
    """
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 0 (0 = one collective per tensor).")
    first_cap = bucket_bytes
    if first_bucket_bytes is not None and sum(num_bytes) > bucket_bytes:
        first_cap = min(first_bucket_bytes, bucket_bytes)
    buckets: list[list[int]] = []
    open_bucket: dict = {}  # dtype -> (bucket index, bytes so far)
    for i, (size, dtype) in enumerate(zip(num_bytes, dtypes)):
        current = open_bucket.get(dtype)
        cap = first_cap if current is not None and current[0] == 0 else bucket_bytes
        if bucket_bytes == 0 or current is None or current[1] >= cap:
            buckets.append([i])
            open_bucket[dtype] = (len(buckets) - 1, size)
        else:
            buckets[current[0]].append(i)
            open_bucket[dtype] = (current[0], current[1] + size)
    return buckets


def _options(strategy, **overrides):
    base = _tf_private.communication_options(strategy.extended)  # the strategy's defaults
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=overrides.get("bytes_per_pack", base.bytes_per_pack),
        timeout_seconds=base.timeout_seconds,
        implementation=base.implementation,
    )


def to_wire(x, compression):
    """``x`` in the wire dtype of ``compression`` (floating tensors only)."""
    wire = COMPRESSION_DTYPES[compression]
    if wire is None or not x.dtype.is_floating or x.dtype == wire:
        return x
    return tf.cast(x, wire)


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
                                                         _options(strategy))
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
    options = _options(strategy, bytes_per_pack=_ONE_COLLECTIVE_PER_TENSOR)
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
    device_type = strategy.extended._tfdp_reduce_device_type  # noqa: SLF001 (tfdp's own)
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
    return ctx.all_reduce(op, value, options=_options(ctx.strategy))


# --- Group ranks: where each replica sits in TensorFlow's collectives -----------------------
# TensorFlow 2.21 orders a collective group's members by device name, then connects the tasks
# in the *lexicographic* order of their names (collective_param_resolver_local.cc,
# EstablishGlobalRank): with 12 workers the ranks are tasks 0, 1, 10, 11, 2, ..., 9 (measured;
# all-gather and all-to-all alike), so beyond 10 workers a rank is not a replica id. Within a
# task, CPU devices keep their index order; GPUs follow their interconnect ring (numeric where
# every peer link is equally strong; assumed here). The collectives below place and read rows
# by this order, so callers see replica order.
#
# TensorFlow's all-to-all keys each pairwise message by StrCat(exec_key, source rank, target
# rank) (all_to_all.cc), so the keys of 1 -> 10 and 11 -> 0 are both "...110". Messages meet
# in the target process's rendezvous, whose ranks are consecutive: with at most 10 replicas in
# one process two colliding targets (their ranks differ by 10 or more) never share it. With 12
# local replicas the collision was measured (replica 0 received replica 1's row for replica
# 10); there, and only there, reduce_scatter falls back to an all-reduce.
MAX_ALL_TO_ALL_REPLICAS_PER_PROCESS = 10


def _task_name(cluster, rank: int) -> str:
    """TensorFlow's task name of worker ``rank`` (the chief, if any, is rank 0)."""
    spec = getattr(cluster, "cluster_spec", None) or {}
    if spec.get("chief"):
        return ("/job:chief/replica:0/task:0" if rank == 0
                else f"/job:worker/replica:0/task:{rank - 1}")
    return f"/job:worker/replica:0/task:{rank}"


def group_rank_order(strategy=None) -> list[int]:
    """The global replica id at each rank of TensorFlow's collective group (a list of ints:
    ``order[k]`` is the replica at rank k). Identity unless more than 10 workers, or local
    devices listed out of index order. Pure given the strategy's devices and cluster."""
    strategy = strategy or tf.distribute.get_strategy()
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    local = sorted(range(len(devices)), key=lambda k: (devices[k].device_type or "",
                                                      devices[k].device_index or 0, k))
    cluster = getattr(strategy, "cluster", None)
    workers = cluster.num_workers if cluster is not None else 1
    tasks = sorted(range(workers), key=lambda w: _task_name(cluster, w))
    return [w * len(devices) + k for w in tasks for k in local]


def _rank_of(strategy) -> list[int]:
    """``rank_of[p]``: the group rank of replica p (the inverse of group_rank_order)."""
    order = group_rank_order(strategy)
    rank_of = [0] * len(order)
    for rank, replica in enumerate(order):
        rank_of[replica] = rank
    return rank_of


def all_to_all_is_exact(strategy) -> bool:
    """Whether TensorFlow's all-to-all delivers every row where it is sent (no key collision:
    at most 10 replicas per process, see above)."""
    return len(strategy.extended.worker_devices) <= MAX_ALL_TO_ALL_REPLICAS_PER_PROCESS


def all_gather(value, axis=0):
    """Concatenates ``value`` from every replica (in replica order) along ``axis``.

    Launched directly in the replica (no merge_call), so it also works inside tf.cond.
    Must run inside a tf.function. TensorFlow gathers in group-rank order; where that is not
    replica order (more than 10 workers) the pieces are put back in replica order (a copy).
    """
    ctx = tf.distribute.get_replica_context()
    strategy = ctx.strategy
    if ctx.num_replicas_in_sync == 1:
        return value
    launcher = _tf_private.collective_launchers(strategy.extended)[local_replica_index()]
    if axis != 0:
        value = tf.experimental.numpy.moveaxis(value, axis, 0)
    gathered = _tf_private.all_gather(launcher, value, _options(strategy))
    rank_of = _rank_of(strategy)
    if rank_of != sorted(rank_of):
        pieces = tf.split(gathered, len(rank_of), axis=0)
        gathered = tf.concat([pieces[rank] for rank in rank_of], axis=0)
    if axis != 0:
        gathered = tf.experimental.numpy.moveaxis(gathered, 0, axis)
    return gathered


def all_gather_rows(row, strategy=None) -> list:
    """Every replica's ``row`` (1-D, the same length everywhere), as a list in replica order.

    The rows are slices of one gathered buffer (no copy to reorder them). Must run inside a
    tf.function, in a replica context.
    """
    ctx = tf.distribute.get_replica_context()
    strategy = strategy or ctx.strategy
    if ctx.num_replicas_in_sync == 1:
        return [row]
    launcher = _tf_private.collective_launchers(strategy.extended)[local_replica_index()]
    width = int(row.shape[0])
    gathered = tf.reshape(_tf_private.all_gather(launcher, row, _options(strategy)),
                          [ctx.num_replicas_in_sync * width])  # static shape for the slices
    return [gathered[rank * width:(rank + 1) * width] for rank in _rank_of(strategy)]


def broadcast_row(row, width: int, dtype, strategy=None):
    """The 1-D ``row`` (``width`` elements of ``dtype``) of the one replica that passes it;
    the others pass None and receive it. Every replica gets the row. Must run inside a
    tf.function, in a replica context; the caller orders successive broadcasts (they take
    no ordering token)."""
    ctx = tf.distribute.get_replica_context()
    strategy = strategy or ctx.strategy
    if ctx.num_replicas_in_sync == 1:
        return row
    launcher = _tf_private.collective_launchers(strategy.extended)[local_replica_index()]
    out = _tf_private.broadcast(launcher, row, [width], tf.as_dtype(dtype), _options(strategy))
    if row is not None:
        # The sender's output is often unused, and tf.function prunes an unused broadcast
        # (it is not in the ops that must run): the receivers would wait for ever.
        _tf_private.run_independently(out.op)
    return tf.reshape(out, [width])


def local_replica_index() -> int:
    """This replica's index among the worker's local devices (a Python int)."""
    return _tf_private.local_replica_id(tf.distribute.get_replica_context())


def reduce_scatter(value, strategy=None):
    """Sums ``value`` over all replicas; returns this replica's row.

    Args:
        value: shape ``[R, S]`` where R is the number of replicas in sync; row k is the
            part destined for replica k.

    Returns:
        Shape ``[S]``: the sum over replicas of row ``replica_id`` (this replica's).

    See ``reduce_scatter_rows``, which builds the rows in place; this one takes them stacked
    (and copies them once more where group ranks are not replica order).
    """
    ctx = tf.distribute.get_replica_context()
    strategy = strategy or ctx.strategy
    num_replicas = ctx.num_replicas_in_sync
    if num_replicas == 1:
        return value[0]
    order = group_rank_order(strategy)
    if all_to_all_is_exact(strategy) and order == sorted(order):
        # Already laid out in rank order: no copy to build the collective's input.
        received = strategy.extended._tfdp_all_to_all(value, local_replica_index())
        return tf.reduce_sum(received, axis=0)
    return reduce_scatter_rows([[value[k]] for k in range(num_replicas)], strategy)


def reduce_scatter_rows(rows, strategy=None, compression=None):
    """Sums each replica's row over all replicas; returns this replica's sum.

    Args:
        rows: ``rows[k]`` (k in replica order) is a list of 1-D tensors of one dtype, laid end
            to end the part destined for replica k; every row has the same total length S.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the rows travel and are summed in
            that dtype (floating rows only); the result is in the rows' dtype.

    Returns:
        Shape ``[S]``: the sum over replicas of this replica's row.

    TensorFlow's CollectiveReduceScatterV2 has no CPU kernel (NCCL only), so this is an
    all-to-all (replica k receives row k from every peer, R·S elements in all, as a ring
    reduce-scatter moves) followed by a local sum. The rows are concatenated in group-rank
    order in the one copy that builds the collective's input. With more than 10 replicas in
    one process (where TensorFlow's all-to-all keys collide) it is an all-reduce of the rows
    and a slice: twice the traffic, the same memory.
    """
    ctx = tf.distribute.get_replica_context()
    strategy = strategy or ctx.strategy
    me = global_replica_id(strategy)
    dtype = rows[0][0].dtype
    if ctx.num_replicas_in_sync == 1:
        return _concat(rows[0])
    width = sum(_size(p) for p in rows[me]) if all(
        p.shape.is_fully_defined() for p in rows[me]) else None
    if not all_to_all_is_exact(strategy):
        flat = to_wire(_concat([p for row in rows for p in row]), compression)
        summed = all_reduce(flat)
        if width is None:
            width = tf.shape(flat)[0] // len(rows)
        return tf.cast(summed[me * width:(me + 1) * width], dtype)
    order = group_rank_order(strategy)
    flat = to_wire(_concat([p for replica in order for p in rows[replica]]), compression)
    received = strategy.extended._tfdp_all_to_all(  # its first dimension is the group size
        tf.reshape(flat, [len(rows), -1 if width is None else width]), local_replica_index())
    return tf.cast(tf.reduce_sum(received, axis=0), dtype)


def _concat(parts):
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def global_replica_id(strategy=None) -> int:
    """This replica's position among all replicas of all workers (a Python int)."""
    ctx = tf.distribute.get_replica_context()
    strategy = strategy or ctx.strategy
    cluster = getattr(strategy, "cluster", None)
    rank = cluster.rank if cluster is not None else 0
    return rank * len(strategy.extended.worker_devices) + local_replica_index()
