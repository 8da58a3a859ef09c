"""ShardedOptimizer's two exchanges, in rounds of bounded size: the reduce-scatter that gives
each owner the summed gradients of its variables (step 1 of sharded.py's step), and the
all-gather that gives every replica the owners' new values (step 4).

Rule. Each replica's owned tensors, flattened end to end, form its stream; each stream is cut
into pieces of at most ``c`` elements between rows of its tensors, and round j moves every
stream's j-th piece in one collective (``packing.owner_streams``, ``packing.plan_rounds``).
``N * c`` elements are the round's bytes on the wire: the strategy's ``bucket_bytes``, lowered
to an eighth of the exchange but not below 4 MiB (``round_elements``). A round's rows are cut
and copied only after the previous round is done (a control dependency), so a replica holds
one round's rows and the collective's output at a time. The one-shot exchange it replaces
held an ``N x longest-stream`` buffer, padded to the largest partition, twice over, and its
all-gather left each variable holding the whole gathered buffer (a variable assigned the last
reference to a slice adopts it): that made ZeRO-2's peak higher than no sharding
(docs/zero.md, "Peak memory", has the measurements).

The all-gather writes each piece into its rows of the variable in place
(``ResourceStridedSliceAssign``); no variable adopts a gathered buffer, and a tensor spanning
rounds needs no assembled copy. The reduce-scatter hands the owner its pieces, joined per
tensor (at most 1/N of the gradients).

A stream shorter than the round leaves its row short; the rest is filled with copies of one
element of the round's data (never read back: receivers keep only the elements of real
segments), not with zeros, because TensorFlow's graph optimiser folds a zeros tensor of static
shape into a constant that stays in memory for the life of the traced step.

A table read by lookups (``looked_up``: its gradient is sparse) is the exception: its owner
broadcasts it whole, in one collective of its own, and each receiver's variable adopts the
received buffer (``AssignVariableOp``; no copy). Written in rounds, each receiver copied every
row a second time, and the row scatter that wrote them fast put the table in TensorFlow's
copy-on-read mode, where the lookups' dense read copied it once more every step (issue 41).
A receiver then holds one extra table while it arrives (the old buffer is freed as the new
one is adopted), and tables are broadcast one after another. A table over
``_WHOLE_TABLE_MAX_BYTES`` (gRPC carries a message of at most 2 GiB) goes in rounds.

Results equal the one-shot exchange's: every element is summed over the same replicas
(received rows in group-rank order, as before); the values gathered are the owners' bits.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdp.optimizers import packing
from tfdp.strategy import replica_ops, wire

__all__ = ["reduce_to_owners", "gather_from_owners", "round_elements", "whole_tables"]

# When the strategy does not say (no tfdp strategy: one replica), rounds of this many bytes.
_DEFAULT_ROUND_BYTES = 32 * 1024 * 1024
# A round moves at most an eighth of the exchanged bytes, but not less than this: one round's
# rows and the collective's output (2x the round) then stay at a quarter of a gradient copy,
# well under what sharding the optimizer state saves, while a small model stays one round
# (each round is one collective, latency bound on small tensors).
_MIN_ROUND_BYTES = 4 * 1024 * 1024
_ROUNDS_PER_EXCHANGE = 8
# A looked-up table up to this size is broadcast whole (gRPC's messages stop at 2 GiB).
_WHOLE_TABLE_MAX_BYTES = 1 << 30


def _num_elements(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def round_elements(bucket_bytes, num_replicas: int, itemsize: int, sizes) -> int:
    """Elements per row of one round (``num_replicas`` rows on the wire). Pure.

    The round's bytes are ``bucket_bytes`` (None: 32 MiB), lowered to an eighth of all the
    exchanged bytes (``sizes``: element counts) but not below 4 MiB; ``bucket_bytes == 0``
    (one collective per tensor elsewhere): rows of the largest tensor.
    """
    sizes = list(sizes)
    if bucket_bytes is None:
        bucket_bytes = _DEFAULT_ROUND_BYTES
    if bucket_bytes == 0:
        return max([1, *sizes])
    total = sum(sizes) * itemsize
    round_bytes = min(int(bucket_bytes), max(_MIN_ROUND_BYTES, total // _ROUNDS_PER_EXCHANGE))
    return max(1, round_bytes // (num_replicas * itemsize))


def _plan(shapes, owners, num_replicas, strategy, itemsize):
    sizes = {i: _num_elements(s) for i, s in shapes.items()}
    rows = {i: _num_elements(s[1:]) if len(s) > 1 else 1 for i, s in shapes.items()}
    streams = packing.owner_streams(sizes, owners, num_replicas, rows)
    c = round_elements(getattr(strategy, "bucket_bytes", None), num_replicas, itemsize,
                       sizes.values())
    return sizes, rows, packing.plan_rounds(streams, c)


def _segment(flat, segment, size):
    """The segment's elements of a flattened tensor (the tensor itself when whole)."""
    if segment.start == 0 and segment.stop == size:
        return flat
    return flat[segment.start:segment.stop]


