"""Only the chief writes: which process is the chief, and where the others write.

Rule. tfdp follows TensorFlow's multi-worker convention: the chief (rank 0) writes to the real
path; every other worker writes the same data to a private temporary directory and deletes
it, so any collective that saving needs still runs on every worker.
"""

from __future__ import annotations

import os
import tempfile

from tfdp.cluster import ClusterConfig

__all__ = ["is_chief", "write_path", "cluster_of"]


def cluster_of(strategy=None) -> ClusterConfig:
    """The ``ClusterConfig`` of ``strategy`` (default: the current one); one worker for a
    strategy that is not tfdp's."""
    if strategy is None:
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
    cluster = getattr(strategy, "cluster", None)
    return cluster if isinstance(cluster, ClusterConfig) else ClusterConfig.single_worker()


def is_chief(strategy=None) -> bool:
    """True in single-process jobs and on the chief (rank 0) of a tfdp multi-worker job."""
    return cluster_of(strategy).is_chief


def write_path(path: str, strategy=None) -> str:
    """Where this worker should write ``path``: ``path`` on the chief, else a private
    temporary directory (delete it after writing)."""
    cluster = cluster_of(strategy)
    if cluster.is_chief:
        return path
    return os.path.join(tempfile.gettempdir(), f"tfdp-worker{cluster.rank}-{os.getpid()}",
                        os.path.basename(os.path.normpath(path)))
