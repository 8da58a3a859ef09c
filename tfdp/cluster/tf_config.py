"""``TF_CONFIG`` -> a :class:`~tfdp.cluster.layout.Layout`, and the ring logic every JSON
layout shares. Pure Python, no TensorFlow.

Rule: tfdp is synchronous all-reduce data parallelism, so the training ring is the
``worker``s plus an optional ``chief`` (rank 0, then the workers in list order). Accepted
layouts: what Kubeflow's TFJob operator, Vertex AI, SageMaker (multi-worker mirrored mode),
tfdp-run and hand-written set-ups write::

    {"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"],
                 "evaluator": ["e:2222"]},
     "task": {"type": "worker", "index": 0}}

* ``master``, the older name TFJob and SageMaker still write, is the chief (noted).
* ``evaluator`` (TFJob's Evaluator replica) is not part of the ring: the training tasks leave
  it out (noted), and the evaluator task itself gets an error saying what to run there.
* ``ps`` is refused with the reason: parameter servers belong to ParameterServerStrategy.
* Other top-level keys (``environment``, ``job``, ``rpc_layer``) are accepted and ignored.
* Ray Train's layout (workers only) is parsed like any other; in a Ray worker whose peers
  all run on its host, :func:`parse` puts them on 127.0.0.1 (``tfdp.cluster.ray_train``).

The key -> role table and the refused roles are parameters of :func:`parse_dict`, so Vertex
AI's ``CLUSTER_SPEC`` (``tfdp.cluster.vertex``) reuses the same checks with its own names.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from tfdp.cluster import ray_train
from tfdp.cluster.errors import ClusterConfigError, fail, parse_address
from tfdp.cluster.layout import Layout

__all__ = ["ROLES", "REFUSED", "load_json", "parse", "parse_dict", "ring_from_cluster",
           "task_of", "evaluator_error"]

# Key -> role. Roles: the ring ("chief", "worker"), "evaluator" (left out), and refused ones.
ROLES = {"chief": "chief", "master": "chief", "worker": "worker", "evaluator": "evaluator",
         "ps": "ps"}
# Refused role -> (why, fix).
REFUSED = {
    "ps": ("parameter servers belong to ParameterServerStrategy",
           "remove the parameter servers and run every process as a worker (TFJob: no PS "
           "replicas; SageMaker: distribution={'multi_worker_mirrored_strategy': {'enabled': "
           "True}} instead of 'parameter_server')"),
}

_EXAMPLE = ('set it to JSON like {"cluster": {"worker": ["h0:2222", "h1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


def load_json(text: str, origin: str) -> Any:
    """``text`` decoded; malformed JSON is an error naming ``origin``."""
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise fail(origin, "(whole value)", text, f"not valid JSON ({e})", _EXAMPLE) from None


def parse(text: str, origin: str = "TF_CONFIG") -> Layout:
    """The ``TF_CONFIG`` JSON ``text`` (``origin`` names it in errors and is the source).

    In a Ray Train worker whose peers all run on its host, the addresses are on 127.0.0.1
    (``tfdp.cluster.ray_train``: Ray names the external interface even when it runs on loopback).
    """
    return ray_train.loopback_if_one_host(parse_dict(load_json(text, origin), origin))


def parse_dict(config: Any, origin: str = "TF_CONFIG", roles: Mapping[str, str] = ROLES,
               refused: Mapping[str, tuple] = REFUSED) -> Layout:
    """The decoded ``{"cluster": ..., "task": ...}`` of ``origin``, named by ``roles``."""
    if not isinstance(config, dict):
        raise fail(origin, "(whole value)", config, "must be a JSON object",
                   'give an object with "cluster" and "task" keys')
    spec, notes = ring_from_cluster(config.get("cluster"), origin, roles, refused)
    task_type, index = task_of(config.get("task"), spec, origin, roles, refused)
    return Layout(workers=spec.get("chief", ()) + spec.get("worker", ()), task_type=task_type,
                  task_index=index, cluster_spec=spec, source=origin, notes=tuple(notes))


def _refuse(origin: str, field: str, value: Any, reason: tuple) -> ClusterConfigError:
    problem, fix = reason
    return fail(origin, field, value,
                f"tfdp is synchronous all-reduce data parallelism; {problem}", fix)


def ring_from_cluster(cluster: Any, origin: str, roles: Mapping[str, str],
                      refused: Mapping[str, tuple]) -> tuple:
    """``({"chief": (...), "worker": (...)}, notes)`` from a layout's ``cluster`` object."""
    example = 'add "cluster": {"worker": ["host:port", ...]}'
    if cluster is None:
        raise fail(origin, "cluster", None, "missing", example)
    if not isinstance(cluster, dict):
        raise fail(origin, "cluster", cluster, "must be an object of task type -> address list",
                   example)
    spec, notes, named = {}, [], {}
    for key, addresses in cluster.items():
        role = roles.get(key)
        if role in refused:
            raise _refuse(origin, f"cluster.{key}", addresses, refused[role])
        if role is None:
            known = ", ".join(repr(k) for k, r in roles.items() if r in ("chief", "worker"))
            raise fail(origin, f"cluster.{key}", addresses, "unknown task type",
                       f"use only {known}")
        if not isinstance(addresses, list):
            raise fail(origin, f"cluster.{key}", addresses, "must be a list of addresses",
                       f'write "{key}": ["host:port", ...]')
        if role == "evaluator":
            notes.append(f"{key} ({len(addresses)} task(s)) is not part of training")
            continue
        if role in named:
            raise fail(origin, f"cluster.{key}", addresses,
                       f"both {named[role]!r} and {key!r} name the {role}", "keep one of them")
        named[role] = key
        if key != role:
            notes.append(f"{key} is the {role}")
        spec[role] = tuple(parse_address(origin, f"cluster.{key}[{i}]", a)
                           for i, a in enumerate(addresses))
    if len(spec.get("chief", ())) > 1:
        raise fail(origin, f"cluster.{named['chief']}", list(spec["chief"]),
                   "there can be only one chief",
                   "list one chief address, or make the others workers")
    if not spec.get("worker") and not spec.get("chief"):
        key = next((k for k, r in roles.items() if r == "worker"), "worker")
        raise fail(origin, f"cluster.{key}", cluster.get(key), "the worker list is empty",
                   f'list at least one "host:port" under cluster.{key}')
    _check_unique(spec.get("chief", ()) + spec.get("worker", ()), origin)
    return {r: spec[r] for r in ("chief", "worker") if r in spec}, notes


