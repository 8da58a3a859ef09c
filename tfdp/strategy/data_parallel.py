"""DataParallelStrategy: picks devices, cluster and communication.

A real ``tf.distribute.Strategy`` built on TensorFlow's collective runtime (the engine of
MultiWorkerMirroredStrategy), so one class covers one device, many local devices, and
many workers from ``TF_CONFIG``. What tfdp adds on top:

* local replicas are all GPUs, else all logical CPU devices (the stock multi-worker
  strategy uses only CPU:0 on a CPU host);
* gradients are reduced *before* clipping, in buckets, optionally compressed on the wire
  (see collectives.py);
* ``reduce`` accepts nests and scalar per-replica values, which Keras 3 passes and the
  stock multi-worker strategy rejects (keras-team/keras#20585);
* every instance gets its own collective-key range, so several strategies can live in one
  process (the stock strategies reuse keys and the second ``fit`` fails);
* a finite default collective timeout across workers, so a dead peer is an error, not a
  hang;
* XLA works under the strategy (``tfdp.xla``): ``model.compile(jit_compile=True)``
  compiles each replica's forward/backward and keeps the reduction outside, and
  ``jit_compile="auto"`` resolves as Keras would on one device (on for GPUs);
  ``tf.function(jit_compile=True)`` around ``strategy.run`` itself, which XLA cannot compile
  with several CPU replicas or several local GPUs, is refused at trace time with one clear
  error (``jit_compile_error``) pointing to ``tfdp.compile_gradients``;
* values TensorFlow's collectives cannot sum on the replicas' devices (int32 labels on
  GPUs, bool flags anywhere) are reduced in a dtype they can (``collectives.reduce_dtype``);
* replicas that share a physical GPU (logical GPUs, or workers of one host) are detected
  before the first collective: ``"auto"`` then uses ring collectives, ``"nccl"`` is an error
  (``devices.shared_gpu``);
* workers of a multi-worker job leave together (``tfdp.orderly_exit``), so a job that
  succeeded prints no coordination-service errors from a worker that outlived the chief;
* SIGTERM keeps the meaning the script gave it (by default: terminate), which TensorFlow's
  coordination service takes over when a worker joins (``take_back_sigterm``).

The orderly exit lives in ``tfdp.orderly_exit``; its names stay importable from here.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import chief_writes
from tfdp.strategy import collectives
from tfdp.strategy import consensus
from tfdp.strategy import deadline
from tfdp.strategy import lifecycle as orderly_exit
from tfdp.strategy import xla
from tfdp.strategy import devices as devices_lib
from tfdp.strategy.lifecycle import (CHIEF_EXIT_DRAIN_SECONDS, ORDERLY_EXIT_ENV,  # noqa: F401
                               _wait_until_gone, leave_together_at_exit)  # (tests, earlier releases)
from tfdp.cluster import ClusterConfig
from tfdp.protocol import READY_FILE_ENV

__all__ = ["DataParallelStrategy", "resolve_communication", "jit_compile_error",
           "leave_together_at_exit", "DEFAULT_BUCKET_BYTES",
           "DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS", "ORDERLY_EXIT_ENV", "CHIEF_EXIT_DRAIN_SECONDS"]

log = logging.getLogger("tfdp")

COMMUNICATIONS = ("auto", "nccl", "ring")
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
# A collective waits at most this long for its peers when there are several workers. Long
# enough for a chief writing a checkpoint or a slow first trace, short enough that a hung
# peer ends the job within minutes. Single-process jobs need none: local devices cannot
# die separately.
DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS = 300.0

# Collective keys: TensorFlow's own strategies start at 0; each tfdp strategy in a process
# gets its own range. Workers that create strategies in the same order agree on the keys.
_KEY_RANGE = 1_000_000
_key_bases = itertools.count(1)



def resolve_communication(requested: str, device_type: str, shared=None) -> str:
    """Returns the collective implementation that will run: ``"nccl"`` or ``"ring"``.

    Args:
        requested: ``"auto"`` (NCCL on GPUs, ring elsewhere), ``"nccl"`` or ``"ring"``.
        device_type: ``"GPU"``, ``"CPU"`` or ``"TPU"``, the type of the local replicas.
        shared: a ``devices.SharedGPU`` when two replicas use one physical GPU (NCCL
            refuses two ranks on one device): "auto" then picks ring, "nccl" is an error.
    """
    if requested not in COMMUNICATIONS:
        raise ValueError(
            f"communication={requested!r} is not one of {COMMUNICATIONS}. Use 'auto' to let "
            "tfdp pick NCCL on GPUs and ring collectives elsewhere.")
    if requested == "nccl" and device_type != "GPU":
        raise ValueError(
            f"communication='nccl' needs GPUs, but the replicas are {device_type} devices "
            "(NCCL has no CPU kernel). Use communication='ring' or 'auto' on this host.")
    if requested == "nccl" and shared is not None:
        raise ValueError(
            f"communication='nccl' cannot run: {describe_shared_gpu(shared)}, and NCCL refuses "
            "two ranks on one GPU (TensorFlow would fail at the first collective with 'NCCL: "
            "invalid usage'). Fix: communication='auto' or 'ring' (ring collectives work on "
            "a shared GPU), or give each replica its own GPU (one logical device per "
            "physical GPU; CUDA_VISIBLE_DEVICES set per worker on a shared host).")
    if requested == "auto":
        return "nccl" if device_type == "GPU" and shared is None else "ring"
    return requested


_said_shared = set()


def _say_shared_gpu_once(requested, shared):
    """Logs once per shared GPU why "auto" picked ring collectives."""
    if shared is None or requested != "auto" or shared in _said_shared:
        return
    _said_shared.add(shared)
    log.warning("tfdp: %s; NCCL refuses two ranks on one GPU, so communication='auto' uses "
                "ring collectives.", describe_shared_gpu(shared))


def _check_compression(compression, device_type):
    if compression == "bf16" and device_type == "GPU":
        raise ValueError(
            "compression='bf16' cannot run on GPUs: TensorFlow's collectives do not sum "
            "bfloat16 on GPUs ('Collective all-reduce does not support datatype DT_BFLOAT16 "
            "on DEVICE_GPU'), with NCCL or ring. Use compression='fp16' (same wire size) or "
            "None.")


def describe_shared_gpu(shared) -> str:
    """One line naming a shared GPU and the replicas on it (``devices.SharedGPU``)."""
    who = ", ".join(f"worker {w} replica {r}" for w, r in shared.replicas)
    return f"GPU {shared.gpu!r} of host {shared.host!r} holds several replicas ({who})"


def jit_compile_error(device_type: str, num_replicas_in_sync: int,
                      num_local_replicas: int = 1) -> str | None:
    """The error for ``strategy.run`` traced inside an XLA-compiled function, or None.

    Pure policy. XLA cannot compile TensorFlow's cross-replica collectives on CPUs (measured
    with TF 2.21: ``InvalidArgumentError: Graph execution error`` at the first step, under
    MirroredStrategy too), nor a step spanning several GPUs of one process (measured on an
    H100 with two logical GPUs: ``Trying to access resource .../replica_1/... located in
    device GPU:1``). One replica has no collective to compile and works; one GPU per worker
    is left to TensorFlow, which compiles GPU collectives itself (not verified: no GPU
    cluster). ``model.fit`` never gets here: tfdp.xla compiles only each replica's part.

    Args:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``, the type of the local replicas.
        num_replicas_in_sync: replicas over all workers.
        num_local_replicas: replicas in this process.
    """
    if num_replicas_in_sync <= 1 or (device_type != "CPU" and num_local_replicas <= 1):
        return None
    if device_type == "CPU":
        what = f"{num_replicas_in_sync} CPU replicas"
        why = ("XLA on CPU cannot compile the cross-replica collectives (gradient all-reduce, "
               "metric sums) that every distributed step contains")
    else:
        what = f"{num_local_replicas} {device_type} replicas in one process"
        why = ("XLA cannot compile one step over several GPUs of one process (TensorFlow fails "
               "with 'Trying to access resource .../replica_1/... located in device')")
    return (
        f"jit_compile=True cannot compile a step of {what}: {why}, so TensorFlow would fail "
        "at the first step with an opaque error. Fix: compile only each replica's "
        "forward/backward, with tfdp.compile_gradients(loss_fn, variables) inside "
        "strategy.run and the optimizer update outside it (model.fit does this by itself "
        "with jit_compile=True); or call strategy.run outside tf.function(jit_compile=True); "
        "or use jit_compile=False (or jit_compile='auto'); with one replica, "
        "jit_compile=True around strategy.run works.")


def _resolve_devices(requested):
    """Validates user-given local device names; returns (canonical names, device type)."""
    if requested is None:
        return devices_lib.local_devices()
    if isinstance(requested, str):
        requested = [requested]
    requested = list(requested)
    if not requested:
        raise ValueError("devices=[] names no device; pass None for all local devices.")
    available = {(t, i): f"/device:{t}:{i}"
                 for t, n in devices_lib.available_devices().items() for i in range(n)}
    names, types = [], set()
    for name in requested:
        spec = tf.DeviceSpec.from_string(name)
        if spec.job or spec.task is not None:
            raise ValueError(
                f"device {name!r} names a job/task; list only local devices such as "
                "'/device:CPU:1' (workers come from TF_CONFIG).")
        key = ((spec.device_type or "").upper(), spec.device_index)
        if key not in available:
            have = ", ".join(sorted(available.values())) or "none"
            raise ValueError(
                f"device {name!r} does not exist on this host (available: {have}). For "
                "several CPU replicas call tfdp.configure_cpu_replicas(n) before anything "
                "else.")
        names.append(available[key])
        types.add(key[0])
    if len(set(names)) != len(names):
        raise ValueError(f"devices={requested!r} lists a device twice.")
    if len(types) != 1:
        raise ValueError(f"devices={requested!r} mixes device types {sorted(types)}; use one type.")
    return names, types.pop()


def _resolve_cluster(cluster, cluster_resolver) -> ClusterConfig:
    """The job's ``ClusterConfig`` from ``cluster``, ``cluster_resolver`` or the environment."""
    if cluster is not None and cluster_resolver is not None:
        raise ValueError(
            "cluster= and cluster_resolver= were both given; pass one of them (a resolver is "
            "converted with tfdp.ClusterConfig.from_resolver).")
    if cluster_resolver is not None:
        cluster = ClusterConfig.from_resolver(cluster_resolver)
    elif cluster is None:
        cluster = ClusterConfig.from_env()
    if not isinstance(cluster, ClusterConfig):
        raise TypeError(f"cluster must be a tfdp.ClusterConfig, got {type(cluster).__name__}.")
    log.info("tfdp: %s", cluster.describe())
    return cluster


