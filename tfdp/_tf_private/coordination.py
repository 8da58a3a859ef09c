"""TensorFlow's coordination service: the key-value store and barrier of a multi-worker job.

What lives here: publishing and reading a key (tfdp/strategy/devices.py's shared-GPU check),
whether this process takes part in a service, and waiting at a barrier
(tfdp/strategy/lifecycle.py's orderly exit), and making the eager context join a job's
collective runtime and coordination service before it starts (tfdp/horovod/_runtime.py:
``preconfigure_collective_runtime``). The service is the one MultiWorkerMirroredStrategy's
engine starts on the chief; TensorFlow exposes it only on the eager context. Each entry says why
no public API serves; tests/test_tf_private.py pins them.
"""

from __future__ import annotations

import copy as _copy

# Why: the orderly exit of a multi-worker job (strategy.py, "Orderly exit") waits at a
# barrier of TensorFlow's coordination service, the service MultiWorkerMirroredStrategy's
# engine starts on the chief for heartbeats and errors. TensorFlow exposes it only on the
# eager context (tf.experimental.dtensor's barrier uses the same call); there is no public
# barrier or shutdown for it.
from tensorflow.python.eager import context as tf_eager_context

# Why: MultiWorkerMirroredStrategy's engine configures the eager context's collective ops,
# coordination service and gRPC server in its constructor, which must run before the context
# initialises ("Collective ops must be configured at program startup"): a Horovod script
# creates its model (initialising the context) before its first collective. TensorFlow's
# public API has no call that configures collective ops without initialising the context
# (tf.config.experimental_connect_to_cluster initialises it, for remote eager, not
# collectives); these are the calls the engine itself makes, made earlier with the same
# arguments, so that its own later calls find them done.
from tensorflow.python.distribute import multi_worker_util as _multi_worker_util
from tensorflow.core.protobuf import tensorflow_server_pb2 as _server_pb2
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2 as _coordination_pb2

from tfdp._tf_private.core import get_private
from tfdp._tf_private.core import require_attributes as _require_attributes


# Why: the shared-GPU check of a multi-worker job (devices.py) needs every worker's host and
# GPUs before the first collective. The coordination service every worker already talks to
# has a key-value store (TensorFlow's preemption handling uses it); tf.distribute exposes no
# public exchange outside collectives, which would themselves fail on a shared GPU.
def publish_to_coordination_service(key: str, value: str) -> None:
    tf_eager_context.context().set_config_key_value(key, value)


def delete_from_coordination_service(key: str) -> None:
    """Removes ``key`` (no error when it is not there)."""
    try:
        tf_eager_context.context().delete_config_key_value(key)
    except Exception:  # tf.errors.OpError: already gone, or the service is
        pass


def read_from_coordination_service(key: str, timeout_seconds: float) -> str:
    """Blocks until ``key`` is set (at most ``timeout_seconds``; then a tf.errors.OpError)."""
    return tf_eager_context.context().get_config_key_value(
        key, max(1, int(timeout_seconds * 1000)))


def coordination_service_configured() -> bool:
    """True when this process takes part in a coordination service (multi-worker)."""
    return tf_eager_context.context().coordination_service is not None


def wait_at_coordination_barrier(barrier_id: str, timeout_seconds: float) -> None:
    """Blocks until every task of the job reaches ``barrier_id``.

    Raises a ``tf.errors.OpError`` when it times out or the service finds a task dead.
    """
    tf_eager_context.context().wait_at_barrier(barrier_id, max(1, int(timeout_seconds * 1000)))


# --- joining the collective runtime before the context starts (tfdp.horovod) ---------------
# (Why: see the imports above.)
# The eager context's methods preconfigure_collective_runtime calls (pinned by
# tests/test_horovod.py).
COLLECTIVE_RUNTIME_CONTEXT_METHODS = ("configure_collective_ops",
                                      "configure_coordination_service", "enable_collective_ops")
_USED_FOR = "joining a job's collective runtime before the eager context initialises"


