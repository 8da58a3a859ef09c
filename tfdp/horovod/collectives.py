"""Horovod's collectives on tensors (``allreduce``, ``allgather``, ``broadcast``, ...) on tfdp.

Rule: every collective runs in the replica context of the process's collective engine
(``_runtime.engine()``: a ``tfdp.DataParallelStrategy`` with one replica per process, so a
replica's value is the process's tensor): ``strategy.run(fn, args=(tensors,))`` with ``fn``
calling ``ReplicaContext.all_reduce`` (``tfdp.strategy.collectives``) or tfdp's all-gather.
Called inside a ``tf.function`` (a Keras train step, a custom loop's step), the collectives
join that function's graph; called eagerly, they run through a ``tf.function`` cached per
operation, dtypes and shapes (``allgather``: ranks only, so that ranks with different first
dimensions trace the same functions).

As in Horovod, every process must call the same collectives in the same order (Horovod
matches them by name; TensorFlow's collective runtime matches them by order: a collective
only one rank calls waits for its peers). Models and variables live outside any strategy
scope: these functions take and return plain tensors.

What each operation does on the wire:

* ``allreduce`` (``Sum``/``Average``): one bucketed sum (tfdp's gradient buckets),
  ``Average`` divides by ``size()`` afterwards (integers: division truncated toward zero);
  ``Min``/``Max``/``Product``: an all-gather and a local reduction; ``Adasum`` is not
  implemented. ``tf.IndexedSlices``: values and indices are all-gathered, as Horovod does.
* ``allgather``: the first-dimension sizes are gathered first, every tensor is padded to the
  largest, gathered, and the padding dropped: ranks may contribute different sizes.
* ``broadcast``: a sum in which only the root contributes its value (others zeros): exact.
* ``alltoall``/``reducescatter``: built from ``allgather``/``allreduce`` (correct; moves
  more bytes than a native all-to-all).
* ``broadcast_object``/``allgather_object``: pickle, bytes as int64 words, then the above.
"""

from __future__ import annotations

import functools
import pickle
import threading

import numpy as np
import tensorflow as tf

from tfdp import process_state
from tfdp.horovod import _runtime
from tfdp.strategy import collectives as _tfdp_collectives
from tfdp.strategy import deadline
from tfdp.strategy import replica_ops as _tfdp_replica_ops

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "allreduce",
           "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "broadcast_variables", "broadcast_object", "allgather_object", "alltoall",
           "reducescatter", "grouped_reducescatter", "barrier", "join", "size_op", "rank_op",
           "local_size_op", "local_rank_op", "process_set_included_op"]

# Horovod's ReduceOp values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}


class Compressor:
    """Compresses a tensor for the wire and restores it: Horovod's interface."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    compress = staticmethod(lambda tensor: (tensor, None))
    decompress = staticmethod(lambda tensor, ctx: tensor)


class FP16Compressor(Compressor):
    """Floating tensors travel (and are summed) as float16; others unchanged."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor


def check_process_set(process_set):
    """NotImplementedError unless ``process_set`` is None or the global set (every
    collective, and DistributedOptimizer, spans all ranks)."""
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise NotImplementedError("tfdp.horovod: process sets are not supported; every "
                                  "collective spans all ranks (the global process set).")


def resolve_op(average, op):
    """The reduction op Horovod's ``average=``/``op=`` pair means (``op`` supersedes the
    deprecated ``average``; neither: Average). ValueError for both or an unknown op,
    NotImplementedError for Adasum."""
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError(
            "tfdp.horovod: op=Adasum is not implemented; use op=hvd.Average (what tfdp's "
            "DataParallelStrategy computes) or a large-batch optimizer (tfdp.optimizers.LARS, "
            "LAMB).")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


# --- running in the engine's replica context -------------------------------------------------
_cache: dict = {}
_cache_lock = threading.Lock()


def _spec(t, uneven):
    return tf.TensorSpec([None] * t.shape.rank if uneven else t.shape, t.dtype)