def _task_gpu_devices(positions) -> list:
    """Local device names for this task's share of GPUs its node's tasks all see.

    ``positions`` index ``CUDA_VISIBLE_DEVICES``, as TensorFlow numbers its GPUs
    (``tfdp.slurm.task_gpus``). The others are hidden with the public
    ``tf.config.set_visible_devices`` so TensorFlow allocates no memory on them; once
    TensorFlow has initialised its devices that is too late and the names select them.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if max(positions) >= len(gpus):
        raise ValueError(f"this task's GPU positions {list(positions)} exceed the {len(gpus)} "
                         "GPU(s) TensorFlow sees; pass devices= explicitly.")
    try:
        tf.config.set_visible_devices([gpus[i] for i in positions], "GPU")
    except RuntimeError:
        return [f"/device:GPU:{i}" for i in positions]
    return [f"/device:GPU:{j}" for j in range(len(positions))]


def take_back_sigterm() -> None:
    """Puts back the SIGTERM handler Python has on record, after TensorFlow replaced it.

    Joining a multi-worker cluster starts TensorFlow's coordination service, which installs
    a C-level SIGTERM handler of its own (the preemption notifier behind
    ``tf.distribute.experimental.PreemptionCheckpointHandler``) that only records the
    signal. Without this a worker ignores ``kill``, Kubernetes' and Slurm's termination and
    tfdp-run's stop until SIGKILL arrives, and a handler installed before the strategy is
    silently dead. Python still believes its own handler (by default: terminate) is in
    place, so installing that again restores what the script expects. tfdp's own preemption
    path (``tfdp.callbacks.BackupAndRestore``) installs its handler later, through Python.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; TensorFlow's stays
    on_record = signal.getsignal(signal.SIGTERM)
    if on_record is not None:  # None: installed from outside Python, not ours to change
        signal.signal(signal.SIGTERM, on_record)


