"""Rows of a sharded exchange: many tensors laid out in flat rows, one row per replica.

Two layouts, both pure arithmetic on element counts:

* One padded row per replica (``row_width``, ``pack``, ``unpack``): a replica's tensors are
  flattened and concatenated in their given order, then padded with zeros to the row width,
  the largest row's element count (at least 1), so that every replica's row has the same
  shape and one collective moves them all; unpacking takes the same order and shapes back.
  Consolidation for saving uses it.
* Rounds (``owner_streams``, ``plan_rounds``): ShardedOptimizer's reduce-scatter and
  all-gather. Each replica's owned tensors, flattened and laid end to end, form its *stream*;
  each stream is cut into consecutive pieces of at most ``c`` elements, only between slices
  along a tensor's first axis (so a receiver can write a piece into rows of the variable in
  place), and round j moves every stream's j-th piece in one collective, padded to the widest.
  Why rounds: one exchange of all streams at once pads every row to the longest stream and
  holds the whole padded ``N x longest`` buffer (and the collective's output of the same size)
  at one time, which at N=8 cost more than sharding the optimizer state saves (docs/zero.md,
  "Peak memory"). In rounds a replica holds one round's rows at a time, about ``2 * N * c``
  elements, and the padding of short streams exists only in the last rounds.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["row_width", "pack", "unpack", "Segment", "Round", "owner_streams", "plan_rounds"]


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


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of the flattened tensor ``index`` (a key of the sizes)."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Round:
    """One collective of a round exchange: ``rows[r]`` are replica r's segments, in stream
    order, filling ``width`` elements but for ``padding(r)`` at the end."""

    width: int
    rows: tuple

    def padding(self, replica: int) -> int:
        return self.width - sum(s.size for s in self.rows[replica])


def owner_streams(sizes: Mapping[int, int], owners: Sequence[int], num_replicas: int,
                  rows: Mapping[int, int] | None = None) -> list[list[tuple[int, int, int]]]:
    """Each replica's stream: ``[(index, elements, row)]`` of the tensors it owns
    (``owners[index]``), highest index first: the last layers' gradients, which backprop
    produces first, lead. ``row`` is the element count of one slice along the first axis
    (``rows[index]``, default 1): rounds cut a tensor only between such slices. Pure.
    Tensors without elements are left out (there is nothing to move)."""
    rows = rows or {}
    streams: list[list[tuple[int, int, int]]] = [[] for _ in range(num_replicas)]
    for index in sorted(sizes, reverse=True):
        if sizes[index] > 0:
            streams[owners[index]].append((index, int(sizes[index]), max(1, int(rows.get(index, 1)))))
    return streams


def _cut(stream, round_elements: int) -> list[list[Segment]]:
    """One stream cut into consecutive rounds of at most ``round_elements`` elements, each
    cut between rows; a row larger than a round is a round of its own."""
    rounds, current, fill = [], [], 0
    for index, n, row in stream:
        position = 0
        while position < n:
            take = min((round_elements - fill) // row * row, n - position)
            if take == 0 and fill:  # the next row does not fit: close this round
                rounds.append(current)
                current, fill = [], 0
                continue
            take = take or row
            current.append(Segment(index, position, position + take))
            fill += take
            position += take
            if fill >= round_elements:
                rounds.append(current)
                current, fill = [], 0
    if current:
        rounds.append(current)
    return rounds


def plan_rounds(streams: Sequence[Sequence[tuple[int, int, int]]],
                round_elements: int) -> list[Round]:
    """The rounds that move ``streams`` in rows of about ``round_elements`` elements. Pure.

    Each stream is cut on its own into consecutive pieces of at most ``c = max(1,
    round_elements)`` elements, between rows of its tensors (a row larger than ``c`` alone);
    round j carries every stream's j-th piece, and is as wide as the widest of them. No
    rounds when every stream is empty.
    """
    c = max(1, int(round_elements))
    cuts = [_cut(stream, c) for stream in streams]
    count = max((len(cut) for cut in cuts), default=0)
    rounds = []
    for j in range(count):
        rows = tuple(tuple(cut[j]) if j < len(cut) else () for cut in cuts)
        width = max(sum(s.size for s in row) for row in rows)
        rounds.append(Round(width, rows))
    return rounds
