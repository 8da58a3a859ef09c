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
* ``strategy.run`` inside an XLA-compiled function (``model.compile(jit_compile=True)``, or
  ``tf.function(jit_compile=True)`` around ``strategy.run``) with several CPU replicas is
  refused at trace time with one clear error (``jit_compile_error``): XLA on CPU cannot
  compile the cross-replica collectives every step contains, and TensorFlow's own error
  names neither XLA nor the fix. One replica, and GPUs, are left to TensorFlow;
* workers of a multi-worker job leave together (see "Orderly exit" below), so a job that
  succeeded prints no coordination-service errors from a worker that outlived the chief.

Orderly exit. TensorFlow's coordination service, which every worker heartbeats to, runs in
the chief's process, and TensorFlow has no multi-worker shutdown: a worker still running
when the chief exits logs heartbeat errors (``Failed to connect to remote host``), and a
chief still running ~10 s after the others exited logs them as crashed. So when the first
multi-worker strategy is built, tfdp registers an exit handler. At interpreter exit, unless
the process is failing (an uncaught exception, or a non-zero ``sys.exit``), every worker
waits at one coordination-service barrier (at most the strategy's timeout; it fails as
soon as the service finds a peer dead), then the chief, whose process hosts the service,
waits until the other workers' processes are gone (at most ``CHIEF_EXIT_DRAIN_SECONDS``)
before it exits. Failing exits never wait and keep their exit code; a handler that cannot
complete logs one warning and lets the process exit. ``TFDP_ORDERLY_EXIT=0`` turns it off.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import sys
import threading
import time

import tensorflow as tf

from tfdp import _tf_private, collectives, devices as devices_lib
from tfdp.cluster import READY_FILE_ENV, ClusterConfig

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

# "0" turns the orderly exit off (see the module docstring).
ORDERLY_EXIT_ENV = "TFDP_ORDERLY_EXIT"
# After the exit barrier the other workers need about 1 s (measured: Python and TensorFlow
# teardown) to be gone; the chief waits at most this long for them. Well below the
# coordination service's 10 s heartbeat timeout, after which the chief's service would
# report the departed workers as crashed.
CHIEF_EXIT_DRAIN_SECONDS = 5.0
_EXIT_BARRIER_ID = "tfdp/orderly-exit"


def resolve_communication(requested: str, device_type: str) -> str:
    """Returns the collective implementation that will run: ``"nccl"`` or ``"ring"``.

    Args:
        requested: ``"auto"`` (NCCL on GPUs, ring elsewhere), ``"nccl"`` or ``"ring"``.
        device_type: ``"GPU"``, ``"CPU"`` or ``"TPU"``, the type of the local replicas.
    """
    if requested not in COMMUNICATIONS:
        raise ValueError(
            f"communication={requested!r} is not one of {COMMUNICATIONS}. Use 'auto' to let "
            "tfdp pick NCCL on GPUs and ring collectives elsewhere.")
    if requested == "nccl" and device_type != "GPU":
        raise ValueError(
            f"communication='nccl' needs GPUs, but the replicas are {device_type} devices "
            "(NCCL has no CPU kernel). Use communication='ring' or 'auto' on this host.")
    if requested == "auto":
        return "nccl" if device_type == "GPU" else "ring"
    return requested


def jit_compile_error(device_type: str, num_replicas_in_sync: int) -> str | None:
    """The error message for XLA-compiling a step of ``num_replicas_in_sync`` replicas, or None.

    Pure policy. XLA on CPU cannot compile TensorFlow's cross-replica collectives (measured
    with TF 2.21: ``InvalidArgumentError: Graph execution error`` at the first step, under
    MirroredStrategy too), so several CPU replicas are refused with the reason and the fix.
    One replica has no collective to compile (tfdp skips the reduction) and works. On GPUs
    TensorFlow compiles collectives with XLA itself, so tfdp does not interfere (not
    verified here: no GPU).

    Args:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``, the type of the local replicas.
        num_replicas_in_sync: replicas over all workers.
    """
    if device_type != "CPU" or num_replicas_in_sync <= 1:
        return None
    return (
        f"jit_compile=True cannot compile a step of {num_replicas_in_sync} CPU replicas: XLA "
        "on CPU cannot compile the cross-replica collectives (gradient all-reduce, metric sums) "
        "that every distributed step contains, so TensorFlow would fail at the first step "
        "with an opaque 'InvalidArgumentError: Graph execution error'. Fix: "
        "model.compile(..., jit_compile=False), or leave Keras's default "
        "jit_compile='auto' (XLA stays off under a strategy); in a custom loop, call "
        "strategy.run outside tf.function(jit_compile=True) (you may jit-compile the "
        "per-replica function itself if it has no collectives); or train on one replica "
        "(tfdp.DataParallelStrategy(devices=['/device:CPU:0'])), where jit_compile=True works.")


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


