"""Gather, scatter and broadcast between replicas, in replica order; where a replica sits.

Rule: callers see replica order (global replica id = worker rank x local devices + local
index), whatever order TensorFlow's collective group gives its members; these collectives
place and read rows by the group's rank order so that no caller has to. They run inside
``strategy.run`` (a replica context) of a tfdp strategy, launched directly through the
replica's launcher (no merge_call), so they also work inside tf.cond. Their users: the
sharded optimizers and parameters (ZeRO), sparse gradients, Horovod's allgather.

Group ranks: TensorFlow 2.21 orders a collective group's members by device name, then
connects the tasks in the *lexicographic* order of their names
(collective_param_resolver_local.cc, EstablishGlobalRank): with 12 workers the ranks are
tasks 0, 1, 10, 11, 2, ..., 9 (measured; all-gather and all-to-all alike), so beyond 10
workers a rank is not a replica id. Within a task, CPU devices keep their index order; GPUs
follow their interconnect ring (numeric where every peer link is equally strong; assumed
here).

All-to-all: TensorFlow keys each pairwise message by StrCat(exec_key, source rank, target
rank) (all_to_all.cc), so the keys of 1 -> 10 and 11 -> 0 are both "...110". Messages meet
in the target process's rendezvous, whose ranks are consecutive: with at most 10 replicas in
one process two colliding targets (their ranks differ by 10 or more) never share it. With 12
local replicas the collision was measured (replica 0 received replica 1's row for replica
10); there, and only there, reduce_scatter falls back to an all-reduce.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy.wire import collective_options, to_wire

__all__ = [
    "group_rank_order",
    "all_to_all_is_exact",
    "all_gather",
    "all_gather_rows",
    "broadcast_row",
    "reduce_scatter",
    "reduce_scatter_rows",
    "local_replica_index",
    "global_replica_id",
]

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
    at most 10 replicas per process, see the module's doc)."""
    return len(strategy.extended.worker_devices) <= MAX_ALL_TO_ALL_REPLICAS_PER_PROCESS


def local_replica_index() -> int:
    """This replica's index among the worker's local devices (a Python int)."""
    return _tf_private.local_replica_id(tf.distribute.get_replica_context())


def global_replica_id(strategy=None) -> int:
    """This replica's position among all replicas of all workers (a Python int)."""
    ctx = tf.distribute.get_replica_context()
    strategy = strategy or ctx.strategy
    cluster = getattr(strategy, "cluster", None)
    rank = cluster.rank if cluster is not None else 0
    return rank * len(strategy.extended.worker_devices) + local_replica_index()


def _launcher(strategy):
    return _tf_private.collective_launchers(strategy.extended)[local_replica_index()]


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
    if axis != 0:
        value = tf.experimental.numpy.moveaxis(value, axis, 0)
    gathered = _tf_private.all_gather(_launcher(strategy), value, collective_options(strategy))
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
    width = int(row.shape[0])
    gathered = tf.reshape(
        _tf_private.all_gather(_launcher(strategy), row, collective_options(strategy)),
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
    out = _tf_private.broadcast(_launcher(strategy), row, [width], tf.as_dtype(dtype),
                                collective_options(strategy))
    if row is not None:
        # The sender's output is often unused, and tf.function prunes an unused broadcast
        # (it is not in the ops that must run): the receivers would wait for ever.
        _tf_private.run_independently(out.op)
    return tf.reshape(out, [width])


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
    width = sum(p.shape.num_elements() for p in rows[me]) if all(
        p.shape.is_fully_defined() for p in rows[me]) else None
    if not all_to_all_is_exact(strategy):
        flat = to_wire(_concat([p for row in rows for p in row]), compression)
        summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, flat,
                                options=collective_options(ctx.strategy))
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
