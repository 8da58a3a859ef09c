"""The step's timeline as the graph and the host see it: when collectives wait, when a batch
is in hand.

Rule. While a listener (``tfdp.resilience.stragglers.StepTimer``) listens, every collective
traced into a step is timed on its worker: a graph timestamp when its input is ready and one
when its result is, handed to the host by one ``tf.numpy_function`` off the critical path
(``install_collective_timing``: a patch of TensorFlow's collective ops, through
``tfdp._tf_private``); a train step stamps when its batch is in hand
(``mark_batch_in_hand``); waits measured on the host (an ``Agreement``) are reported with
``note_wait``. With no listener nothing is timed and the ops are TensorFlow's own. What the
times mean, and who is slow, is ``tfdp.resilience.stragglers``'s.

Imports no TensorFlow until a step is traced.
"""

from __future__ import annotations

import threading

from tfdp import process_state

__all__ = ["listen", "stop_listening", "listening", "note_wait", "install_collective_timing",
           "mark_batch_in_hand", "collectives_executed"]

_listeners: list = []
_listeners_lock = threading.Lock()


def _record_wait(start, end):
    for timer in list(_listeners):
        timer.add_wait(float(start), float(end))


def _record_batch(stamp):
    for timer in list(_listeners):
        timer.add_batch(float(stamp))


_executed = [0]


def _record_collective(start, end):
    _executed[0] += 1  # numpy_function calls hold the GIL
    _record_wait(start, end)


def collectives_executed() -> int:
    """How many timed collectives this process has run (each local replica's count): those
    of steps traced while a ``StepTimer`` listened. Tests count a step's collectives with it."""
    return _executed[0]


def note_wait(start: float, end: float) -> None:
    """Records that this worker waited for the others from ``start`` to ``end`` (wall clock,
    seconds), e.g. in an agreement run from the host. A no-op unless a ``StepTimer`` listens."""
    _record_wait(start, end)


def _independent(tensor_or_op):
    """Keeps a timing op out of tf.function's program-order chain (which would deadlock
    replicas of one worker: ``_tf_private.run_independently``); returns it."""
    from tfdp import _tf_private

    _tf_private.run_independently(getattr(tensor_or_op, "op", tensor_or_op))
    return tensor_or_op


def _stamp():
    import tensorflow as tf

    return _independent(tf.timestamp())


def _host_call(fn, stamps):
    import tensorflow as tf

    # With no outputs, numpy_function returns its op.
    _independent(tf.numpy_function(lambda *values: fn(*values) or (), stamps, [],
                                   stateful=True, name="tfdp_step_timing"))


def _timed(original):
    """A TensorFlow collective-op function that also times the collective (see the rules)."""
    import tensorflow as tf

    from tfdp import _tf_private

    def collective(t, *args, **kwargs):
        if (not _listeners or tf.executing_eagerly()
                or _tf_private.in_xla_context(tf.compat.v1.get_default_graph())):
            return original(t, *args, **kwargs)
        with tf.device("/device:CPU:0"):  # merged with the collective's job and task
            with tf.control_dependencies([t]):
                start = _stamp()
        with tf.control_dependencies([start]):
            t = tf.identity(t)
        out = original(t, *args, **kwargs)
        with tf.device("/device:CPU:0"):
            with tf.control_dependencies([out]):
                done = _stamp()
            _host_call(_record_collective, [start, done])
        return out

    return collective


def install_collective_timing() -> None:
    """Times every collective traced while a ``StepTimer`` listens (once per process)."""
    from tfdp import _tf_private

    _tf_private.patch_collective_ops(_timed)


def mark_batch_in_hand(data):
    """In a train step: records when the replica's batch ``data`` is ready (for ``input``)."""
    import tensorflow as tf

    tensors = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
    if not _listeners or not tensors or tf.executing_eagerly():
        return
    with tf.device("/device:CPU:0"):
        with tf.control_dependencies(tensors):
            stamp = _stamp()
        _host_call(_record_batch, [stamp])


def listen(listener) -> None:
    """Sends the times to ``listener`` (``add_wait(start, end)``, ``add_batch(stamp)``)."""
    with _listeners_lock:
        if listener not in _listeners:
            _listeners.append(listener)


def stop_listening(listener) -> None:
    with _listeners_lock:
        if listener in _listeners:
            _listeners.remove(listener)


def is_listening(listener) -> bool:
    """Whether ``listener`` listens now."""
    with _listeners_lock:
        return listener in _listeners


def listening() -> bool:
    """Whether any listener listens (steps traced now are timed)."""
    return bool(_listeners)


def _forget_listeners() -> None:
    with _listeners_lock:
        _listeners.clear()


process_state.register("timing listeners", __name__, lambda: len(_listeners), _forget_listeners)
