"""What a tensor travels and is summed in: the dtype rule, compression, collective options.

Rule: every collective tfdp launches (gradient buckets, ShardedOptimizer's rows, sparse
gradients, ``strategy.reduce``) takes its dtype and its options from here, so they agree on
what TensorFlow can sum and on the strategy's timeout and implementation. Nothing here
launches a collective, and nothing of tfdp's is imported but ``_tf_private``: every module that
does launch one can import this one.

Dtype rule (``reduce_dtype``): TensorFlow 2.21's collective executor sums only some dtypes;
the others are summed in a wider dtype that holds every value exactly, and cast back.

Compression (``"fp16"``/``"bf16"``, ``to_wire``): floating tensors are cast to that dtype for
the collective and back to their own dtype afterwards, halving bytes on the wire. The ring
sum itself runs in the wire dtype, so the result carries that dtype's rounding error (fp16:
~1e-3 relative; bf16: ~1e-2); gradients in Keras are already divided by the replica count,
which keeps fp16 sums far from overflow in practice.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private

__all__ = ["COMPRESSION_DTYPES", "reduce_dtype", "to_wire", "collective_options"]

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


def to_wire(x, compression):
    """``x`` in the wire dtype of ``compression`` (floating tensors only)."""
    wire = COMPRESSION_DTYPES[compression]
    if wire is None or not x.dtype.is_floating or x.dtype == wire:
        return x
    return tf.cast(x, wire)


def collective_options(strategy, bytes_per_pack=None):
    """The strategy's CommunicationOptions (timeout, implementation), with ``bytes_per_pack``
    replaced where given."""
    base = _tf_private.communication_options(strategy.extended)  # the strategy's defaults
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=base.bytes_per_pack if bytes_per_pack is None else bytes_per_pack,
        timeout_seconds=base.timeout_seconds,
        implementation=base.implementation,
    )