def _run_in_replicas(strategy, replica_fn, *tensors):
    return strategy.run(replica_fn, args=(list(tensors),))


def _run(key, replica_fn, tensors, uneven=False):
    """``replica_fn(list of tensors)`` in the engine's replica context; returns its result.

    Inside a tf.function: ``strategy.run`` joins the graph being traced. Eagerly: through a
    tf.function cached per ``key``, dtypes and shapes (``uneven``: ranks only, dimensions
    unknown, for shapes that differ between ranks: every rank traces the same functions in
    the same order).
    """
    strategy = _runtime.engine()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if tf.inside_function():
        return strategy.run(replica_fn, args=(tensors,))
    full_key = (key, uneven, tuple((t.dtype, tuple(_spec(t, uneven).shape)) for t in tensors))
    with _cache_lock:
        function = _cache.get(full_key)
        if function is None:
            # A partial, not a lambda: TensorFlow's retracing warning counts traces per code
            # object, and every cached function would share the lambda's.
            function = tf.function(
                functools.partial(_run_in_replicas, strategy, replica_fn),
                input_signature=[_spec(t, uneven) for t in tensors], autograph=False)
            _cache[full_key] = function
            first = True
        else:
            first = False
    # Eagerly, outside any step: bounded by the engine's deadline, naming a rank that never
    # calls it (tfdp.strategy.deadline.collective_outside_step).
    with deadline.collective_outside_step(
            strategy, f"tfdp.horovod's {key[0]} ({_CALLERS[key[0]]})", _FIX, kind=key[0],
            first=first):
        return function(*tensors)


_CALLERS = {
    "allreduce": "hvd.allreduce, grouped_allreduce, MetricAverageCallback, a "
                 "DistributedOptimizer's or DistributedGradientTape's reduction run eagerly",
    "allgather": "hvd.allgather, allgather_object",
    "broadcast": "hvd.broadcast, broadcast_variables, broadcast_object, "
                 "BroadcastGlobalVariablesCallback",
}
_FIX = ("Horovod's collectives are called by every rank in the same order: one under `if "
        "hvd.rank() == 0` (or after a rank returned or broke out of its loop early) leaves the "
        "others waiting. Call it on every rank; if a rank legitimately arrives this much later, "
        "raise the deadline (TFDP_TIMEOUT_SECONDS).")


def _ctx():
    return tf.distribute.get_replica_context()


def _num_replicas():
    return _ctx().num_replicas_in_sync


def _scale(t, factor, what):
    if factor == 1.0 or factor is None:
        return t
    if not t.dtype.is_floating:
        raise ValueError(f"{what}={factor} needs a floating tensor, got {t.dtype.name}")
    return t * tf.cast(factor, t.dtype)


def _sum(tensors):
    """Sums dense tensors (bools as int32) over all ranks: tfdp's bucketed reduction."""
    casts = [t.dtype if t.dtype == tf.bool else None for t in tensors]
    values = [tf.cast(t, tf.int32) if c else t for t, c in zip(tensors, casts)]
    strategy = _ctx().strategy
    reduced = list(values)
    if _num_replicas() > 1:
        # One bucketed reduction per dtype (TensorFlow packs a call's tensors together).
        for dtype in dict.fromkeys(v.dtype for v in values):
            where = [i for i, v in enumerate(values) if v.dtype == dtype]
            summed = _tfdp_collectives.all_reduce_gradients([values[i] for i in where], strategy)
            for i, r in zip(where, summed):
                reduced[i] = r
    return [tf.cast(r, c) if c else r for r, c in zip(reduced, casts)]


def _gather_even(t):
    """All-gather along axis 0 of tensors of one shape on every rank."""
    if _num_replicas() == 1:
        return t
    if t.dtype == tf.bool:
        return tf.cast(_tfdp_replica_ops.all_gather(tf.cast(t, tf.int32)), tf.bool)
    return _tfdp_replica_ops.all_gather(t)


