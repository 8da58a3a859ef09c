"""Local device discovery, ``configure_cpu_replicas``, and replicas sharing a GPU.

On a host without GPUs, TensorFlow exposes one CPU device. For development tfdp splits it
into ``n`` logical devices so one process looks like ``n`` replicas, exactly as it would
look with ``n`` GPUs: every code path except the NCCL kernels runs.

Shared GPUs. NCCL refuses two ranks on one physical GPU (TensorFlow reports only ``NCCL:
invalid usage`` at the first collective). Rule: a replica's GPU is identified by its host
name and, on that host, the ``CUDA_VISIBLE_DEVICES`` entry (an index or a UUID) of the
physical GPU behind its logical device (its CUDA index when the variable is unset); two
replicas with the same identity share a GPU (``shared_gpu``). Logical GPUs split from one
physical GPU share it; so do workers of one host that see the same GPU (``tfdp-run
--workers 2`` on a one-GPU workstation). Workers exchange their identities through the
coordination service before the first collective (``exchange_gpu_placements``). Entries
written differently by different workers (an index in one, a UUID in another) are not
recognised as the same GPU.

Several workers on one host. With ``CUDA_VISIBLE_DEVICES`` unset, the workers of a host split
the GPUs they all see (``shared_host_gpu_devices``, the rule of ``tfdp.cluster.gpus``): one
per worker when the counts match, as Horovod's ``gpus[hvd.local_rank()]``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
from typing import Sequence

import tensorflow as tf

from tfdp.cluster import gpus as cluster_gpus
# Set by tfdp-run so that DataParallelStrategy() in each worker splits its CPU without any
# change to the user's script; defined with the rest of the launcher protocol.
from tfdp.protocol import CPU_REPLICAS_ENV

log = logging.getLogger("tfdp")

__all__ = ["configure_cpu_replicas", "local_devices", "resolve_local_devices", "task_gpu_devices", "CPU_REPLICAS_ENV", "shared_gpu",
           "SharedGPU", "physical_gpu_of_logical", "gpu_identities", "local_gpu_placements",
           "exchange_gpu_placements", "shared_host_gpu_devices"]


# Nothing here may initialise the TensorFlow runtime (tf.config.list_logical_devices
# does): a multi-worker strategy must configure collective ops before that happens.


def _current_cpu_split() -> int | None:
    configs = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
    return None if configs is None else len(configs)


def _logical(device_type: str, count: int) -> list:
    return [tf.config.LogicalDevice(name=f"/device:{device_type}:{i}", device_type=device_type)
            for i in range(count)]


def configure_cpu_replicas(n: int) -> list:
    """Splits the host CPU into ``n`` logical devices and returns them.

    Must run before TensorFlow initialises its devices (before the first op, variable or
    strategy). Calling it again with the same ``n`` is harmless. It does not initialise
    the runtime itself, so a multi-worker strategy can still be created afterwards.

    Args:
        n: number of logical CPU devices, a positive integer.

    Returns:
        The list of ``tf.config.LogicalDevice`` for the CPU.

    Raises:
        ValueError: ``n`` is not a positive integer.
        RuntimeError: TensorFlow already initialised its devices with another split.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"configure_cpu_replicas(n={n!r}): n must be a positive integer number of "
            "logical CPU devices, e.g. configure_cpu_replicas(4).")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = _current_cpu_split()
    if current == n:
        return _logical("CPU", n)
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"configure_cpu_replicas({n}) was called after TensorFlow initialised its "
            f"devices (it already has {have} logical CPU device(s)). Call it first thing in "
            "the program, before creating any tensor, variable, model or strategy, or "
            f"set {CPU_REPLICAS_ENV}={n} in the environment before starting Python.") from e
    return _logical("CPU", n)


def configure_from_env(environ=None) -> int | None:
    """Applies ``TFDP_CPU_REPLICAS`` (set by tfdp-run) if present; returns the count used."""
    environ = os.environ if environ is None else environ
    value = environ.get(CPU_REPLICAS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CPU_REPLICAS_ENV}={value!r} must be a positive integer.")
    n = int(value)
    if _current_cpu_split() in (None, n):
        try:
            configure_cpu_replicas(n)
        except RuntimeError:
            # Devices already initialised without a split: keep what exists and let
            # local_devices() report it; the launcher's request cannot be honoured.
            return None
        return n
    return None


def _count_logical(device_type: str) -> int:
    total = 0
    for physical in tf.config.list_physical_devices(device_type):
        configs = tf.config.get_logical_device_configuration(physical)
        total += len(configs) if configs else 1
    return total


def available_devices() -> dict:
    """``{device type: number of logical devices}`` without initialising the runtime."""
    return {t: n for t in ("GPU", "CPU") if (n := _count_logical(t))}


def local_devices(available: dict | None = None) -> tuple[list[str], str]:
    """Returns ``(device names, device type)``: all GPUs if there are any, else all CPUs.

    Args:
        available: ``{device type: count}`` to decide from (default: this host's), so the
            choice is testable without a GPU.
    """
    available = available_devices() if available is None else available
    device_type = "GPU" if available.get("GPU") else "CPU"
    return [d.name for d in _logical(device_type, available.get(device_type, 1))], device_type


# --- replicas sharing a physical GPU ---------------------------------------------------------

