"""Rows of a sharded exchange: many tensors packed into one flat, padded row per replica.

Rule. A replica's tensors are flattened and concatenated in their given order, then padded
with zeros to the row width, the largest row's element count (at least 1), so that every
replica's row has the same shape and one collective moves them all; unpacking takes the
same order and shapes back. ``ShardedOptimizer``'s reduce-scatter and all-gather and its
consolidation for saving both use these rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

__all__ = ["row_width", "pack", "unpack"]


def row_width(rows: Sequence[Sequence[int]]) -> int:
    """The padded row width for rows of tensors with these element counts (pure)."""
    return max(1, max((sum(row) for row in rows), default=0))


def pack(tensors, width: int, dtype) -> tf.Tensor:
    """``tensors`` flattened, cast to ``dtype``, concatenated and zero-padded to ``width``."""
    parts = [tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors]
    used = sum(int(p.shape[0]) for p in parts)
    parts.append(tf.zeros([width - used], dtype))
    return tf.concat(parts, axis=0)


def unpack(flat, shapes) -> list:
    """The tensors of one row (a tensor or a NumPy array), in order, with ``shapes``."""
    reshape = np.reshape if isinstance(flat, np.ndarray) else tf.reshape
    out, offset = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(reshape(flat[offset:offset + n], shape))
        offset += n
    return out