class _DataParallelExtended(_tf_private.CollectiveAllReduceExtended):
    """The collective engine with tfdp's choice of local devices.

    The private hooks it overrides are listed, and checked at import, in
    ``_tf_private.EXTENDED_HOOKS``.
    """

    def __init__(self, container, cluster_resolver, options, local_device_type,
                 local_device_indices):
        self._tfdp_device_type = local_device_type
        # The device type whose collective dtype limits apply (collectives.reduce_dtype).
        self._tfdp_reduce_device_type = local_device_type
        self._tfdp_device_indices = list(local_device_indices)
        super().__init__(container, cluster_resolver=cluster_resolver,
                         communication_options=options)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices = tuple(f"{worker_device}/device:{self._tfdp_device_type}:{i}"
                        for i in self._tfdp_device_indices)
        return devices, self._tfdp_device_type

    def _use_merge_call(self):
        # Every replica launches its own collectives (collective-v2 ops ordered by
        # per-device tokens) instead of funnelling through merge_call. TensorFlow does this
        # only for XLA on GPUs; tfdp needs it everywhere because Keras reduces gradients
        # inside a tf.cond when gradient_accumulation_steps is set, and merge_call cannot
        # run inside control flow.
        return False

    def _create_variable(self, next_creator, **kwargs):
        # ONLY_FIRST_REPLICA makes every replica-context update a merge_call, even in a
        # merge-call-free strategy, which fails inside tf.cond (LossScaleOptimizer applies
        # the inner optimizer, and its iteration counter, inside one). Such variables (the
        # optimizer's iteration counter) are computed identically on every replica, so a
        # local update per replica keeps them identical, as Keras's own weights are.
        if (kwargs.get("aggregation") == tf.VariableAggregation.ONLY_FIRST_REPLICA
                and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ):
            kwargs["aggregation"] = tf.VariableAggregation.NONE
        return super()._create_variable(next_creator, **kwargs)

    def _reduce_to(self, reduce_op, value, destinations, options):
        # strategy.reduce / extended.reduce_to: dtypes the collectives cannot sum on these
        # devices (int32 labels on GPUs, bool flags) travel in one they can.
        dtype = getattr(value.values[0] if isinstance(value, _tf_private.DistributedValues)
                        else value, "dtype", None)
        wire = collectives.reduce_dtype(dtype, self._tfdp_reduce_device_type) if dtype else None
        if wire is None:
            return super()._reduce_to(reduce_op, value, destinations, options)
        value = _tf_private.map_distributed(lambda t: tf.cast(t, wire), value)
        reduced = super()._reduce_to(reduce_op, value, destinations, options)
        return _tf_private.map_distributed(lambda t: tf.cast(t, dtype), reduced)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # ReplicaContext.all_reduce (tfdp's gradient buckets, metrics, custom loops).
        flat = tf.nest.flatten(value)
        wires = [collectives.reduce_dtype(t.dtype, self._tfdp_reduce_device_type)
                 if isinstance(t, tf.Tensor) else None for t in flat]
        if not any(wires):
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        cast = [t if w is None else tf.cast(t, w) for t, w in zip(flat, wires)]
        reduced = tf.nest.flatten(super()._replica_ctx_all_reduce(
            reduce_op, tf.nest.pack_sequence_as(value, cast), options))
        return tf.nest.pack_sequence_as(value, [r if w is None else tf.cast(r, t.dtype)
                                                for r, t, w in zip(reduced, flat, wires)])

    def _tfdp_all_to_all(self, value, local_index):
        """All-to-all over every replica, with keys from this strategy's own launcher."""
        launcher = _tf_private.collective_launchers(self)[local_index]
        return _tf_private.all_to_all(launcher, value, _tf_private.communication_options(self))

    @property
    def _tfdp_all_to_all_is_ordered(self):
        # Measured: with device or task indices of two digits, TensorFlow's all-to-all
        # group ranks no longer follow replica order (all-gather's still do), so
        # reduce-scatter falls back to all-reduce + slice there.
        indices = [tf.DeviceSpec.from_string(d).device_index for d in self.worker_devices]
        return max(indices) < 10 and _tf_private.extended_num_workers(self) <= 10


class DataParallelStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism over local devices and, through TF_CONFIG, workers.

    Variables created in ``scope()`` are mirrored on every local replica; the gradients of
    ``model.fit`` (and of ``optimizer.apply`` in custom loops) are summed over all
    replicas of all workers, so with Keras's per-replica loss scaling N replicas with
    per-replica batch b train like one device with batch N*b.

    It is a ``tf.distribute.MultiWorkerMirroredStrategy`` (isinstance holds) so Keras
    reduces metrics across workers and treats checkpoints the multi-worker way.

    Args:
        devices: local device names (default: all GPUs, else all logical CPU devices).
        communication: ``"auto"`` (NCCL on GPUs, ring collectives otherwise), ``"nccl"``
            (error without GPUs) or ``"ring"``.
        bucket_bytes: pack gradients into buckets of about this many bytes before
            reducing; 0 = one collective per tensor; None = 32 MiB.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: dtype of gradients on the wire.
        timeout_seconds: the longest a step may wait for its peers, so that a peer that
            never joins gives an error instead of a hang (tfdp.deadline: Keras's steps,
            tfdp's agreements, ``step_deadline()`` in custom loops; a dead or frozen peer
            is found within ~10 s by TensorFlow's heartbeats). None = 300 s with several
            workers, no deadline in one process.
        cluster: a ``tfdp.ClusterConfig``; default ``ClusterConfig.from_env()`` (TF_CONFIG,
            Vertex AI's CLUSTER_SPEC, SageMaker's SM_HOSTS, a Slurm step; see tfdp.cluster).
        cluster_resolver: any ``tf.distribute.cluster_resolver.ClusterResolver`` instead of
            ``cluster``, as ``MultiWorkerMirroredStrategy`` takes it.
    """

    _is_tfdp_strategy = True

    def __init__(self, devices=None, *, communication="auto", bucket_bytes=None,
                 compression=None, timeout_seconds=None, cluster=None, cluster_resolver=None):
        if compression not in collectives.COMPRESSION_DTYPES:
            raise ValueError(
                f"compression={compression!r} is not one of None, 'fp16', 'bf16'.")
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(
                f"bucket_bytes={bucket_bytes!r} must be an integer >= 0 (0 = one collective "
                "per tensor) or None for the default.")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds={timeout_seconds!r} must be positive or None.")
        cluster = _resolve_cluster(cluster, cluster_resolver)
        if devices is None and cluster.task_gpus is not None:
            devices = _task_gpu_devices(cluster.task_gpus)
        devices_lib.configure_from_env()
        names, device_type = _resolve_devices(devices)
        indices = [tf.DeviceSpec.from_string(n).device_index for n in names]
        _check_compression(compression, device_type)
        local_gpus = (devices_lib.local_gpu_placements(cluster.rank, indices)
                      if device_type == "GPU" else [])
        shared = devices_lib.shared_gpu(local_gpus)
        self._tfdp_communication = resolve_communication(communication, device_type, shared)
        _say_shared_gpu_once(communication, shared)
        if timeout_seconds is None and cluster.is_multi_worker:
            timeout_seconds = DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS
        self._tfdp_cluster = cluster
        self._tfdp_devices = names
        self._tfdp_bucket_bytes = bucket_bytes
        self._tfdp_compression = compression
        self._tfdp_timeout = timeout_seconds
        self._tfdp_key_base = next(_key_bases) * _KEY_RANGE
        _tf_private.set_collective_key_base(self, self._tfdp_key_base)

        implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                          if self._tfdp_communication == "nccl"
                          else tf.distribute.experimental.CommunicationImplementation.RING)
        # No per-collective timeout: TensorFlow's starts threads that sleep for the whole
        # timeout per collective (a fast job dies of them); tfdp.deadline enforces it per step.
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=0, timeout_seconds=None, implementation=implementation)
        if cluster.is_multi_worker:
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster_spec.items()}),
                task_type=cluster.task_type, task_id=cluster.task_index, rpc_layer="grpc")
        else:
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
        ready_file = os.environ.get(READY_FILE_ENV)
        if ready_file:
            # Tell tfdp-run this worker is joining: if it never gets further, a peer is
            # missing, and the launcher can name the peer rather than this worker.
            with open(ready_file + ".joining", "w") as f:
                f.write(f"{cluster.rank}\n")
        collectives.install_keras_gradient_hooks()
        xla.install_keras_hooks()
        # MultiWorkerMirroredStrategy.__init__ would build its own extended object from
        # TF_CONFIG; the base Strategy constructor takes ours.
        _tf_private.StrategyBase.__init__(
            self, _DataParallelExtended(self, resolver, options, device_type, indices))
        if cluster.is_multi_worker:
            take_back_sigterm()
        if ready_file:
            with open(ready_file, "w") as f:
                f.write(f"{cluster.rank}\n")
        if local_gpus and cluster.is_multi_worker:
            self._tfdp_check_gpus_across_workers(communication, local_gpus)
        if cluster.is_multi_worker:
            orderly_exit.register(cluster, timeout_seconds)
            # Keras scripts unchanged: only the chief writes files, decisions agree.
            chief_writes.activate(cluster)
            consensus.install()
        log.info("tfdp.DataParallelStrategy: %d worker(s) x %d %s replica(s), "
                 "communication=%s, bucket_bytes=%d, compression=%s",
                 cluster.num_workers, len(names), device_type, self._tfdp_communication,
                 bucket_bytes, compression)

    # --- what users read -------------------------------------------------------------
    @property
    def cluster(self) -> ClusterConfig:
        return self._tfdp_cluster

    @property
    def communication(self) -> str:
        return self._tfdp_communication

    @property
    def bucket_bytes(self) -> int:
        return self._tfdp_bucket_bytes

    @property
    def compression(self):
        return self._tfdp_compression

    @property
    def timeout_seconds(self):
        return self._tfdp_timeout

    @property
    def local_devices(self) -> list:
        return list(self._tfdp_devices)

    def step_deadline(self, what: str = "a custom training step"):
        """``with strategy.step_deadline():`` around one step of a custom loop: if it runs
        longer than ``timeout_seconds``, its collectives are aborted and it fails with
        ``DeadlineExceededError`` instead of waiting forever for a peer that never joins
        (a dead or frozen peer is found by TensorFlow's heartbeats without it). Keras's
        ``fit``/``evaluate`` steps are watched without it. See tfdp/deadline.py.

        Args:
            what: names the step in the error.
        """
        return deadline.watching(self, what)

    def _tfdp_check_gpus_across_workers(self, requested, local_gpus):
        """Before the first collective: do replicas of different workers share a GPU?"""
        cluster = self._tfdp_cluster
        table = devices_lib.exchange_gpu_placements(
            f"tfdp/gpus/{self._tfdp_key_base}", cluster.rank, cluster.num_workers, local_gpus,
            self._tfdp_timeout or DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS)
        shared = devices_lib.shared_gpu(table)
        chosen = resolve_communication(requested, "GPU", shared)  # every worker: same table
        _say_shared_gpu_once(requested, shared)
        if chosen != self._tfdp_communication:
            # The options object is shared by every collective launcher; none has run yet.
            _tf_private.communication_options(self.extended).implementation = (
                tf.distribute.experimental.CommunicationImplementation.RING)
            self._tfdp_communication = chosen

    def run(self, fn, args=(), kwargs=None, options=None):
        """``tf.distribute.Strategy.run``, refusing XLA compilation it cannot survive.

        Raises:
            ValueError: naming ``jit_compile``, the reason and the fix, when called while
                tracing an XLA-compiled function with several CPU replicas or several
                local GPUs (see ``jit_compile_error``); raised at trace time.
        """
        if _tf_private.in_xla_context(tf.compat.v1.get_default_graph()):
            message = jit_compile_error(self.extended._tfdp_device_type,
                                        self.num_replicas_in_sync, len(self._tfdp_devices))
            if message:
                raise ValueError(message)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    # --- Keras-3 compatibility -------------------------------------------------------
    def reduce(self, reduce_op, value, axis=None):
        """``tf.distribute.Strategy.reduce`` that also takes nests and scalars.

        Keras 3 passes a whole (x, y) batch in one call and asks for ``axis=0`` on scalar
        metrics; a scalar has no axis 0, and its mean over replicas is the mean of the
        per-replica values, which is what ``axis=None`` computes.
        """
        flat = tf.nest.flatten(value, expand_composites=False)
        if len(flat) != 1 or flat[0] is not value:
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        parts = (self.experimental_local_results(value)
                 if isinstance(value, _tf_private.DistributedValues) else [value])
        if _is_mean(reduce_op) and collectives.is_reduced(parts):
            # A multi-worker train step's logs rode in its gradient all-reduce
            # (collectives.LogsRider): every replica holds their mean already.
            return parts[0]
        if axis is not None:
            if all(getattr(p, "shape", None) is not None and p.shape.rank == 0 for p in parts):
                axis = None
        return super().reduce(reduce_op, value, axis)


def _is_mean(reduce_op) -> bool:
    try:
        return tf.distribute.ReduceOp(reduce_op) == tf.distribute.ReduceOp.MEAN
    except ValueError:
        return False
