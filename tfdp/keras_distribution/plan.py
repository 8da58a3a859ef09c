"""What a ``keras.distribution`` object means for tfdp: a pure plan, or an error naming the fix.

Rule. Keras describes a distribution as a ``DeviceMesh`` of device strings with named axes, a
batch axis and (``ModelParallel``) a ``LayoutMap`` of per-variable ``TensorLayout`` axes. tfdp
runs it as one ``DataParallelStrategy``: every device of the mesh is a replica (rank-major, the
order of tfdp's collectives), compute is data-parallel over all of them, and a variable whose
layout shards any axis is stored 1/N (ZeRO-3) while the rest are mirrored. This module decides
that mapping from plain values (strings, tuples, counts), without TensorFlow or Keras, so each
rule is unit-tested alone: ``device_names`` (what ``list_devices`` returns), ``parse_device``,
``plan_mesh`` (mesh -> this worker's local device positions), ``layout_shards``.

Device strings. tfdp lists the job's devices as Keras's backends do, ``"<type>:<global index>"``
(``"cpu:0"`` ... ``"cpu:7"``; GPUs ``"gpu:i"``), the global index being ``rank * L + i`` for
local device position ``i`` of worker ``rank`` (L devices per worker). TensorFlow's own
spellings of a local or a job device (``"/device:CPU:1"``, ``"CPU:1"``,
``"/job:worker/replica:0/task:1/device:CPU:0"``) are accepted too. Other backends' names
(JAX's ``"TFRT_CPU_0"``, PyTorch's ``"cuda:0"``, ``"mps"``) are an error saying so.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["DeviceRef", "MeshPlan", "KerasDistributionError", "device_names", "parse_device",
           "plan_mesh", "layout_shards", "initialize_workers"]

_KERAS_FORM = re.compile(r"^(cpu|gpu|tpu):(\d+)$", re.IGNORECASE)
_TF_FORM = re.compile(
    r"^(?:/job:(?P<job>[^/]+)(?:/replica:\d+)?/task:(?P<task>\d+))?/?(?:device:)?"
    r"(?P<type>CPU|GPU|TPU):(?P<index>\d+)$", re.IGNORECASE)
_OTHER_BACKENDS = {
    "cuda": "PyTorch", "mps": "PyTorch", "xla": "PyTorch/XLA", "tfrt_cpu": "JAX",
    "tfrt": "JAX", "rocm": "JAX",
}


class KerasDistributionError(ValueError):
    """A ``keras.distribution`` setting tfdp cannot honor; the message gives the fix."""


@dataclasses.dataclass(frozen=True)
class DeviceRef:
    """One mesh entry: device type (upper case), and either a global index (Keras's form) or a
    (task, local index) pair (TensorFlow's job form; task None for a local name)."""

    device_type: str
    global_index: int | None = None
    task: int | None = None
    local_index: int | None = None


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """This worker's part of a mesh: the positions (into tfdp's local devices) of its replicas,
    ascending, and the number of replicas of the whole job."""

    local_positions: tuple
    num_replicas: int
    device_type: str


def device_names(device_type: str, per_worker: int, num_workers: int) -> list[str]:
    """The job's devices as ``list_devices`` returns them: ``"cpu:0"`` ... in tfdp's order."""
    return [f"{device_type.lower()}:{g}" for g in range(per_worker * num_workers)]


def parse_device(name) -> DeviceRef:
    """A mesh entry -> ``DeviceRef``; another backend's or an unknown string is an error."""
    text = str(name).strip()
    match = _KERAS_FORM.match(text)
    if match:
        return DeviceRef(match.group(1).upper(), global_index=int(match.group(2)))
    match = _TF_FORM.match(text)
    if match:
        task = match.group("task")
        return DeviceRef(match.group("type").upper(), task=None if task is None else int(task),
                         local_index=int(match.group("index")))
    lowered = re.split(r"[:_]?\d", text.lower(), maxsplit=1)[0]
    backend = _OTHER_BACKENDS.get(lowered) or _OTHER_BACKENDS.get(lowered.split(":")[0])
    why = (f"it is a {backend} device name, not TensorFlow's" if backend
           else "it is neither Keras's '<type>:<index>' nor a TensorFlow device name")
    raise KerasDistributionError(
        f"keras.distribution device {text!r} cannot be used on the TensorFlow backend: {why}. "
        "Fix: build the mesh from keras.distribution.list_devices() (with tfdp these are the "
        "job's devices, 'cpu:0', 'gpu:1', ...).")


def plan_mesh(devices, *, device_type: str, per_worker: int, num_workers: int,
              rank: int) -> MeshPlan:
    """Maps a mesh's flat device list onto tfdp's job; returns this worker's ``MeshPlan``.

    Args:
        devices: the mesh's devices, flattened (strings).
        device_type: the type of tfdp's local devices ("CPU"/"GPU").
        per_worker: local devices per worker (L); num_workers, rank: the job.

    Raises:
        KerasDistributionError: a device of another type or backend, one outside the job, one
            listed twice, or a mesh that leaves a worker out or gives workers different
            numbers of devices (tfdp runs one collective group over every worker).
    """
    refs = [parse_device(d) for d in devices]
    if not refs:
        raise KerasDistributionError("the device mesh has no devices. Fix: pass "
                                     "keras.distribution.list_devices().")
    job = device_names(device_type, per_worker, num_workers)
    taken = []
    for name, ref in zip(devices, refs):
        if ref.device_type != device_type.upper():
            raise KerasDistributionError(
                f"mesh device {name!r} is a {ref.device_type} but this job's devices are "
                f"{device_type.upper()}s ({job[0]} ... {job[-1]}). Fix: build the mesh from "
                "keras.distribution.list_devices().")
        if ref.global_index is not None:
            g = ref.global_index
        else:
            task = rank if ref.task is None else ref.task
            if ref.local_index >= per_worker or task >= num_workers:
                g = -1
            else:
                g = task * per_worker + ref.local_index
        if not 0 <= g < len(job):
            raise KerasDistributionError(
                f"mesh device {name!r} is not a device of this job, which has {len(job)}: "
                f"{job[0]} ... {job[-1]} ({num_workers} worker(s) x {per_worker}). Fix: build "
                "the mesh from keras.distribution.list_devices() (for more CPU devices call "
                "tfdp.configure_cpu_replicas(n) first, or run under tfdp-run --cpu-replicas n).")
        taken.append(g)
    if len(set(taken)) != len(taken):
        raise KerasDistributionError(f"the device mesh lists a device twice: {list(devices)}.")
    per = [sorted(g % per_worker for g in taken if g // per_worker == w)
           for w in range(num_workers)]
    counts = {len(p) for p in per}
    if len(counts) != 1 or 0 in counts:
        raise KerasDistributionError(
            f"the device mesh takes {[len(p) for p in per]} device(s) from the job's "
            f"{num_workers} worker(s); tfdp trains every worker of the job as one group with "
            "the same number of replicas on each. Fix: use every worker's devices "
            "(keras.distribution.list_devices()), or the same number on each worker.")
    return MeshPlan(local_positions=tuple(per[rank]), num_replicas=len(taken),
                    device_type=device_type.upper())


def layout_shards(axes) -> bool:
    """Whether a ``TensorLayout``'s axes shard the variable (any axis named), so that tfdp
    stores it 1/N (ZeRO-3 storage); all-None axes mean replicated (mirrored)."""
    return any(axis is not None for axis in (axes or ()))


def initialize_workers(job_addresses, num_processes, process_id):
    """``keras.distribution.initialize``'s arguments -> ``(workers, rank)`` for TF_CONFIG, or
    None when there is nothing to start (one process, or no arguments at all).

    TensorFlow's collective runtime connects every worker to every other, so it needs every
    worker's address, where JAX needs only the coordinator's: ``job_addresses`` must list
    ``num_processes`` comma-separated ``host:port`` entries, in rank order.
    """
    if job_addresses is None and num_processes is None and process_id is None:
        return None
    if isinstance(job_addresses, (list, tuple)):
        addresses = [str(a).strip() for a in job_addresses if str(a).strip()]
    else:
        addresses = [a.strip() for a in str(job_addresses or "").split(",") if a.strip()]
    num = len(addresses) if num_processes is None else int(num_processes)
    if num <= 1:
        return None
    if len(addresses) != num:
        raise KerasDistributionError(
            f"keras.distribution.initialize(job_addresses={job_addresses!r}, "
            f"num_processes={num_processes}) on the TensorFlow backend needs every worker's "
            f"address ({num} comma-separated host:port entries, in rank order), not only the "
            "coordinator's as on JAX: TensorFlow's collective runtime connects each worker to "
            "every other. Fix: pass all addresses (or KERAS_DISTRIBUTION_JOB_ADDRESSES), or "
            "launch with tfdp-run / TF_CONFIG and call initialize() without arguments.")
    if process_id is None or not 0 <= int(process_id) < num:
        raise KerasDistributionError(
            f"keras.distribution.initialize: process_id={process_id!r} must be this worker's "
            f"rank, 0 ... {num - 1} (or KERAS_DISTRIBUTION_PROCESS_ID).")
    return addresses, int(process_id)
