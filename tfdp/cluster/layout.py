"""What every cluster parser returns: a :class:`Layout`, plain data. Pure Python, no imports
from tfdp.

Rule: the parsers (``tf_config``, ``vertex``, ``sagemaker``, ``slurm``, ``resolver``) read one
source each and return a ``Layout``; only ``tfdp.cluster.config`` turns one into the public
``ClusterConfig``. So no parser imports ``config``, and ``config`` imports every parser.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

__all__ = ["Layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """One source's answer; the fields mean what ``ClusterConfig``'s fields of the same name do.

    ``workers`` is every task's ``host:port`` in rank order (chief first), ``cluster_spec`` the
    training ring (``{"chief": (...), "worker": (...)}``, empty for one process), ``source`` the
    name the strategy logs, ``task_gpus`` positions in ``CUDA_VISIBLE_DEVICES`` (None: all),
    ``notes`` what the strategy should say about the layout.
    """

    workers: tuple = ()
    task_type: str = "worker"
    task_index: int = 0
    cluster_spec: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    source: str = "given"
    task_gpus: tuple | None = None
    notes: tuple = ()

    @classmethod
    def of_workers(cls, workers, rank: int, source: str, task_gpus: tuple | None = None,
                   notes: tuple = ()) -> "Layout":
        """Every task a ``worker``, this one at ``rank`` (SageMaker, Slurm)."""
        workers = tuple(workers)
        return cls(workers=workers, task_type="worker", task_index=rank,
                   cluster_spec={"worker": workers}, source=source, task_gpus=task_gpus,
                   notes=tuple(notes))
