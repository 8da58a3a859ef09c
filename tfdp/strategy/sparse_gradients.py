"""Sparse gradients (``tf.IndexedSlices``) reduced into the form one device builds them.

Why the form matters. TensorFlow's gradient of a lookup (``Embedding``, ``tf.gather``) has one
row per id looked up, in order; rows at the same index are not summed. Keras's optimizers
work on those rows as they come: Adam, Adagrad, RMSprop... square each row before the rows
are added into the table (two rows [1, 0] give Adam's ``v`` 0.002 where one row [2, 0]
gives 0.004), and ``clipnorm``/``global_clipnorm`` take the norm of the rows as they are.
So one device's result depends on the rows themselves, not only on their sum, and tfdp
promises one device's result.

What one device builds. Of a lookup whose ids carry the batch (token ids ``[b, L]``, an item
id per example), one device has one row per id of the global batch: the replicas' rows
concatenated in replica order, which is what TensorFlow's all-gather of IndexedSlices gives
(exact, as before). Of a lookup shared by the batch (ViT's position ids ``[1, P]``,
``arange(P)`` added to every example), one device has one row per id, summed over the whole
batch; each replica holds the same ids with its own partial sums, so the replicas' rows
must be summed position by position (an all-reduce of the values) instead: concatenating them
gives N rows per position and made Adam end 2e-2 off one device (issue 41). Summing every
duplicate index instead (coalescing) is not a fix: it changes per-example lookups, where one
device keeps a row per occurrence (measured: 2e-2 off under Adam as well).

Rule (``lookup_kind``, pure). A gradient's rows come from one or more lookups (a table used
twice has its pieces concatenated), found in the graph TensorFlow's gradient functions build
(``_tf_private.lookup_ids``). A lookup is per example when its ids have rank >= 1 and their
leading dimension is the per-replica batch ``b`` (``replica_batch.py``: the leading dimension
of the first tensor given to ``strategy.run``, which is Keras's batch), or is unknown at
trace time; it is shared when its ids are a scalar, or their leading dimension is known and
is not ``b``, or is known while ``b`` is not (a static dimension cannot be a batch of unknown
size). The decision is taken at trace time from static shapes, the same in every replica
and every worker, so the collectives match everywhere. Pieces are reduced separately and
laid end to end in their order: exactly the rows, and the order, one device has.

Where one device's form cannot be known, TensorFlow's reduction (the all-gather) is kept,
which is exact for per-example lookups: the gradient was not built by TensorFlow's gather
gradient in this graph (an eager step, rows computed by hand: logged once), no batch is known
(``strategy.run`` without a tensor argument), or the ids' leading dimension is unknown (a
shared lookup whose ids come from a dynamic sequence length: ``arange(tf.shape(x)[1])``). A
shared lookup whose leading dimension equals ``b`` by coincidence (position ids ``[1, P]`` at
one example per replica) is taken as per example, as random draws are (randomness.py).
"""

from __future__ import annotations

import logging
import threading
import weakref

import tensorflow as tf

from tfdp import _tf_private, said_once
from tfdp.strategy import replica_batch

__all__ = ["PER_EXAMPLE", "SHARED", "lookup_kind", "reduce_indexed_slices", "lookup_plans",
           "remember_plans", "elements_in_range"]

log = logging.getLogger("tfdp")

PER_EXAMPLE, SHARED = "per_example", "shared"
_NO_BATCH = object()


def lookup_kind(ids_shape, batch=_NO_BATCH) -> str:
    """``PER_EXAMPLE`` or ``SHARED`` for a lookup; pure policy (module docstring).

    Args:
        ids_shape: the lookup ids' static shape (a ``tf.TensorShape`` or a list with None for
            unknown dimensions; None or an unknown rank: not known).
        batch: the per-replica batch: an int where static, None where only known at run time,
            omitted (or ``lookup_kind.NO_BATCH``) where there is no batch to go by.
    """
    shape = tf.TensorShape(ids_shape)
    if shape.rank == 0:
        return SHARED
    if shape.rank is None or batch is _NO_BATCH or shape[0] is None:
        return PER_EXAMPLE
    if batch is None:
        return SHARED
    return PER_EXAMPLE if shape[0] == int(batch) else SHARED