def _gather_uneven(t):
    """All-gather along axis 0; the ranks' first dimensions may differ."""
    if _num_replicas() == 1:
        return t
    n = tf.shape(t, out_type=tf.int64)[:1]
    sizes = _gather_even(n)  # [N]
    longest = tf.reduce_max(sizes)
    pad = tf.concat([tf.stack([tf.zeros([], tf.int64), longest - n[0]])[None, :],
                     tf.zeros([tf.rank(t) - 1, 2], tf.int64)], axis=0)
    gathered = _gather_even(tf.pad(t, pad))
    rows = tf.reshape(tf.range(tf.size(sizes, out_type=tf.int64) * longest), [-1, longest])
    keep = tf.boolean_mask(rows, tf.sequence_mask(sizes, longest))
    return tf.gather(gathered, keep)


# --- allreduce ------------------------------------------------------------------------------------
def _allreduce_replica(op, compression, prescale_factor, postscale_factor):
    def replica_fn(tensors):
        size = _num_replicas()
        compressed = [compression.compress(_scale(t, prescale_factor, "prescale_factor"))
                      for t in tensors]
        wire = [c for c, _ in compressed]
        if op in (Sum, Average):
            reduced = _sum(wire)
        else:
            local = {Min: tf.reduce_min, Max: tf.reduce_max, Product: tf.reduce_prod}[op]
            reduced = [local(_gather_even(w[None]), axis=0) for w in wire]
        out = []
        for r, (_, ctx) in zip(reduced, compressed):
            r = compression.decompress(r, ctx)
            if op == Average:
                if r.dtype.is_floating or r.dtype.is_complex:
                    r = r / tf.cast(size, r.dtype)
                else:
                    r = tf.truncatediv(r, tf.cast(size, r.dtype))
            out.append(_scale(r, postscale_factor, "postscale_factor"))
        return out
    return replica_fn


def _reduce_slices(slices, op, name):
    if op not in (Sum, Average):
        raise NotImplementedError(f"{name}: tf.IndexedSlices reduce with Sum or Average only "
                                  f"(got {_OP_NAMES[op]}); convert to a dense tensor first")
    values = allgather(slices.values)
    indices = allgather(slices.indices)
    if op == Average:
        values = values / tf.cast(_runtime.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None, **kwargs):
    """All-reduces every tensor of the list (one bucketed reduction); returns a list.

    ``tf.IndexedSlices`` are all-gathered (Sum/Average only); ``None`` entries stay None.
    """
    check_process_set(process_set)
    op = resolve_op(average, op)
    tensors = list(tensors)
    out = list(tensors)
    dense = [i for i, t in enumerate(tensors)
             if t is not None and not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _reduce_slices(t, op, "allreduce")
    if dense:
        key = ("allreduce", op, compression, float(prescale_factor), float(postscale_factor))
        reduced = _run(key, _allreduce_replica(op, compression, prescale_factor,
                                               postscale_factor), [tensors[i] for i in dense])
        for i, r in zip(dense, reduced):
            out[i] = r
    return out


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=None, ignore_name_scope=False):
    """The reduction of ``tensor`` over all ranks (default ``op=Average``).

    Args:
        tensor: a tensor (or ``tf.IndexedSlices``: values and indices are all-gathered).
        average: deprecated in Horovod; True = ``Average``, False = ``Sum``.
        op: ``hvd.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16`` (floating
            tensors are summed as float16: about 1e-3 relative error).
        prescale_factor, postscale_factor: multiply before / after the reduction.
        device_dense, device_sparse, name, ignore_name_scope: accepted and ignored.
    """
    return grouped_allreduce([tensor], average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)[0]


# --- allgather, broadcast ----------------------------------------------------------------
def _scalar_to_vector(t):
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0:
        return tf.reshape(t, [1])
    if t.shape.rank is None:
        raise ValueError("allgather needs a tensor of known rank")
    return t


