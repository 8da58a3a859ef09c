"""TensorFlow's coordination service: the key-value store and barrier of a multi-worker job.

What lives here: publishing and reading a key (tfdp/strategy/devices.py's shared-GPU check),
whether this process takes part in a service, and waiting at a barrier
(tfdp/strategy/lifecycle.py's orderly exit). The service is the one MultiWorkerMirroredStrategy's
engine starts on the chief; TensorFlow exposes it only on the eager context. Each entry says why
no public API serves; tests/test_tf_private.py pins them.
"""

from __future__ import annotations

# Why: the orderly exit of a multi-worker job (strategy.py, "Orderly exit") waits at a
# barrier of TensorFlow's coordination service, the service MultiWorkerMirroredStrategy's
# engine starts on the chief for heartbeats and errors. TensorFlow exposes it only on the
# eager context (tf.experimental.dtensor's barrier uses the same call); there is no public
# barrier or shutdown for it.
from tensorflow.python.eager import context as _eager_context


# Why: the shared-GPU check of a multi-worker job (devices.py) needs every worker's host and
# GPUs before the first collective. The coordination service every worker already talks to
# has a key-value store (TensorFlow's preemption handling uses it); tf.distribute exposes no
# public exchange outside collectives, which would themselves fail on a shared GPU.
def publish_to_coordination_service(key: str, value: str) -> None:
    _eager_context.context().set_config_key_value(key, value)


def read_from_coordination_service(key: str, timeout_seconds: float) -> str:
    """Blocks until ``key`` is set (at most ``timeout_seconds``; then a tf.errors.OpError)."""
    return _eager_context.context().get_config_key_value(
        key, max(1, int(timeout_seconds * 1000)))


def coordination_service_configured() -> bool:
    """True when this process takes part in a coordination service (multi-worker)."""
    return _eager_context.context().coordination_service is not None


def wait_at_coordination_barrier(barrier_id: str, timeout_seconds: float) -> None:
    """Blocks until every task of the job reaches ``barrier_id``.

    Raises a ``tf.errors.OpError`` when it times out or the service finds a task dead.
    """
    _eager_context.context().wait_at_barrier(barrier_id, max(1, int(timeout_seconds * 1000)))
