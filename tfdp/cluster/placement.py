"""Horovod's ranks of a process (rank, local rank, cross rank, ...) from the job's worker
addresses. Pure Python, no TensorFlow.

Rule (Horovod's definitions, over the hosts of the worker addresses in rank order):
``local_rank`` counts the earlier ranks on this host, ``local_size`` the ranks on this host,
``cross_rank`` the earlier ranks with this ``local_rank`` (with as many slots on every host:
the host's index), ``cross_size`` the ranks with this ``local_rank``. One home for the rule:
``hvd.local_rank()`` etc. (tfdp.horovod) and the ``HOROVOD_*`` variables tfdp-run gives each
worker (tfdp.launcher) both come from :func:`placement_of`, so they always agree.

Rule for GPU memory (:func:`shared_host_environment`): TensorFlow reserves almost all of every
visible GPU's memory in the first process that uses it, which fits one process per host. A
worker that shares its host with other workers (``local_size > 1``) therefore gets
``TF_FORCE_GPU_ALLOW_GROWTH=true`` (memory taken as needed), unless the job's environment sets
that variable itself. Measured on an H100: ``tfdp-run --workers 2`` on a one-GPU host without it
ended with the first worker's ``CUDA_ERROR_OUT_OF_MEMORY`` (SIGABRT) at its first step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["Placement", "host_of", "placement_of", "placement", "horovod_environment",
           "shared_host_environment", "GPU_MEMORY_GROWTH_ENV"]

GPU_MEMORY_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"


@dataclasses.dataclass(frozen=True)
class Placement:
    """One process's ranks, Horovod's definitions (see the module docstring)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


def host_of(address: str) -> str:
    """The host of ``host:port`` or of a bare host (IPv6 brackets removed): the one rule for
    which workers share a host (local ranks, GPU splits, Horovod's environment)."""
    text = str(address)
    host, sep, port = text.rpartition(":")
    if not sep or text.endswith("]") or not port.isdigit():
        host = text  # no port: a bare host name, or a bracketed IPv6 address
    return host.strip("[]")


def placement_of(addresses: Sequence[str], rank: int) -> Placement:
    """The ranks of ``rank`` in a job whose workers are at ``addresses`` (``host:port`` or a
    bare host, rank order)."""
    size = len(addresses)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not one of the job's {size} workers")
    hosts = [host_of(a) for a in addresses]
    local = [hosts[:r].count(hosts[r]) for r in range(size)]
    per_host = {h: hosts.count(h) for h in hosts}
    mine = local[rank]
    same_local = [r for r in range(size) if local[r] == mine]
    return Placement(rank=rank, size=size, local_rank=mine, local_size=per_host[hosts[rank]],
                     cross_rank=same_local.index(rank), cross_size=len(same_local),
                     homogeneous=len(set(per_host.values())) == 1)


def placement(cluster) -> Placement:
    """The ranks of a ``tfdp.ClusterConfig``'s process (one worker without addresses)."""
    if not cluster.workers:
        return Placement(cluster.rank, cluster.num_workers, 0, 1, 0, 1, True)
    return placement_of(cluster.workers, cluster.rank)


def horovod_environment(p: Placement) -> dict:
    """What horovodrun (and Open MPI's mpirun) gives a process about its place in the job, as
    ``tfdp-run`` sets it for every worker (tfdp.protocol lists the names)."""
    return {"HOROVOD_RANK": str(p.rank), "HOROVOD_SIZE": str(p.size),
            "HOROVOD_LOCAL_RANK": str(p.local_rank), "HOROVOD_LOCAL_SIZE": str(p.local_size),
            "HOROVOD_CROSS_RANK": str(p.cross_rank), "HOROVOD_CROSS_SIZE": str(p.cross_size),
            "OMPI_COMM_WORLD_RANK": str(p.rank), "OMPI_COMM_WORLD_SIZE": str(p.size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(p.local_rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(p.local_size)}


def shared_host_environment(p: Placement, environ) -> dict:
    """What a worker that shares its host gets so that its GPU memory is taken as needed
    (the module docstring's rule for GPU memory); empty for a worker alone on its host or
    where ``environ`` already says."""
    if p.local_size > 1 and GPU_MEMORY_GROWTH_ENV not in environ:
        return {GPU_MEMORY_GROWTH_ENV: "true"}
    return {}