def grouped_allgather(tensors, process_set=None, **kwargs):
    """``allgather`` of every tensor of the list; returns a list."""
    check_process_set(process_set)
    tensors = [_scalar_to_vector(t) for t in tensors]
    return list(_run(("allgather",), lambda ts: [_gather_uneven(t) for t in ts], tensors,
                     uneven=True))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """The concatenation along the first dimension of every rank's ``tensor`` (rank order).

    The first dimension may differ between ranks; the others must agree. A scalar counts
    as a vector of one element.
    """
    return grouped_allgather([tensor], process_set=process_set)[0]


def _check_root(root_rank):
    size = _runtime.size()
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"root_rank={root_rank} is not a rank of this job (size {size})")
    return int(root_rank)


def _broadcast_replica(root_rank, my_rank):
    def replica_fn(tensors):
        mine = [t if my_rank == root_rank else tf.zeros_like(t) for t in tensors]
        return _sum(mine)
    return replica_fn


def _grouped_broadcast(tensors, root_rank):
    root_rank = _check_root(root_rank)
    me = _runtime.rank()
    return list(_run(("broadcast", root_rank), _broadcast_replica(root_rank, me), tensors))


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """``root_rank``'s ``tensor`` on every rank (same shape and dtype everywhere)."""
    check_process_set(process_set)
    return _grouped_broadcast([tensor], root_rank)[0]


def model_and_optimizer_variables(model, optimizer=None) -> list:
    """``model``'s variables, then ``optimizer``'s, each once (a model can track its
    optimizer's variables, an optimizer a model's): what a broadcast or a commit carries."""
    variables = list(model.variables)
    if optimizer is not None:
        variables += list(optimizer.variables)
    seen, unique = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    return unique


def broadcast_variables(variables, root_rank, process_set=None, inplace=False):
    """Assigns ``root_rank``'s value to each of ``variables`` on every rank (one reduction).

    Returns None eagerly, the grouped assignments inside a tf.function."""
    check_process_set(process_set)
    variables = list(variables)
    if not variables:
        return None
    values = _grouped_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.inside_function():
        return tf.group([a for a in assigns if isinstance(a, (tf.Operation, tf.Tensor))])
    return None


# --- Python objects ---------------------------------------------------------------------------
def _to_words(obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    padded = data + b"\0" * (-len(data) % 8)
    return np.frombuffer(padded, dtype=np.int64).copy(), len(data)


def _from_words(words, length):
    return pickle.loads(np.asarray(words, dtype=np.int64).tobytes()[:length])


def _eager_only(name):
    if tf.inside_function():
        raise RuntimeError(f"tfdp.horovod.{name} works on Python objects: call it eagerly, "
                           "not inside a tf.function")


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=None):
    """``root_rank``'s Python object (pickled) on every rank."""
    _eager_only("broadcast_object")
    check_process_set(process_set)
    root_rank = _check_root(root_rank)
    is_root = _runtime.rank() == root_rank
    words, length = _to_words(obj) if is_root else (None, 0)
    header = np.array([length, 0 if words is None else words.size], np.int64)
    length, count = (int(v) for v in broadcast(tf.constant(header), root_rank).numpy())
    payload = words if is_root else np.zeros([count], np.int64)
    return _from_words(broadcast(tf.constant(payload), root_rank).numpy(), length)


def allgather_object(obj, session=None, name=None, process_set=None):
    """The list of every rank's Python object (pickled), in rank order."""
    _eager_only("allgather_object")
    check_process_set(process_set)
    words, length = _to_words(obj)
    lengths, words_all = grouped_allgather([tf.constant([length, words.size], tf.int64),
                                            tf.constant(words)])
    lengths, words_all = lengths.numpy().reshape(-1, 2), words_all.numpy()
    out, start = [], 0
    for length, count in lengths:
        out.append(_from_words(words_all[start:start + count], length))
        start += count
    return out


