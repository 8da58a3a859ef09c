"""Where this process sits in a job -> ``ClusterConfig``. Pure Python, no TensorFlow import.

``ClusterConfig.from_env()`` tries these sources in turn; the first one present wins, and the
strategy logs which one it was (``ClusterConfig.source``) once at INFO:

1. ``TF_CONFIG``: what Kubeflow's TFJob operator, Vertex AI, SageMaker (multi-worker mirrored
   mode), tfdp-run and hand-written set-ups give (``tfdp.cluster.tf_config``).
2. ``CLUSTER_SPEC``: Vertex AI's layout, worker pools ``workerpool0`` (the primary replica:
   chief) and ``workerpool1`` (workers) (``tfdp.cluster.vertex``).
3. ``SM_HOSTS`` + ``SM_CURRENT_HOST``: SageMaker's host list; every host is a worker, rank =
   its position in ``SM_HOSTS``, port ``TFDP_PORT_BASE`` (default 20000) + rank
   (``tfdp.cluster.sagemaker``).
4. Slurm: inside an ``srun`` step of several tasks, every task is a worker
   (``tfdp.cluster.slurm``).
5. A pod of a Kubernetes indexed Job or JobSet (``JOB_COMPLETION_INDEX`` and
   ``TFDP_NUM_WORKERS`` > 1): every pod a worker, addressed by its headless-service hostname
   (``tfdp.cluster.kubernetes``; logged as "Kubernetes indexed Job" or "JobSet").
6. Otherwise one worker (with a note when this is the batch script of a multi-task Slurm
   allocation, where ``srun`` was probably meant, or an indexed Job's pod without
   ``TFDP_NUM_WORKERS``).

:func:`layout_from_env` is that order, and the only place it is implemented.
``ClusterConfig.from_resolver`` takes any TensorFlow ``ClusterResolver`` instead (duck typed:
``cluster_spec()``, ``task_type``, ``task_id``; ``tfdp.cluster.resolver``).

Task types. tfdp is synchronous all-reduce data parallelism: the training ring is the
``worker``s plus an optional ``chief`` (rank 0; ``master`` is the chief too). Evaluators are
left out of the ring, parameter servers refused; ``tfdp.cluster.tf_config`` and
``tfdp.cluster.vertex`` state the rules per layout.

Rule of the package: each parser reads one source and returns a plain
:class:`~tfdp.cluster.layout.Layout`; this module alone builds ``ClusterConfig`` from one, so it
imports the parsers and none of them imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from tfdp.cluster import resolver as _resolver
from tfdp.cluster import kubernetes, sagemaker, slurm, tf_config, vertex
from tfdp.cluster.errors import DEFAULT_PORT_BASE, ClusterConfigError, port_base
from tfdp.cluster.layout import Layout

__all__ = ["ClusterConfig", "ClusterConfigError", "DEFAULT_PORT_BASE", "port_base", "layout_from_env"]


def layout_from_env(environ: Mapping[str, str]) -> Layout:
    """The first source present in ``environ``, in the order of the module docstring.

    Raises:
        ClusterConfigError: the source found is malformed or unsupported.
    """
    if environ.get("TF_CONFIG", "").strip():
        return tf_config.parse(environ["TF_CONFIG"])
    if environ.get(vertex.ORIGIN, "").strip():
        return vertex.parse(environ[vertex.ORIGIN])
    if environ.get("SM_HOSTS", "").strip():
        return sagemaker.parse(environ)
    step = slurm.read_layout(environ)
    if step is not None:
        return step
    pod = kubernetes.read_layout(environ)
    if pod is not None:
        return pod
    notes = (slurm.batch_step_note(environ), kubernetes.single_pod_note(environ))
    return Layout(source="single", notes=tuple(note for note in notes if note))


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Where this process sits in a synchronous data-parallel job.

    Attributes:
        workers: every task's ``host:port`` in rank order (chief first if there is one).
        task_type: ``"chief"`` or ``"worker"`` (``"worker"`` for a single process).
        task_index: index of this task within its task type.
        cluster_spec: ``{"chief": (...), "worker": (...)}``: the training ring only; empty for
            a single process. Used to build TensorFlow's cluster resolver.
        source: where the layout came from: ``"TF_CONFIG"``, ``"CLUSTER_SPEC"``,
            ``"SM_HOSTS"``, ``"Slurm"``, ``"Kubernetes indexed Job"``, ``"JobSet"``,
            ``"cluster_resolver"``, ``"single"`` (nothing found)
            or ``"given"`` (constructed directly). Not part of equality.
        task_gpus: positions in ``CUDA_VISIBLE_DEVICES`` this task uses, or None for all it
            sees (set under Slurm when a node's tasks share its GPUs; ``tfdp.cluster.slurm``).
        notes: what the strategy should say about the layout (entries left out, names mapped).
    """

    workers: list = dataclasses.field(default_factory=list)
    task_type: str = "worker"
    task_index: int = 0
    cluster_spec: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    source: str = dataclasses.field(default="given", compare=False)
    task_gpus: tuple | None = dataclasses.field(default=None, compare=False)
    notes: tuple = dataclasses.field(default=(), compare=False)

    @property
    def num_workers(self) -> int:
        """Number of processes in the job (1 when there is no cluster)."""
        return max(1, len(self.workers))

    @property
    def rank(self) -> int:
        """This process's position in ``workers``."""
        if self.task_type == "chief":
            return 0
        return self.task_index + (1 if self.cluster_spec.get("chief") else 0)

    @property
    def is_chief(self) -> bool:
        """The chief writes checkpoints and logs: the ``chief`` task, else worker 0."""
        return self.rank == 0

    @property
    def is_multi_worker(self) -> bool:
        return self.num_workers > 1

    def describe(self) -> str:
        """One line for the log: the source, this task's place, and the notes."""
        where = f"rank {self.rank} of {self.num_workers} worker(s)"
        if self.workers:
            where += f" ({self.task_type} {self.task_index} at {self.workers[self.rank]})"
        extra = "".join(f"; {note}" for note in self.notes)
        gpus = "" if self.task_gpus is None else f"; GPUs at positions {list(self.task_gpus)}"
        return f"cluster from {self.source}: {where}{gpus}{extra}"

    @classmethod
    def from_layout(cls, layout: Layout) -> "ClusterConfig":
        """The config of a parser's :class:`~tfdp.cluster.layout.Layout`."""
        return cls(workers=list(layout.workers), task_type=layout.task_type,
                   task_index=layout.task_index, cluster_spec=dict(layout.cluster_spec),
                   source=layout.source, task_gpus=layout.task_gpus, notes=tuple(layout.notes))

    @classmethod
    def single_worker(cls, note: str | None = None) -> "ClusterConfig":
        return cls(source="single", notes=(note,) if note else ())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClusterConfig":
        """The first of ``TF_CONFIG``, ``CLUSTER_SPEC``, ``SM_HOSTS``, a Slurm step of several
        tasks, a Kubernetes indexed Job or JobSet of several pods, else one worker
        (:func:`layout_from_env`). ``environ`` defaults to ``os.environ``.

        Raises:
            ClusterConfigError: the source found is malformed or unsupported.
        """
        return cls.from_layout(layout_from_env(os.environ if environ is None else environ))

    @classmethod
    def from_json(cls, text: str, origin: str = "TF_CONFIG") -> "ClusterConfig":
        """Parses ``TF_CONFIG`` (or, with ``origin="CLUSTER_SPEC"``, Vertex AI's layout)."""
        if origin == vertex.ORIGIN:
            return cls.from_layout(vertex.parse(text))
        return cls.from_layout(tf_config.parse(text, origin))

    @classmethod
    def from_dict(cls, config: Any, origin: str = "TF_CONFIG") -> "ClusterConfig":
        """The parsed ``{"cluster": ..., "task": ...}`` of ``origin`` (see ``from_json``)."""
        if origin == vertex.ORIGIN:
            return cls.from_layout(vertex.parse_dict(config))
        return cls.from_layout(tf_config.parse_dict(config, origin))

    @classmethod
    def from_sagemaker(cls, environ: Mapping[str, str]) -> "ClusterConfig":
        """SageMaker's ``SM_HOSTS`` (a JSON list) and ``SM_CURRENT_HOST``: every host a worker,
        rank = position in ``SM_HOSTS``, port ``TFDP_PORT_BASE`` (default 20000) + rank."""
        return cls.from_layout(sagemaker.parse(environ))

    @classmethod
    def from_resolver(cls, resolver: Any) -> "ClusterConfig":
        """A TensorFlow ``tf.distribute.cluster_resolver.ClusterResolver`` (or anything with
        ``cluster_spec()``, ``task_type`` and ``task_id``); see ``from_resolver_spec``."""
        return cls.from_layout(_resolver.parse(resolver))

    @classmethod
    def from_resolver_spec(cls, spec: Mapping[str, Any], task_type: Any,
                           task_id: Any) -> "ClusterConfig":
        """A resolver's ``cluster_spec().as_dict()``, ``task_type`` and ``task_id`` (pure).

        Jobs are named as in ``TF_CONFIG`` (``chief``/``master``, ``worker``, ``evaluator``;
        ``ps`` refused). A sparse job (``{task index: address}``) must list indices 0..n-1. An
        empty spec is one worker.
        """
        return cls.from_layout(_resolver.parse_spec(spec, task_type, task_id))

    def to_dict(self) -> dict:
        """The TF_CONFIG dictionary for this task (inverse of ``from_dict``)."""
        return {"cluster": {k: list(v) for k, v in self.cluster_spec.items()},
                "task": {"type": self.task_type, "index": self.task_index}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
