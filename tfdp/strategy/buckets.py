"""Which gradients share a collective: the bucket plan (pure).

Rule: gradients of one dtype are flattened and concatenated into buckets of about
``bucket_bytes`` (a bucket closes once it reaches the size, so one large tensor is one
bucket), and each bucket is one collective. ``bucket_bytes=0`` means one collective per
tensor. Fewer, larger collectives amortise the per-collective latency that dominates small
models; smaller buckets start communicating earlier on large ones. A gradient that fits in
one bucket is one fused collective; a larger one gets a small first bucket
(``options.DEFAULT_FIRST_BUCKET_BYTES``), as PyTorch DDP does.

The plan is a pure function of sizes and dtypes, tested without TensorFlow; packing and
launching the buckets is ``collectives.all_reduce_gradients``.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["plan_buckets"]


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
