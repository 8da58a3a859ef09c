"""What a ``DataParallelStrategy``'s arguments resolve to: pure policy, no TensorFlow.

Rule. The constructor's arguments are checked and resolved here, once, before anything is
created: an invalid argument is a ``ValueError`` naming it and the fix, and nothing global
has changed yet. What needs the devices (which collective implementation runs, whether a
shared GPU forbids NCCL) is decided by ``resolve_communication`` from facts the strategy
gathers; what needs the cluster (a default step deadline with several workers) by
``resolve_options``.
"""

from __future__ import annotations

import os

import dataclasses

__all__ = ["COMMUNICATIONS", "COMPRESSIONS", "DEFAULT_BUCKET_BYTES",
           "DEFAULT_FIRST_BUCKET_BYTES", "DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS", "RANDOM_DRAWS", "StrategyOptions", "resolve_options",
           "resolve_communication", "check_compression", "describe_shared_gpu",
           "jit_compile_error"]

COMMUNICATIONS = ("auto", "nccl", "ring")
COMPRESSIONS = (None, "fp16", "bf16")
RANDOM_DRAWS = ("as_one_device", "independent")  # randomness.py states what each means
# Gradient buckets as PyTorch DDP sizes them (issue 43): a cap of 25 MiB, and a first bucket
# (the last layers', launched first) closed at 1 MiB so the exchange starts while backprop is
# still early. A gradient that fits in one cap travels as one fused collective: there the
# per-collective latency outweighs what overlap could hide (sub-millisecond steps).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
# A step waits at most this long for its peers when there are several workers. Long enough
# for a chief writing a checkpoint or a slow first trace, short enough that a hung peer ends
# the job within minutes. Single-process jobs need none: local devices cannot die separately.
DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """The checked, resolved arguments of one strategy.

    Attributes:
        communication: what was asked for (``"auto"``, ``"nccl"``, ``"ring"``); what runs is
            ``resolve_communication``'s answer once the devices are known.
        bucket_bytes: gradient bucket size in bytes (0: one collective per tensor).
        compression: ``None``, ``"fp16"`` or ``"bf16"``.
        timeout_seconds: the per-step deadline, or None for none.
        random_draws: ``"as_one_device"`` or ``"independent"`` (tfdp/strategy/randomness.py).
    """

    communication: str = "auto"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    compression: str | None = None
    timeout_seconds: float | None = None
    random_draws: str = "as_one_device"


def timeout_from_env(text):
    """``TFDP_TIMEOUT_SECONDS``'s value as a multi-worker strategy's default deadline."""
    if text is None or text == "":
        return DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"TFDP_TIMEOUT_SECONDS={text!r} must be a positive number of seconds "
                         "(the per-step deadline of multi-worker strategies), or unset for "
                         f"{DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS:g}.")
    return seconds


def resolve_options(*, communication="auto", bucket_bytes=None, compression=None,
                    timeout_seconds=None, random_draws="as_one_device",
                    multi_worker=False) -> StrategyOptions:
    """Checks the constructor's arguments and fills in the defaults.

    Args:
        communication: ``"auto"``, ``"nccl"`` or ``"ring"``.
        bucket_bytes: an integer >= 0, or None for ``DEFAULT_BUCKET_BYTES``.
        compression: ``None``, ``"fp16"`` or ``"bf16"``.
        timeout_seconds: positive, or None: with several workers the environment's
            ``TFDP_TIMEOUT_SECONDS`` if set (for scripts that do not build the strategy
            themselves, e.g. Horovod's), else ``DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS``; no
            deadline in one process.
        random_draws: ``"as_one_device"`` or ``"independent"``.
        multi_worker: the job has several workers.

    Raises:
        ValueError: an argument out of its domain, named with the fix.
    """
    if communication not in COMMUNICATIONS:
        raise ValueError(
            f"communication={communication!r} is not one of {COMMUNICATIONS}. Use 'auto' to "
            "let tfdp pick NCCL on GPUs and ring collectives elsewhere.")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is not one of None, 'fp16', 'bf16'.")
    if bucket_bytes is None:
        bucket_bytes = DEFAULT_BUCKET_BYTES
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(
            f"bucket_bytes={bucket_bytes!r} must be an integer >= 0 (0 = one collective "
            "per tensor) or None for the default.")
    if timeout_seconds is not None and not timeout_seconds > 0:
        raise ValueError(f"timeout_seconds={timeout_seconds!r} must be positive or None.")
    if timeout_seconds is None and multi_worker:
        timeout_seconds = timeout_from_env(os.environ.get("TFDP_TIMEOUT_SECONDS"))
    if random_draws not in RANDOM_DRAWS:
        raise ValueError(
            f"random_draws={random_draws!r} is not one of {RANDOM_DRAWS}: 'as_one_device' gives "
            "each replica the draws one device makes for its rows of the global batch, "
            "'independent' folds the replica into the seed (cheaper, not one device's draws).")
    return StrategyOptions(communication, bucket_bytes, compression, timeout_seconds,
                           random_draws)


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


def check_compression(compression, device_type) -> None:
    """Raises ValueError for a wire dtype the replicas' collectives cannot sum."""
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
    cluster). ``model.fit`` never gets here: tfdp.strategy.xla compiles only each replica's part.

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