def _filler(pad, source):
    """``pad`` elements of no meaning, made at run time from ``source``'s first element."""
    return tf.fill([pad], tf.reshape(source, [-1])[0])


def _pieces(row, segments, width):
    """``row`` (``width`` elements) cut into the given segments' pieces (the row itself for
    one whole segment)."""
    if len(segments) == 1 and segments[0].size == width:
        return [row]
    out, offset = [], 0
    for segment in segments:
        out.append(row[offset:offset + segment.size])
        offset += segment.size
    return out


def _assemble(pieces, shape, dtype):
    if not pieces:  # a tensor without elements
        return tf.zeros(shape, dtype)
    flat = pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)
    return tf.reshape(flat, shape)


def _write(target, segment, piece, shape, row, looked_up=False):
    """Writes ``piece`` (the flat elements of ``segment``) into ``target``'s rows in place;
    returns the operation. TensorFlow copies a slice into the variable's own buffer here,
    where a plain assignment of the last reference to a slice adopts it and keeps the whole
    gathered buffer alive after the step (measured: a 4 MB slice of a 16 MB tensor kept
    16 MB), and a tensor spanning rounds needs no assembled copy.

    A table read by lookups (``looked_up``) that is too large to go whole is written by a
    row scatter: TensorFlow's strided-slice assignment moved about 1.6 GB/s here (790 ms a
    step for a 1M x 64 table on 4 replicas, issue 41) where the scatter copies whole rows.
    Other variables keep the slice assignment: a scatter puts a variable in TensorFlow's
    copy-on-read mode, where every later dense read (Keras's lookups read the table densely)
    copies it."""
    if not shape:  # a scalar has no rows: assign a copy of its own
        return tf.raw_ops.AssignVariableOp(resource=target.handle,
                                           value=tf.raw_ops.DeepCopy(x=tf.reshape(piece, [])))
    first, last = segment.start // row, segment.stop // row
    if looked_up and len(shape) > 1:
        return tf.raw_ops.ResourceScatterUpdate(
            resource=target.handle, indices=tf.range(first, last),
            updates=tf.reshape(piece, [last - first, *shape[1:]]))
    return tf.raw_ops.ResourceStridedSliceAssign(
        ref=target.handle, begin=[first], end=[last], strides=[1],
        value=tf.reshape(piece, [last - first, *shape[1:]]))


def whole_tables(shapes, looked_up, itemsize) -> list:
    """The indices of the looked-up tables (matrices) broadcast whole rather than in rounds:
    those of at most ``_WHOLE_TABLE_MAX_BYTES``. Pure."""
    return sorted(i for i in looked_up if i in shapes and len(shapes[i]) > 1
                  and _num_elements(shapes[i]) * itemsize <= _WHOLE_TABLE_MAX_BYTES)


def _broadcast_whole(target, source, shape, owner, me, dtype, strategy, assign_own):
    """The owner's ``source`` broadcast to every replica's ``target``; the receivers' variables
    adopt the received buffer. The owner assigns its own target only when ``assign_own``
    (``source`` is not ``target``). Returns an op to order what follows after it."""
    width = _num_elements(shape)
    value = tf.reshape(tf.cast(source.value, dtype), [-1]) if me == owner else None
    row = replica_ops.broadcast_row(value, width, dtype, strategy)
    if me == owner and not assign_own:
        return row  # sent (broadcast_row marks the send to run)
    # A variable assigned the last reference to a tensor adopts its buffer; a later in-place
    # update copies it first if another reference remains (TensorFlow's copy-on-write).
    return tf.raw_ops.AssignVariableOp(resource=target.handle, value=tf.reshape(row, shape))


