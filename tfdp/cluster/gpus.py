"""Which GPUs a worker uses when several workers share a host; pure Python, no TensorFlow.

Rule: **when ``CUDA_VISIBLE_DEVICES`` is unset, the workers of one host (the workers whose
addresses name the same host) split the GPUs they all see: worker ``l`` of ``L`` on the host
takes ``[l*k, (l+1)*k)`` with ``k = G // L``** (one GPU each when ``G == L``, which is
Horovod's ``gpus[hvd.local_rank()]``); with fewer GPUs than workers, worker ``l`` takes GPU
``l % G`` and they share it (the strategy then picks ring collectives and says so). When
``CUDA_VISIBLE_DEVICES`` is set, whoever set it (Slurm, Kubernetes' device plugin, the user)
chose already, and tfdp uses what it sees. An explicit ``devices=`` wins over both; a Slurm
step's own rule (``tfdp.cluster.slurm.task_gpus``) comes first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tfdp.cluster.placement import host_of, placement_of

__all__ = ["host_of", "local_position", "local_gpus", "shared_host_gpus"]


def local_position(workers: Sequence[str], rank: int) -> tuple[int, int]:
    """``(local_rank, local_size)``: the position of worker ``rank`` among the workers on its
    host (in rank order), and how many there are (``tfdp.cluster.placement``'s rule). Example:
    ``["a:1", "a:2", "b:1"]``, rank 1 -> ``(1, 2)``."""
    p = placement_of(workers, rank)
    return p.local_rank, p.local_size


def local_gpus(local_rank: int, local_size: int, num_gpus: int,
               per_process: int | None = None) -> tuple:
    """Positions, among the GPUs all processes of one host see, for the process of
    ``local_rank`` (of ``local_size``).

    Args:
        per_process: GPUs per process; 1 is Horovod's rule (``gpus[hvd.local_rank()]``);
            None: an even share, ``[l*k, (l+1)*k)`` with ``k = num_gpus // local_size`` (the
            last ``num_gpus % local_size`` stay unused). Both give GPU ``l`` with one GPU per
            process.

    With fewer GPUs than processes, process ``l`` gets GPU ``l % num_gpus`` (shared). No GPU:
    ``()``.
    """
    if num_gpus < 1:
        return ()
    if local_size > num_gpus:
        return (local_rank % num_gpus,)
    share = num_gpus // local_size if per_process is None else min(per_process,
                                                                  num_gpus // local_size)
    return tuple(range(local_rank * share, (local_rank + 1) * share))


def shared_host_gpus(workers: Sequence[str], rank: int, num_gpus: int,
                     environ: Mapping[str, str]) -> tuple | None:
    """This worker's GPU positions under the module's rule, or None to use every GPU it sees
    (one worker on its host, no GPU, or ``CUDA_VISIBLE_DEVICES`` set)."""
    if num_gpus < 1 or len(workers) < 2 or "CUDA_VISIBLE_DEVICES" in environ:
        return None
    local_rank, local_size = local_position(workers, rank)
    if local_size < 2:
        return None
    return local_gpus(local_rank, local_size, num_gpus)