# --- alltoall, reducescatter ------------------------------------------------------------------
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=None):
    """Rank r sends rows ``splits[j]`` of its tensor (in order) to rank j and receives the
    rows every rank sent it, in rank order. Without ``splits`` the first dimension is split
    evenly (it must divide by ``size()``) and the received tensor is returned; with
    ``splits`` the pair ``(received, received_splits)``, as in Horovod 0.28.

    Built from all-gathers (every rank receives all rows, keeps its own): correct, but it
    moves ``size()`` times the bytes of a native all-to-all.
    """
    check_process_set(process_set)
    size = _runtime.size()
    tensor = tf.convert_to_tensor(tensor)
    given = splits is not None
    if given:
        splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)
    else:
        rows = tf.shape(tensor, out_type=tf.int64)[0]
        if tensor.shape[0] is not None and tensor.shape[0] % size:
            raise ValueError(f"alltoall: the first dimension {tensor.shape[0]} does not divide "
                             f"by size() = {size}; pass splits=")
        splits = tf.fill([size], rows // size)
    gathered, all_splits = grouped_allgather([tensor, splits])
    all_splits = tf.reshape(all_splits, [size, size])
    me = _runtime.rank()
    starts = tf.concat([[0], tf.cumsum(tf.reduce_sum(all_splits, axis=1))[:-1]], axis=0)
    pieces = []
    for j in range(size):
        begin = starts[j] + tf.reduce_sum(all_splits[j, :me])
        pieces.append(gathered[begin:begin + all_splits[j, me]])
    received = tf.concat(pieces, axis=0)
    return (received, tf.cast(all_splits[:, me], tf.int32)) if given else received


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          name=None, process_set=None, prescale_factor=1.0,
                          postscale_factor=1.0):
    """``reducescatter`` of every tensor of the list; returns a list."""
    if op not in (Sum, Average):
        raise ValueError("reducescatter supports op=hvd.Average or hvd.Sum")
    reduced = grouped_allreduce(tensors, compression=compression, op=op,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set)
    size, me = _runtime.size(), _runtime.rank()
    out = []
    for r in reduced:
        rows = tf.shape(r)[0]
        # Horovod's split: the first rows % size ranks get one row more.
        base, extra = rows // size, rows % size
        begin = me * base + tf.minimum(me, extra)
        count = base + tf.cast(me < extra, base.dtype)
        out.append(r[begin:begin + count])
    return out


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  ignore_name_scope=False, process_set=None, prescale_factor=1.0,
                  postscale_factor=1.0):
    """The reduction (``Average`` or ``Sum``) over all ranks of ``tensor``, split along the
    first dimension: rank r keeps its part (the first ``rows % size`` ranks get one row
    more). Built as an all-reduce and a slice (correct; a native reduce-scatter moves
    fewer bytes)."""
    return grouped_reducescatter([tensor], compression=compression, op=op,
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor)[0]


# --- misc -----------------------------------------------------------------------------------
def barrier(process_set=None):
    """Returns once every rank has called it (a tiny all-reduce)."""
    check_process_set(process_set)
    allreduce(tf.zeros([1], tf.float32), op=Sum)


def join(device=""):
    """Not implemented: Horovod's ``join`` lets ranks with fewer batches stop early."""
    raise NotImplementedError(
        "tfdp.horovod.join() is not implemented: give every rank the same number of batches "
        "(dataset.shard(hvd.size(), hvd.rank()) of a repeated dataset with steps_per_epoch=, "
        "or tfdp.data.distribute, which ends an epoch on every rank together).")


def size_op(process_set_id=0, name=None):
    return tf.constant(_runtime.size(), tf.int32)


def rank_op(name=None):
    return tf.constant(_runtime.rank(), tf.int32)


def local_size_op(name=None):
    return tf.constant(_runtime.local_size(), tf.int32)


def local_rank_op(name=None):
    return tf.constant(_runtime.local_rank(), tf.int32)


def process_set_included_op(process_set_id=0, name=None):
    return tf.constant(1 if process_set_id == 0 else 0, tf.int32)


process_state.register("horovod traced collectives", __name__, lambda: len(_cache),
                       _cache.clear)
