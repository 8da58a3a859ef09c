"""Horovod's process queries (``init``, ``rank``, ``size``, ``local_rank``, ...) on tfdp.

Rule: ``init()`` reads where this process sits in the job and nothing else: it does not
start TensorFlow's runtime, so that a Horovod script may still pin its GPU after it
(``tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")``). The cluster comes from
``tfdp.ClusterConfig.from_env()`` (``TF_CONFIG``, which ``tfdp-run`` sets; Slurm, SageMaker,
Vertex AI too): rank = ``cluster.rank``, size = ``cluster.num_workers``. The local and
cross ranks follow Horovod's definitions from the hosts of the worker addresses (rank
order), one rule in ``tfdp.cluster.placement`` that also gives the ``HOROVOD_*`` variables
tfdp-run sets.

With several processes ``init()`` also sets TensorFlow's eager context up (without starting
it) to join the job's collective runtime when it starts: TensorFlow joins one only at
startup, so ``init()`` must come before the script's first tensor, model or dataset (as in
every Horovod script), and says so otherwise.

The collective engine, one ``tfdp.DataParallelStrategy`` over one local device (the first
visible GPU, else ``CPU:0``), is built at the first collective (``engine()``), once the
script has chosen its devices. Building it joins the job's collective runtime: every
process must reach its first collective (``tfdp-run --start-timeout``).

One GPU per process (``local_gpus``). Several processes on one host that each see every GPU
would all compute on GPU 0 (and NCCL refuses two ranks on one GPU). So ``init()``, when this
process shares its host and the script has not chosen its GPUs yet, makes visible only the GPU
of its local rank, what Horovod's scripts do themselves with
``tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")``: the script's own call then
picks the same GPU, and a script that picks another one wins (it runs later). With fewer GPUs
than processes on the host, local rank ``l`` takes GPU ``l % GPUs``; where processes then
share a GPU, the engine uses ring collectives and says so.
"""

from __future__ import annotations

import logging
import threading

from tfdp import process_state
from tfdp.cluster import ClusterConfig
from tfdp.cluster.gpus import local_gpus
from tfdp.cluster.placement import Placement, placement  # the rule's home

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported",
           "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built", "engine", "state",
           "NOT_INITIALIZED", "local_gpus"]

log = logging.getLogger("tfdp")

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.placement: Placement | None = None
        self.cluster: ClusterConfig | None = None
        self.strategy = None
        self.joined: ClusterConfig | None = None  # the job TensorFlow's context is set to join


state = _State()


def init(comm=None, process_sets=None):
    """Reads the job's layout (no TensorFlow runtime is started). Idempotent.

    Args:
        comm: Horovod's MPI communicator (or list of ranks); only None is supported: the
            job is every process ``tfdp-run`` (or the cluster) started.
        process_sets: only None (the global set) is supported.
    """
    if comm is not None:
        raise NotImplementedError(
            "tfdp.horovod.init(comm=...): tfdp has no MPI; every process of the job (as "
            "tfdp-run or TF_CONFIG lists them) takes part. Call hvd.init().")
    if process_sets not in (None, [], ()):
        raise NotImplementedError(
            "tfdp.horovod: process sets are not supported; every collective spans all ranks.")
    with state.lock:
        if state.placement is not None:
            return
        cluster = ClusterConfig.from_env()
        if state.strategy is not None and state.strategy.cluster != cluster:
            raise RuntimeError(
                "tfdp.horovod.init(): this process's collective engine was built for another "
                f"job ({state.strategy.cluster.describe()}); a process joins one job.")
        if cluster.is_multi_worker and state.strategy is None and state.joined != cluster:
            _join_at_startup(cluster)
            state.joined = cluster
        state.cluster = cluster
        state.placement = placement(cluster)
        if cluster.is_multi_worker and state.strategy is None:
            _pin_local_gpu(state.placement)


def _join_at_startup(cluster: ClusterConfig) -> None:
    """Sets TensorFlow's context up to join the job's collective runtime when it starts
    (without starting it): the engine, built later, needs that done before the first op."""
    from tfdp import _tf_private
    if _tf_private.eager_context_initialized():
        raise RuntimeError(
            "tfdp.horovod.init() must come before TensorFlow's runtime starts (before the "
            "first tensor, model or dataset of the script): TensorFlow can join a "
            "multi-worker collective runtime only at startup. Move hvd.init() to the top "
            "of the script, right after the imports.")
    _tf_private.preconfigure_collective_runtime(
        {k: list(v) for k, v in cluster.cluster_spec.items()}, cluster.task_type,
        cluster.task_index)


