"""Local device discovery and ``configure_cpu_replicas``.

On a host without GPUs, TensorFlow exposes one CPU device. For development tfdp splits it
into ``n`` logical devices so one process looks like ``n`` replicas, exactly as it would
look with ``n`` GPUs: every code path except the NCCL kernels runs.
"""

from __future__ import annotations

import os

import tensorflow as tf

# Set by tfdp-run so that DataParallelStrategy() in each worker splits its CPU without any
# change to the user's script; defined with the rest of the launcher protocol.
from tfdp.cluster import CPU_REPLICAS_ENV

__all__ = ["configure_cpu_replicas", "local_devices", "CPU_REPLICAS_ENV"]


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
