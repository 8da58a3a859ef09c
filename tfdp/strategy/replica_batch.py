"""The tfdp replica function running in this thread: its strategy and its per-replica batch.

Rule: inside ``strategy.run`` of a tfdp strategy (``randomness.replica_function`` wraps the
replica function), the per-replica batch ``b`` is the leading dimension of the first tensor of
rank >= 1 in the arguments (Keras's ``fit`` passes the batch first): an int where static, else
a scalar tensor. Two mechanisms decide by it whether a tensor is per example (leading
dimension ``b``) or shared by the batch: random draws (``randomness.py``) and sparse gradients
(``sparse_gradients.py``). This module holds only that knowledge, so both can read it without
importing each other.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

__all__ = ["leading_batch_size", "running", "current"]

_replica = threading.local()  # replicas trace their steps in threads of their own


def leading_batch_size(args, kwargs):
    """The leading dimension of the first tensor of rank >= 1 in ``args``/``kwargs``: an int
    where it is static, else a scalar tensor; None when there is none."""
    for value in tf.nest.flatten((args, kwargs or {})):
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return value.shape[0] if value.shape[0] is not None else tf.shape(value)[0]
    return None


@contextlib.contextmanager
def running(strategy, batch):
    """While the replica function of ``strategy`` with per-replica ``batch`` runs here."""
    stack = getattr(_replica, "stack", None)
    if stack is None:
        stack = _replica.stack = []
    stack.append((strategy, batch))
    try:
        yield
    finally:
        stack.pop()


def current():
    """``(strategy, batch)`` of the tfdp replica function running in this thread, or None
    outside one, with one replica, or when another strategy's replica context is current."""
    stack = getattr(_replica, "stack", None)
    if not stack:
        return None
    strategy, batch = stack[-1]
    context = tf.distribute.get_replica_context()
    if context is None or context.strategy is not strategy or strategy.num_replicas_in_sync < 2:
        return None
    return strategy, batch