def reduce_to_owners(grads, variables, owners, me, strategy) -> dict:
    """This replica's owned gradients, each summed over all replicas.

    Args:
        grads: ``{index: dense local gradient}`` (every replica passes the same indices).
        variables: ``{index: model variable}`` for those indices (shapes and the dtype, one
            for all, in which gradients are summed).
        owners: ``owners[index]`` is the global replica that owns variable ``index``.
        me: this replica's global id.
        strategy: the tfdp strategy (its ``bucket_bytes`` and ``compression``).

    Returns:
        ``{index: summed gradient}`` for the indices ``me`` owns, shaped like the variables.
    """
    if not grads:
        return {}
    num_replicas = strategy.num_replicas_in_sync
    dtype = tf.as_dtype(variables[next(iter(grads))].dtype)
    shapes = {i: tuple(variables[i].shape) for i in grads}
    on_wire = wire.COMPRESSION_DTYPES[strategy.compression] if dtype.is_floating else None
    sizes, _, rounds = _plan(shapes, owners, num_replicas, strategy, (on_wire or dtype).size)
    flat = {}
    pieces = {i: [] for i in grads if owners[i] == me}
    previous = []
    for plan in rounds:
        # The rows of this round are cut and copied only once the last round's sum exists.
        with tf.control_dependencies(previous):
            rows = []
            for replica in range(num_replicas):
                parts = []
                for segment in plan.rows[replica]:
                    if segment.index not in flat:
                        flat[segment.index] = tf.reshape(tf.cast(grads[segment.index], dtype), [-1])
                    parts.append(_segment(flat[segment.index], segment, sizes[segment.index]))
                rows.append(parts)
            source = next(parts[0] for parts in rows if parts)
            for replica, parts in enumerate(rows):
                if plan.padding(replica):
                    parts.append(_filler(plan.padding(replica), source))
            mine = replica_ops.reduce_scatter_rows(rows, strategy, strategy.compression)
        previous = [mine]
        for segment, piece in zip(plan.rows[me], _pieces(mine, plan.rows[me], plan.width)):
            pieces[segment.index].append(piece)
    return {i: _assemble(pieces[i], shapes[i], dtype) for i in pieces}


def gather_from_owners(targets, owners, me, strategy, sources=None, looked_up=()) -> None:
    """Every replica assigns every owner's values to ``targets`` (``{index: variable}``).

    The owners send their ``targets`` (just updated; an owner then skips its own), or
    ``sources`` (``{index: variable}``, e.g. moving averages; every target is assigned).
    ``looked_up``: the indices of tables read by lookups (their gradients are sparse),
    written by row scatters (``_write``).
    Each piece is written into its rows of the variable as it arrives, and a round's row is
    read only after the previous round is written, so one round's gathered rows are held at
    a time.
    """
    if not targets:
        return
    num_replicas = strategy.num_replicas_in_sync
    send = targets if sources is None else sources
    dtype = tf.as_dtype(next(iter(targets.values())).dtype)
    shapes = {i: tuple(v.shape) for i, v in targets.items()}
    tables = whole_tables(shapes, looked_up, dtype.size)
    previous = []
    for index in tables:
        # One table at a time: a receiver holds one extra table while it arrives.
        with tf.control_dependencies(previous):
            previous = [_broadcast_whole(targets[index], send[index], shapes[index],
                                         owners[index], me, dtype, strategy,
                                         assign_own=sources is not None)]
    shapes = {i: s for i, s in shapes.items() if i not in tables}
    if not shapes:
        return
    sizes, rows_of, rounds = _plan(shapes, owners, num_replicas, strategy, dtype.size)
    # Each variable this replica sends is read once per exchange, not once per round: a
    # table over the whole-table cap is written by row scatters, which put it in
    # TensorFlow's copy-on-read mode, where every dense read copies the whole table (a
    # 256 MB table sent in 32 rounds was copied 32 times a step, issue 41).
    flat = {}

    def read(index):
        if index not in flat:
            flat[index] = tf.reshape(tf.cast(send[index].value, dtype), [-1])
        return flat[index]

    # A replica that sends nothing fills its row from the smallest variable (a bias, say),
    # never from one that could be the table.
    smallest = min((i for i in shapes if sizes[i]), key=lambda i: sizes[i], default=None)
    for plan in rounds:
        senders = [r for r in range(num_replicas) if plan.rows[r]]
        with tf.control_dependencies(previous):
            parts = [_segment(read(s.index), s, sizes[s.index]) for s in plan.rows[me]]
            if len(senders) == 1:
                # One owner sends this round (a table larger than the others' variables
                # together): a broadcast of its rows, with no filler from the others and
                # 1/N of an all-gather's output on each replica.
                row = replica_ops.broadcast_row(
                    (parts[0] if len(parts) == 1 else tf.concat(parts, axis=0))
                    if me == senders[0] else None, plan.width, dtype, strategy)
                rows = {senders[0]: row}
            else:
                if plan.padding(me):
                    source = parts[0] if parts else tf.convert_to_tensor(targets[smallest])
                    parts.append(_filler(plan.padding(me), source))
                rows = dict(enumerate(replica_ops.all_gather_rows(
                    parts[0] if len(parts) == 1 else tf.concat(parts, axis=0), strategy)))
        # The next round starts once this one is written (and, for a broadcast's sender,
        # sent: so it holds one round's rows at a time).
        previous = [rows[me]] if len(senders) == 1 and me == senders[0] else []
        for replica, row in rows.items():
            if replica == me and sources is None:
                continue
            for segment, piece in zip(plan.rows[replica], _pieces(row, plan.rows[replica],
                                                                  plan.width)):
                previous.append(_write(targets[segment.index], segment, piece,
                                       shapes[segment.index], rows_of[segment.index],
                                       segment.index in looked_up))
