"""Only the chief writes: which process is the chief, and where the others write.

Rule. tfdp follows TensorFlow's multi-worker convention: the chief (rank 0) writes to the real
path; every other worker writes the same data to a private temporary directory and deletes
it, so any collective that saving needs still runs on every worker. "The chief" is the
chief of this process's job: the job a multi-worker strategy of this process joined, else
the job the environment describes (``TF_CONFIG``, a Slurm step, ...), inside or outside any
strategy scope.
"""

from __future__ import annotations

import os
import tempfile

from tfdp.cluster import ClusterConfig, ClusterConfigError
from tfdp.strategy import lifecycle
from tfdp.strategy.chief_writes import private_root

__all__ = ["is_chief", "write_path", "cluster_of"]


def cluster_of(strategy=None) -> ClusterConfig:
    """The ``ClusterConfig`` of ``strategy``, or with none given, of this process's job.

    Args:
        strategy: a strategy; its ``cluster`` if it is tfdp's, one worker otherwise. None:
            the job this process joined (the cluster of its multi-worker tfdp strategy),
            else ``ClusterConfig.from_env()`` (one worker if the environment is malformed;
            building the strategy reports that), whatever strategy's scope is current.
    """
    if strategy is not None:
        cluster = getattr(strategy, "cluster", None)
        return cluster if isinstance(cluster, ClusterConfig) else ClusterConfig.single_worker()
    joined = lifecycle.job()
    if joined is not None:
        return joined
    try:
        return ClusterConfig.from_env()
    except ClusterConfigError:
        return ClusterConfig.single_worker()


def is_chief(strategy=None) -> bool:
    """True on the chief (rank 0) of this process's job, and in a single-process job.

    Args:
        strategy: answer for this strategy's cluster instead of the process's job.
    """
    return cluster_of(strategy).is_chief


def write_path(path: str, strategy=None) -> str:
    """Where this worker should write ``path``: ``path`` on the chief, else a private
    temporary directory (delete it after writing).

    Args:
        path: the path the script means.
        strategy: answer for this strategy's cluster instead of the process's job.
    """
    cluster = cluster_of(strategy)
    if cluster.is_chief:
        return path
    return os.path.join(private_root(cluster.rank, os.getpid(), tempfile.gettempdir()),
                        os.path.basename(os.path.normpath(path)))