def leave_together_at_exit(uncaught_exception: bool, exit_code, environ=None) -> bool:
    """Whether this worker should take part in the orderly exit; pure policy.

    Args:
        uncaught_exception: the interpreter is exiting because of an uncaught exception.
        exit_code: the argument of ``sys.exit`` if it was called (None otherwise). ``None``
            and ``0`` mean success, anything else (a non-zero int, a message) failure.
        environ: the environment (default ``os.environ``); ``TFDP_ORDERLY_EXIT=0`` opts out.

    A failing worker must not wait for peers: they may be blocked in a collective with it,
    and only its exit tells them (and tfdp-run, which reports the first failing code).
    """
    environ = os.environ if environ is None else environ
    if environ.get(ORDERLY_EXIT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return not uncaught_exception and exit_code in (None, 0)


def _peer_addresses(cluster: ClusterConfig) -> list:
    """(host, port) of every other worker of the job."""
    peers = []
    for rank, address in enumerate(cluster.workers):
        if rank == cluster.rank:
            continue
        host, _, port = address.rpartition(":")
        peers.append((host.strip("[]"), int(port)))
    return peers


def _wait_until_gone(addresses, timeout_seconds: float) -> list:
    """Waits until no process listens at ``addresses`` any more; returns those still there.

    A worker's TensorFlow server listens on its TF_CONFIG address for the life of the
    process, and the operating system closes the socket when the process ends. So: connect,
    then block reading until the peer closes the connection (process gone; a refused
    connection means already gone). Event-driven, bounded by ``timeout_seconds`` in all.
    """
    deadline = time.monotonic() + timeout_seconds
    remaining = []
    for address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            remaining.append(address)
            continue
        try:
            conn = socket.create_connection(address, timeout=left)
        except OSError:
            continue  # refused or unreachable: nobody there
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    remaining.append(address)
                    break
                conn.settimeout(left)
                if not conn.recv(4096):
                    break  # closed by the peer's exit
        except socket.timeout:
            remaining.append(address)
        except OSError:
            pass  # reset by the peer's exit
        finally:
            conn.close()
    return remaining


class _OrderlyExit:
    """Process-wide exit handler of multi-worker strategies (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cluster = None
        self._timeout = DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS
        self._exit_code = None

    def register(self, cluster: ClusterConfig, timeout_seconds):
        with self._lock:
            first = self._cluster is None
            self._cluster = cluster
            self._timeout = timeout_seconds or DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS
            if not first:
                return
            # sys.exit(code) is the one failing exit the handler could not tell from success
            # otherwise: SystemExit never reaches sys.excepthook, and atexit handlers do not
            # see the code. The wrapper only records it.
            original_exit = sys.exit

            def exit(status=None):  # noqa: A001 (same name as what it wraps)
                if threading.current_thread() is threading.main_thread():
                    self._exit_code = status  # elsewhere it only ends that thread
                original_exit(status)

            exit.__doc__ = original_exit.__doc__
            exit.__wrapped__ = original_exit
            sys.exit = exit
            atexit.register(self._on_exit)

    def _on_exit(self):
        # An uncaught exception sets sys.last_value before atexit handlers run.
        failing = getattr(sys, "last_value", None) is not None
        if not leave_together_at_exit(failing, self._exit_code):
            return
        cluster = self._cluster
        try:
            if not _tf_private.coordination_service_configured():
                return
            _tf_private.wait_at_coordination_barrier(_EXIT_BARRIER_ID, self._timeout)
        except Exception as e:  # noqa: BLE001 (an exit handler must not raise)
            reason = (str(e).splitlines() or [""])[0][:200]
            log.warning("tfdp: orderly exit: the exit barrier failed (a worker died, or did not "
                        "arrive within %.0f s): %s: %s. Exiting without waiting for the others.",
                        self._timeout, type(e).__name__, reason)
            return
        if cluster.is_chief:
            left = _wait_until_gone(_peer_addresses(cluster), CHIEF_EXIT_DRAIN_SECONDS)
            if left:
                log.info("tfdp: orderly exit: worker(s) at %s still running %.0f s after the "
                         "exit barrier; the chief exits anyway.",
                         ", ".join(f"{h}:{p}" for h, p in left), CHIEF_EXIT_DRAIN_SECONDS)


_orderly_exit = _OrderlyExit()


class _DataParallelExtended(_tf_private.CollectiveAllReduceExtended):
    """The collective engine with tfdp's choice of local devices.

    The private hooks it overrides are listed, and checked at import, in
    ``_tf_private.EXTENDED_HOOKS``.
    """

    def __init__(self, container, cluster_resolver, options, local_device_type,
                 local_device_indices):
        self._tfdp_device_type = local_device_type
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
        timeout_seconds: collective timeout, so that a dead peer gives an error instead of
            a hang. None = 300 s with several workers, no timeout in one process.
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
        self._tfdp_communication = resolve_communication(communication, device_type)
        if timeout_seconds is None and cluster.is_multi_worker:
            timeout_seconds = DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS
        self._tfdp_cluster = cluster
        self._tfdp_devices = names
        self._tfdp_bucket_bytes = bucket_bytes
        self._tfdp_compression = compression
        self._tfdp_timeout = timeout_seconds
        _tf_private.set_collective_key_base(self, next(_key_bases) * _KEY_RANGE)

        implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                          if self._tfdp_communication == "nccl"
                          else tf.distribute.experimental.CommunicationImplementation.RING)
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=0, timeout_seconds=timeout_seconds, implementation=implementation)
        if cluster.is_multi_worker:
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster_spec.items()}),
                task_type=cluster.task_type, task_id=cluster.task_index, rpc_layer="grpc")
        else:
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
        indices = [tf.DeviceSpec.from_string(n).device_index for n in names]
        ready_file = os.environ.get(READY_FILE_ENV)
        if ready_file:
            # Tell tfdp-run this worker is joining: if it never gets further, a peer is
            # missing, and the launcher can name the peer rather than this worker.
            with open(ready_file + ".joining", "w") as f:
                f.write(f"{cluster.rank}\n")
        collectives.install_keras_gradient_hooks()
        # MultiWorkerMirroredStrategy.__init__ would build its own extended object from
        # TF_CONFIG; the base Strategy constructor takes ours.
        _tf_private.StrategyBase.__init__(
            self, _DataParallelExtended(self, resolver, options, device_type, indices))
        if ready_file:
            with open(ready_file, "w") as f:
                f.write(f"{cluster.rank}\n")
        if cluster.is_multi_worker:
            _orderly_exit.register(cluster, timeout_seconds)
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

    def run(self, fn, args=(), kwargs=None, options=None):
        """``tf.distribute.Strategy.run``, refusing XLA compilation it cannot survive.

        Raises:
            ValueError: naming ``jit_compile``, the reason and the fix, when called while
                tracing an XLA-compiled function with several CPU replicas (see
                ``jit_compile_error``); raised at trace time, before any step runs.
        """
        if _tf_private.in_xla_context(tf.compat.v1.get_default_graph()):
            message = jit_compile_error(self.extended._tfdp_device_type,
                                        self.num_replicas_in_sync)
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
        if axis is not None:
            parts = (self.experimental_local_results(value)
                     if isinstance(value, _tf_private.DistributedValues) else [value])
            if all(getattr(p, "shape", None) is not None and p.shape.rank == 0 for p in parts):
                axis = None
        return super().reduce(reduce_op, value, axis)