def _pin_local_gpu(p: Placement) -> None:
    """Makes only this process's GPU visible (the module docstring, "One GPU per process")."""
    from tfdp import _tf_private
    if p.local_size < 2 or _tf_private.eager_context_initialized():
        return
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus or tf.config.get_visible_devices("GPU") != gpus:
        return  # no GPU, or the script chose already
    (position,) = local_gpus(p.local_rank, p.local_size, len(gpus), per_process=1)
    tf.config.set_visible_devices([gpus[position]], "GPU")
    # Whether processes then share a GPU is for the engine to say: it compares every worker's
    # GPU identity (CUDA_VISIBLE_DEVICES may give each process different GPUs).
    log.info("tfdp.horovod: rank %d (local rank %d of %d on this host) uses %s, GPU %d of "
             "the %d it sees", p.rank, p.local_rank, p.local_size, gpus[position].name,
             position, len(gpus))


def shutdown():
    """Forgets the layout; the collective engine, once built, stays (TensorFlow's collective
    runtime cannot be torn down in a process), and a later ``init()`` reuses it."""
    with state.lock:
        state.placement = None


def is_initialized() -> bool:
    return state.placement is not None


def initialized_placement() -> Placement:
    """This process's place in the job; ValueError (Horovod's message) before ``hvd.init()``,
    so a call that needs ``init`` first fails as Horovod's does."""
    p = state.placement
    if p is None:
        raise ValueError(NOT_INITIALIZED)
    return p


def _query(name: str, field: str, doc: str):
    """``hvd.<name>()``: this process's ``Placement.<field>`` (ValueError before ``init``)."""
    def query():
        return getattr(initialized_placement(), field)

    query.__name__ = query.__qualname__ = name
    query.__doc__ = doc
    return query


size = _query("size", "size", "Processes in the job.")
rank = _query("rank", "rank", "This process's rank (0 is the chief).")
local_rank = _query("local_rank", "local_rank", "This process's rank among those of its host.")
local_size = _query("local_size", "local_size", "Processes on this process's host.")
cross_rank = _query("cross_rank", "cross_rank", "This host's rank among the hosts.")
cross_size = _query("cross_size", "cross_size", "Hosts with a process of this local rank.")
is_homogeneous = _query("is_homogeneous", "homogeneous",
                        "Whether every host runs as many processes.")


# Build queries, answered honestly: tfdp uses TensorFlow's collective runtime (gRPC ring
# collectives, NCCL on GPUs), never MPI, Gloo, DDL or oneCCL.
def mpi_threads_supported() -> bool:
    initialized_placement()
    return False


def _never(name: str, what: str):
    """A build query that answers False: tfdp never runs ``what``."""
    def query() -> bool:
        return False

    query.__name__ = query.__qualname__ = name
    query.__doc__ = f"False: tfdp never uses {what}."
    return query


mpi_enabled, mpi_built = _never("mpi_enabled", "MPI"), _never("mpi_built", "MPI")
gloo_enabled, gloo_built = _never("gloo_enabled", "Gloo"), _never("gloo_built", "Gloo")
ddl_built, ccl_built = _never("ddl_built", "IBM DDL"), _never("ccl_built", "oneCCL")
rocm_built = _never("rocm_built", "ROCm (this TensorFlow build is CUDA or CPU)")


def cuda_built() -> bool:
    """Whether this TensorFlow is built with CUDA."""
    import tensorflow as tf
    return bool(tf.test.is_built_with_cuda())


def nccl_built() -> bool:
    """Whether NCCL collectives are available (TensorFlow built with CUDA)."""
    return cuda_built()


def engine():
    """The collective engine (a ``tfdp.DataParallelStrategy`` over one local device), built
    at the first call, after ``init()``."""
    initialized_placement()
    if state.strategy is not None:
        return state.strategy
    with state.lock:
        if state.strategy is None:
            import tensorflow as tf
            import tfdp
            gpus = tf.config.list_logical_devices("GPU")
            device = gpus[0].name if gpus else "/device:CPU:0"
            # The engine keeps the collective server init() set TensorFlow's context up to run
            # (tfdp._tf_private.reuse_running_collective_server): nothing is re-applied.
            state.strategy = tfdp.DataParallelStrategy(devices=[device], cluster=state.cluster)
        return state.strategy


def _forget_layout() -> None:
    with state.lock:
        # The engine and the joined runtime are TensorFlow's for the life of the process
        # (``shutdown``'s rule); the layout is forgotten, as hvd.shutdown() does.
        state.placement = None


process_state.register("horovod layout", __name__, lambda: state.placement is not None,
                       _forget_layout)
