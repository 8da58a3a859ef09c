"""A TensorFlow ``ClusterResolver`` -> a :class:`~tfdp.cluster.layout.Layout`. Pure Python:
the resolver is duck typed, and nothing here imports TensorFlow.

Rule: a resolver's ``cluster_spec().as_dict()``, ``task_type`` and ``task_id`` name jobs as
``TF_CONFIG`` does (``chief``/``master``, ``worker``, ``evaluator``; ``ps`` refused), so they go
through ``tfdp.cluster.tf_config``'s checks. Accepted: a job as a list of addresses, or sparse
(``{task index: address}``, as ``tf.train.ClusterSpec`` allows) when its indices are 0..n-1;
an empty spec is one worker. The source is ``"cluster_resolver"``.
"""

from __future__ import annotations

from typing import Any, Mapping

from tfdp.cluster import tf_config
from tfdp.cluster.errors import fail
from tfdp.cluster.layout import Layout

__all__ = ["ORIGIN", "parse", "parse_spec"]

ORIGIN = "cluster_resolver"


def parse(resolver: Any) -> Layout:
    """Anything with ``cluster_spec()``, ``task_type`` and ``task_id``; see :func:`parse_spec`.

    Raises:
        TypeError: ``resolver`` lacks one of the three.
    """
    for name in ("cluster_spec", "task_type", "task_id"):
        if not hasattr(resolver, name):
            raise TypeError(f"cluster_resolver={resolver!r} has no {name!r}: pass a "
                            "tf.distribute.cluster_resolver.ClusterResolver.")
    spec = resolver.cluster_spec()
    spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
    return parse_spec(spec, resolver.task_type, resolver.task_id)


def parse_spec(spec: Mapping[str, Any], task_type: Any, task_id: Any) -> Layout:
    """A resolver's ``cluster_spec().as_dict()``, ``task_type`` and ``task_id``."""
    if not isinstance(spec, Mapping):
        raise fail(ORIGIN, "cluster_spec()", spec, "not a mapping of job -> addresses",
                   "return a tf.train.ClusterSpec from cluster_spec()")
    if not spec:
        return Layout(source=ORIGIN)
    cluster = {}
    for job, tasks in spec.items():
        if isinstance(tasks, Mapping):
            if sorted(tasks) != list(range(len(tasks))):
                raise fail(ORIGIN, f"cluster.{job}", dict(tasks),
                           "task indices must be 0..n-1 with none missing",
                           "give every task of the job an address")
            tasks = [tasks[i] for i in range(len(tasks))]
        cluster[job] = list(tasks) if isinstance(tasks, (list, tuple)) else tasks
    if task_type is None:
        raise fail(ORIGIN, "task.type", None, "the resolver names no task type",
                   "set the resolver's task_type and task_id for this process")
    return tf_config.parse_dict({"cluster": cluster, "task": {"type": task_type,
                                                              "index": task_id or 0}}, ORIGIN)
