"""Pure formulas used by the benchmark tools (no flags, no TensorFlow): importable by tests."""

from __future__ import annotations


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: busbw = algbw * factor.

    all-reduce: 2(n-1)/n; reduce-scatter and all-gather: (n-1)/n.
    """
    return 2 * (n - 1) / n if op.endswith("all_reduce") else (n - 1) / n


def ring_allreduce_seconds(n: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``n`` workers (alpha-beta model):
    2(n-1) latency hops plus 2(n-1)/n of the bytes over each link."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth


def efficiency(compute: float, comm: float, overlap: float) -> float:
    """Weak-scaling efficiency when communication can hide behind ``overlap`` x compute."""
    return compute / (compute + max(0.0, comm - overlap * compute))