lookup_kind.NO_BATCH = _NO_BATCH


def _static_batch(strategy=None):
    """This replica's batch for ``lookup_kind``: an int, None (known at run time only) or
    ``_NO_BATCH``."""
    here = replica_batch.current()
    if here is None or (strategy is not None and here[0] is not strategy) or here[1] is None:
        return _NO_BATCH
    batch = here[1]
    return batch if isinstance(batch, int) else None


def _size(ids):
    return ids.shape.num_elements() if ids.shape.is_fully_defined() else tf.size(ids)


def _graph_plan(slices, batch):
    """``[(kind, rows), ...]``, one entry per lookup behind ``slices`` (rows: an int, or a
    tensor where only known at run time), or None where the graph does not tell."""
    pieces = _tf_private.lookup_ids(slices)
    if pieces is None:
        return None
    return [(lookup_kind(ids.shape, batch), _size(ids)) for ids in pieces]


# --- Plans made where the gradients are computed (inside XLA's compiled function) ----------
# A gradient returned by a compiled function (xla.py) has lost its graph: its indices are an
# output of the call. The plan is made inside, where the graph is, with the pieces' row counts
# where static (None otherwise), and remembered for the gradient the call returns.
_remembered = weakref.WeakKeyDictionary()  # graph -> {id(indices): (indices, plan)}
_lock = threading.Lock()  # replicas trace in threads of their own


def lookup_plans(grads, strategy=None) -> list:
    """For each of ``grads``: the plan of a ``tf.IndexedSlices`` (``[(kind, rows or None)]``,
    one entry per lookup), else None. Call where the gradients are computed (a traced graph)."""
    batch = _static_batch(strategy)
    plans = []
    for g in grads:
        plan = _graph_plan(g, batch) if isinstance(g, tf.IndexedSlices) else None
        plans.append(None if plan is None else
                     [(kind, rows if isinstance(rows, int) else None) for kind, rows in plan])
    return plans


def remember_plans(grads, plans) -> None:
    """Notes ``lookup_plans``' plans for ``grads`` (the same gradients, returned by a call)."""
    for g, plan in zip(grads, plans or []):
        if plan is not None and isinstance(g, tf.IndexedSlices) and hasattr(g.indices, "graph"):
            with _lock:
                _remembered.setdefault(g.indices.graph, {})[id(g.indices)] = (g.indices, plan)


def _remembered_plan(slices):
    indices = slices.indices
    graph = getattr(indices, "graph", None)
    with _lock:
        entry = _remembered.get(graph, {}).get(id(indices)) if graph is not None else None
    return entry[1] if entry is not None and entry[0] is indices else None


def _with_rows(plan, slices):
    """``plan`` with a piece of run-time size given its rows (the rest of the gradient's);
    None where two pieces have run-time sizes (their boundary is not known here)."""
    unknown = [k for k, (_, rows) in enumerate(plan) if rows is None]
    if len(unknown) > 1:
        return None
    if unknown:
        known = sum(rows for _, rows in plan if rows is not None)
        plan = list(plan)
        plan[unknown[0]] = (plan[unknown[0]][0], tf.shape(slices.indices)[0] - known)
    return plan


def _plan(slices, batch):
    """``[(kind, rows), ...]`` for a gradient with a shared piece; None where TensorFlow's
    all-gather gives one device's form (every piece per example) or the form is not known."""
    plan = _remembered_plan(slices) or _graph_plan(slices, batch)
    if plan is not None and SHARED not in [kind for kind, _ in plan]:
        return None
    plan = None if plan is None else _with_rows(plan, slices)
    if plan is None:
        _warn_unknown(slices)
    return plan


def _warn_unknown(slices):
    shape = tf.get_static_value(slices.dense_shape)
    key = str(list(shape) if shape is not None else slices.values.shape)
    if not said_once.first_time("sparse gradients", key):
        return
    log.warning("tfdp: cannot tell which lookups the rows of a sparse gradient (of a %s table) "
                "come from; reduced by TensorFlow's all-gather, which is one device's result "
                "for per-example lookups (token ids) but not for a lookup shared by the batch "
                "under optimizers that square gradient rows (Adam, Adagrad...). See "
                "tfdp/strategy/sparse_gradients.py.", key)