# One replica's GPU: (worker rank, local replica index, host name, GPU identity on the host).
Placement = collections.namedtuple("Placement", ["worker", "replica", "host", "gpu"])
SharedGPU = collections.namedtuple("SharedGPU", ["host", "gpu", "replicas"])


def physical_gpu_of_logical(logical_per_physical: Sequence[int]) -> list[int]:
    """Physical GPU index behind each logical GPU index; pure.

    TensorFlow numbers logical GPUs physical device by physical device, so a GPU split into
    two logical devices gives two consecutive logical indices.

    Args:
        logical_per_physical: logical devices of each physical GPU, in order (1 when unsplit).
    """
    return [p for p, n in enumerate(logical_per_physical) for _ in range(max(1, n))]


def gpu_identities(logical_indices, logical_per_physical, visible_devices=None) -> list[str]:
    """The identity on this host of the physical GPU behind each logical GPU; pure.

    Args:
        logical_indices: the replicas' logical GPU indices.
        logical_per_physical: as for ``physical_gpu_of_logical``.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` (None or empty-free: unset). Its k-th
            entry is the physical GPU TensorFlow numbers k.
    """
    physical = physical_gpu_of_logical(logical_per_physical)
    entries = [e.strip() for e in visible_devices.split(",")] if visible_devices else None
    out = []
    for index in logical_indices:
        p = physical[index]
        out.append(entries[p] if entries and p < len(entries) else str(p))
    return out


def shared_gpu(placements) -> SharedGPU | None:
    """The first physical GPU that two replicas use, or None; pure.

    Args:
        placements: ``Placement``s (worker, replica, host, gpu) of every replica of the job
            (or ``(worker, replica, host, gpu)`` tuples).
    """
    users = collections.defaultdict(list)
    for worker, replica, host, gpu in placements:
        users[(host, gpu)].append((worker, replica))
    for (host, gpu), replicas in users.items():
        if len(replicas) > 1:
            return SharedGPU(host, gpu, sorted(replicas))
    return None


def local_gpu_placements(rank: int, logical_indices, environ=None) -> list[Placement]:
    """This worker's replicas' placements, without initialising the runtime."""
    environ = os.environ if environ is None else environ
    counts = []
    for physical in tf.config.list_physical_devices("GPU"):
        configs = tf.config.get_logical_device_configuration(physical)
        counts.append(len(configs) if configs else 1)
    host = socket.gethostname()
    gpus = gpu_identities(logical_indices, counts, environ.get("CUDA_VISIBLE_DEVICES"))
    return [Placement(rank, i, host, gpu) for i, gpu in enumerate(gpus)]


def exchange_gpu_placements(key: str, rank: int, num_workers: int, local,
                            timeout_seconds: float) -> list[Placement]:
    """Every worker's placements, through the coordination service's key-value store.

    Each worker publishes its own under ``key/<rank>`` and reads the others' (blocking at
    most ``timeout_seconds`` for each); all workers get the same list, in rank order.
    """
    from tfdp import _tf_private

    _tf_private.publish_to_coordination_service(
        f"{key}/{rank}", json.dumps([list(p) for p in local]))
    table = []
    for worker in range(num_workers):
        if worker == rank:
            table.extend(local)
            continue
        text = _tf_private.read_from_coordination_service(f"{key}/{worker}", timeout_seconds)
        table.extend(Placement(*p) for p in json.loads(text))
    return table


def resolve_local_devices(requested):
    """``(canonical local device names, device type)`` for ``devices=`` (None: all local devices).

    Raises:
        ValueError: a name that is not a local device of this host, a device listed twice,
            or mixed device types; each with the fix.
    """
    if requested is None:
        return local_devices()
    if isinstance(requested, str):
        requested = [requested]
    requested = list(requested)
    if not requested:
        raise ValueError("devices=[] names no device; pass None for all local devices.")
    available = {(t, i): f"/device:{t}:{i}"
                 for t, n in available_devices().items() for i in range(n)}
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


def task_gpu_devices(positions) -> list:
    """Local device names for this task's share of GPUs its node's tasks all see.

    ``positions`` index ``CUDA_VISIBLE_DEVICES``, as TensorFlow numbers its GPUs
    (``tfdp.cluster.slurm.task_gpus``). The others are hidden with the public
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


def shared_host_gpu_devices(cluster, environ=None) -> list | None:
    """Local device names for this worker's share of its host's GPUs, or None to use every
    GPU it sees (the rule of ``tfdp.cluster.gpus``: workers of one host split the GPUs they
    all see when ``CUDA_VISIBLE_DEVICES`` is unset; Horovod's one GPU per local rank)."""
    environ = os.environ if environ is None else environ
    if not cluster.is_multi_worker or "CUDA_VISIBLE_DEVICES" in environ:
        return None  # before asking TensorFlow: no GPU query on CPU-only or chosen layouts
    gpus = tf.config.list_physical_devices("GPU")
    positions = cluster_gpus.shared_host_gpus(cluster.workers, cluster.rank, len(gpus), environ)
    if positions is None:
        return None
    local_rank, local_size = cluster_gpus.local_position(cluster.workers, cluster.rank)
    log.info("tfdp: worker %d is local rank %d of the %d workers on its host: GPU(s) %s of the "
             "%d it sees (CUDA_VISIBLE_DEVICES unset; set it, or pass devices=, to choose)",
             cluster.rank, local_rank, local_size, list(positions), len(gpus))
    return task_gpu_devices(positions)