def eager_context_initialized() -> bool:
    """Whether TensorFlow's eager context has started (devices fixed, runtime running)."""
    return get_private(tf_eager_context.context(), "_initialized", _USED_FOR)


def preconfigure_collective_runtime(cluster_spec: dict, task_type: str, task_id: int) -> None:
    """Makes the eager context join the job's collective runtime when it initialises.

    Makes, with the same arguments, the calls MultiWorkerMirroredStrategy's engine makes in
    ``_initialize_multi_worker`` (collective leader and device filters, the coordination
    service over the chief and workers, the server definition), without initialising the
    context. The engine's own calls later find them done (an identical configuration is
    accepted; the server the context started is kept: ``reuse_running_collective_server``).

    Args:
        cluster_spec: ``{"chief": [...], "worker": [...]}`` (the training ring).
        task_type, task_id: this process's task.

    Raises:
        RuntimeError: the context has initialised already.
    """
    context = tf_eager_context.context()
    _require_attributes(type(context), COLLECTIVE_RUNTIME_CONTEXT_METHODS, _USED_FOR)
    if eager_context_initialized():
        raise RuntimeError("TensorFlow's runtime has started already")
    spec = _multi_worker_util.normalize_cluster_spec(cluster_spec)
    context.configure_collective_ops(
        collective_leader=_multi_worker_util.collective_leader(spec, task_type, task_id),
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(f"/job:{task_type}/task:{task_id}",))
    if context.coordination_service is None:
        jobs = [_coordination_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
                for job in ("chief", "worker") if job in spec.jobs]
        context.configure_coordination_service(
            service_type="standalone",
            service_leader=_multi_worker_util.coordination_leader(spec),
            coordinated_jobs=jobs)
    server_def = _server_pb2.ServerDef(
        cluster=spec.as_cluster_def(), default_session_config=_copy.deepcopy(context.config),
        job_name=task_type, task_index=task_id, protocol="grpc", port=0)
    context.enable_collective_ops(server_def)


# --- one collective runtime per process (issue 40) ----------------------------------------

def reuse_running_collective_server(extended, cluster_resolver) -> bool:
    """Makes a collective strategy's engine, about to be built, keep the collective server
    this process already runs for the same task of the same cluster; returns whether it did.

    Why: MultiWorkerMirroredStrategy's engine (``_initialize_multi_worker``) calls
    ``context.enable_collective_ops(server_def)`` in every strategy's constructor unless the
    engine object says its server is started (``_std_server_started``, per engine, so never
    for a second strategy). On a running server that call is ``GrpcServer::UpdateServerDef``,
    which replaces the process's collective executor manager, group and instance resolver
    included. Each worker does it when it builds its strategy; a peer that builds its own
    first and registers a new group with this process (the leader) before this process
    rebuilds has registered it with the resolver that is thrown away: the leader's new
    resolver waits for that peer forever, and the peer for the leader (issue 40's hangs:
    a strategy rebuilt in one process, and Horovod's engine built after the context started).
    Nothing is lost by keeping the running manager: each tfdp strategy has its own
    collective-key range (``set_collective_key_base``). The engine's health-check thread is
    off as the engine itself turns it off when the coordination service runs. No public API
    says whether, or for what, the context's collective server runs.

    Args:
        extended: the engine object, before ``CollectiveAllReduceExtended.__init__``.
        cluster_resolver: the resolver it is built with.
    """
    spec = cluster_resolver.cluster_spec()
    if not spec.as_dict():
        return False  # a single process: no server
    context = tf_eager_context.context()
    if not eager_context_initialized():
        return False  # the engine's call only records the definition: nothing is replaced
    running = get_private(context, "_collective_ops_server_def", "reusing the collective server")
    if (running is None or running.cluster != spec.as_cluster_def()
            or running.job_name != cluster_resolver.task_type
            or running.task_index != cluster_resolver.task_id):
        return False  # none, or another job's: TensorFlow's own path
    extended._std_server_started = True
    extended._enable_check_health = not coordination_service_configured()
    return True