def _split(tensor, sizes):
    if len(sizes) == 1:
        return [tensor]
    if all(isinstance(s, int) for s in sizes):
        return tf.split(tensor, sizes, axis=0)
    return tf.split(tensor, tf.stack([tf.cast(s, tf.int32) for s in sizes]), axis=0,
                    num=len(sizes))


def _summable(values):
    """Values in a dtype the collectives sum exactly enough: 16-bit floats sum in float32."""
    return tf.cast(values, tf.float32) if values.dtype in (tf.float16, tf.bfloat16) else values


def reduce_indexed_slices(grads, strategy, options=None) -> list:
    """Each ``tf.IndexedSlices`` of ``grads`` summed over all replicas of all workers, in the
    form one device builds (module docstring). Call in a replica context of ``strategy``.

    Every gradient travels in one ``all_reduce`` call: per-example pieces (and whole
    gradients without a shared piece) as IndexedSlices (an all-gather), shared pieces as
    their dense values (an all-reduce of ``[ids, ...]`` rows, smaller than the all-gather).
    """
    ctx = tf.distribute.get_replica_context()
    grads = list(grads)
    if not grads:
        return []
    batch = _static_batch(strategy)
    inputs, layout = [], []  # layout[i]: the input index of gradient i, or its pieces
    for g in grads:
        plan = _plan(g, batch)
        if plan is None:
            layout.append(len(inputs))
            inputs.append(g)
            continue
        sizes = [rows for _, rows in plan]
        parts = []
        for (kind, _), values, indices in zip(plan, _split(g.values, sizes),
                                              _split(g.indices, sizes)):
            parts.append((kind, len(inputs), indices))
            inputs.append(_summable(values) if kind == SHARED
                          else tf.IndexedSlices(values, indices, g.dense_shape))
        layout.append(parts)
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, inputs, options=options)
    out = []
    for g, parts in zip(grads, layout):
        if isinstance(parts, int):
            out.append(reduced[parts])
            continue
        values, indices = [], []
        for kind, k, local_indices in parts:
            if kind == SHARED:  # the same ids in every replica: this replica's indices
                values.append(tf.cast(reduced[k], g.values.dtype))
                indices.append(local_indices)
            else:
                values.append(tf.cast(reduced[k].values, g.values.dtype))
                indices.append(tf.cast(reduced[k].indices, g.indices.dtype))
        out.append(tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), g.dense_shape))
    return out


def elements_in_range(slices, width, start, size):
    """The elements of ``slices``' rows (each ``width`` elements) that fall in ``[start, start
    + size)`` of the flattened table, as a ``tf.IndexedSlices`` of a 1-D tensor of ``size``
    elements: one entry per element of every row, in row order, indices relative to
    ``start``; rows at one index are not added (ZeRO-3's slice of one device's sparse
    gradient, zero3/gradients.py). Elementwise rules (Adam's and Adagrad's squares, the
    squared norms of ``clipnorm`` and ``global_clipnorm``) give on these elements what they
    give on the rows. Only the rows that reach into the range are expanded to elements.
    ``width``, ``start`` and ``size`` are ints.
    """
    first = tf.cast(slices.indices, tf.int64) * width - start  # each row's first element, local
    reaches = tf.logical_and(first < size, first + width > 0)
    rows = tf.reshape(tf.where(reaches), [-1])
    first = tf.gather(first, rows)
    values = tf.gather(tf.reshape(slices.values, [-1, width]), rows)
    elements = first[:, None] + tf.range(width, dtype=tf.int64)[None, :]
    inside = tf.logical_and(elements >= 0, elements < size)
    dtype = tf.int32 if size < 2 ** 31 else tf.int64  # local indices: half the bytes
    return tf.IndexedSlices(tf.boolean_mask(values, inside),
                            tf.cast(tf.boolean_mask(elements, inside), dtype),
                            tf.constant([size], dtype))
