"""Vertex AI's ``CLUSTER_SPEC`` -> a :class:`~tfdp.cluster.layout.Layout`. Pure Python.

Rule: ``CLUSTER_SPEC`` is ``TF_CONFIG``'s shape with worker pools for task types, so it goes
through ``tfdp.cluster.tf_config``'s ring and task checks with this table of names::

    {"cluster": {"workerpool0": ["cmle-training-workerpool0-...:2222"],
                 "workerpool1": ["cmle-training-workerpool1-...-0:2222", ...]},
     "task": {"type": "workerpool1", "index": 0, "trial": ""}, "job": "..."}

* ``workerpool0``, the primary replica, is the chief (rank 0); ``workerpool1`` are the workers.
* ``workerpool2`` (parameter servers, or Vertex AI's Reduction Server) is refused with the
  reason: tfdp all-reduces with TensorFlow's collectives and uses neither.
* ``workerpool3`` is the evaluator: left out of the ring, as in ``TF_CONFIG``.
* Other top-level keys (``environment``, ``job``) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from tfdp.cluster import tf_config
from tfdp.cluster.layout import Layout

__all__ = ["ORIGIN", "ROLES", "REFUSED", "parse", "parse_dict"]

ORIGIN = "CLUSTER_SPEC"
ROLES = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps/reduction",
         "workerpool3": "evaluator"}
REFUSED = {
    "ps/reduction": ("the third worker pool holds parameter servers or Vertex AI's Reduction "
                     "Server, and tfdp all-reduces between the workers with TensorFlow's "
                     "collectives, using neither",
                     "leave workerPoolSpecs[2] empty"),
}


def parse(text: str) -> Layout:
    """The ``CLUSTER_SPEC`` JSON ``text``."""
    return parse_dict(tf_config.load_json(text, ORIGIN))


def parse_dict(config: Any) -> Layout:
    """The decoded ``CLUSTER_SPEC`` object."""
    return tf_config.parse_dict(config, ORIGIN, ROLES, REFUSED)