def _check_unique(workers: tuple, origin: str) -> None:
    """Two ranks at one address would wait for each other forever."""
    seen: dict[str, int] = {}
    for i, address in enumerate(workers):
        if address in seen:
            raise fail(origin, "cluster", address,
                       f"the address appears twice (ranks {seen[address]} and {i})",
                       "give every task its own host:port")
        seen[address] = i


def task_of(task: Any, spec: Mapping[str, tuple], origin: str, roles: Mapping[str, str],
            refused: Mapping[str, tuple]) -> tuple:
    """``(task type, index)`` of this process, mapped to the ring's names."""
    if task is None:
        raise fail(origin, "task", None, "missing",
                   'add "task": {"type": "worker", "index": <this process\'s index>}')
    if not isinstance(task, dict):
        raise fail(origin, "task", task, "must be an object",
                   'write "task": {"type": "worker", "index": 0}')
    given = task.get("type")
    role = roles.get(given) if isinstance(given, str) else None
    if role == "evaluator":
        raise evaluator_error(origin, given)
    if role in refused:
        raise _refuse(origin, "task.type", given, refused[role])
    if role not in spec:
        names = sorted(k for k, r in roles.items() if r in spec)
        raise fail(origin, "task.type", given,
                   f"must be one of the cluster's task types {names}",
                   "set task.type to the type this process was given in the cluster")
    index = task.get("index", 0)
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise fail(origin, "task.index", index, "must be an integer",
                   "set task.index to this process's position in its task list")
    if not 0 <= index < len(spec[role]):
        raise fail(origin, "task.index", index,
                   f"out of range for {len(spec[role])} {given} address(es)",
                   f"use an index from 0 to {len(spec[role]) - 1}")
    return role, index


def evaluator_error(origin: str, task_type: str) -> ClusterConfigError:
    """The evaluator task's error: it is no part of the ring, and what to run there instead."""
    return fail(
        origin, "task.type", task_type,
        "this process is the job's evaluator, which is not part of tfdp's synchronous training "
        "ring, so it cannot build a DataParallelStrategy",
        f"in this process evaluate without a strategy, branching on task.type of {origin} "
        "(e.g. for each path in tf.train.checkpoints_iterator(backup_dir): load the weights, "
        "model.evaluate(...)); or drop the evaluator replicas and give model.fit "
        "validation_data on the workers")
