"""TF_CONFIG -> ClusterConfig.

Pure Python: no TensorFlow import, so the launcher and tests can use it cheaply.

tfdp is synchronous all-reduce data parallelism, so the only task types it accepts are
``worker`` and an optional ``chief`` (which is then one more worker, rank 0). Parameter
servers and evaluators belong to other training styles and are rejected with a message
that says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

__all__ = ["ClusterConfig", "ClusterConfigError", "CPU_REPLICAS_ENV", "READY_FILE_ENV", "RANK_ENV",
           "SLOT_ENV", "ATTEMPT_ENV", "CONTROL_DIR_ENV", "MIN_WORKERS_ENV", "RESTARTS_LEFT_ENV",
           "GRACE_ENV", "EXIT_PREEMPTED", "EXIT_RESTART_REQUESTED", "EVICT_FILE", "progress_file"]

# The launcher protocol's names live in tfdp.protocol; re-exported here because earlier
# releases defined them in this module.
from tfdp.protocol import (ATTEMPT_ENV, CONTROL_DIR_ENV, CPU_REPLICAS_ENV,  # noqa: E402,F401
                           EVICT_FILE, EXIT_PREEMPTED, EXIT_RESTART_REQUESTED, GRACE_ENV,
                           MIN_WORKERS_ENV, RANK_ENV, READY_FILE_ENV, RESTARTS_LEFT_ENV, SLOT_ENV,
                           progress_file)

_ACCEPTED_TASK_TYPES = ("chief", "worker")
_REJECTED_TASK_TYPES = {
    "ps": "parameter servers belong to ParameterServerStrategy",
    "evaluator": "a side-car evaluator belongs to ParameterServerStrategy/Estimator setups",
}


class ClusterConfigError(ValueError):
    """A malformed or unsupported TF_CONFIG; the message names the field, value and fix."""


def _fail(field: str, value: Any, problem: str, fix: str) -> ClusterConfigError:
    return ClusterConfigError(
        f"TF_CONFIG {field}={value!r}: {problem}. Fix: {fix}."
    )


def _parse_address(field: str, address: Any) -> str:
    if not isinstance(address, str) or not address:
        raise _fail(field, address, "an address must be a non-empty 'host:port' string",
                    "write each address as \"host:port\", e.g. \"10.0.0.2:2222\"")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise _fail(field, address, "the address has no ':port' part",
                    "write it as \"host:port\", e.g. \"10.0.0.2:2222\"")
    if not port.isdigit():
        raise _fail(field, address, f"the port {port!r} is not a number",
                    "use a decimal port between 1 and 65535")
    if not 0 < int(port) < 65536:
        raise _fail(field, address, f"the port {port} is out of range",
                    "use a port between 1 and 65535")
    return address


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Where this process sits in a synchronous data-parallel job.

    Attributes:
        workers: every task's ``host:port`` in rank order (chief first if there is one).
        task_type: ``"chief"`` or ``"worker"`` (``"worker"`` for a single process).
        task_index: index of this task within its task type.
        cluster_spec: the ``{"chief": [...], "worker": [...]}`` mapping as given; empty for
            a single process. Used to build TensorFlow's cluster resolver.
    """

    workers: list = dataclasses.field(default_factory=list)
    task_type: str = "worker"
    task_index: int = 0
    cluster_spec: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        """Number of processes in the job (1 when there is no TF_CONFIG)."""
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

    @classmethod
    def single_worker(cls) -> "ClusterConfig":
        return cls()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClusterConfig":
        """Reads ``TF_CONFIG`` from ``environ`` (default ``os.environ``); absent => single worker."""
        environ = os.environ if environ is None else environ
        text = environ.get("TF_CONFIG", "")
        if not text.strip():
            return cls.single_worker()
        return cls.from_json(text)

    @classmethod
    def from_json(cls, text: str) -> "ClusterConfig":
        try:
            config = json.loads(text)
        except (TypeError, ValueError) as e:
            raise _fail("(whole value)", text, f"not valid JSON ({e})",
                        'set TF_CONFIG to JSON like {"cluster": {"worker": ["h0:2222", '
                        '"h1:2222"]}, "task": {"type": "worker", "index": 0}}') from None
        return cls.from_dict(config)

    @classmethod
    def from_dict(cls, config: Any) -> "ClusterConfig":
        if not isinstance(config, dict):
            raise _fail("(whole value)", config, "must be a JSON object",
                        'give an object with "cluster" and "task" keys')
        cluster = config.get("cluster")
        if cluster is None:
            raise _fail("cluster", None, "missing",
                        'add "cluster": {"worker": ["host:port", ...]}')
        if not isinstance(cluster, dict):
            raise _fail("cluster", cluster, "must be an object of task type -> address list",
                        'write "cluster": {"worker": ["host:port", ...]}')
        for task_type in cluster:
            if task_type in _REJECTED_TASK_TYPES:
                raise _fail(f"cluster.{task_type}", cluster[task_type],
                            f"tfdp is synchronous all-reduce data parallelism; "
                            f"{_REJECTED_TASK_TYPES[task_type]}",
                            f"remove the {task_type!r} entry and run every process as a worker")
            if task_type not in _ACCEPTED_TASK_TYPES:
                raise _fail(f"cluster.{task_type}", cluster[task_type],
                            "unknown task type", "use only 'worker' and optionally 'chief'")
        spec: dict[str, tuple] = {}
        for task_type in _ACCEPTED_TASK_TYPES:
            if task_type not in cluster:
                continue
            addresses = cluster[task_type]
            if not isinstance(addresses, list):
                raise _fail(f"cluster.{task_type}", addresses, "must be a list of addresses",
                            f'write "{task_type}": ["host:port", ...]')
            spec[task_type] = tuple(
                _parse_address(f"cluster.{task_type}[{i}]", a) for i, a in enumerate(addresses))
        if len(spec.get("chief", ())) > 1:
            raise _fail("cluster.chief", list(spec["chief"]), "there can be only one chief",
                        "list one chief address, or make the others workers")
        if not spec.get("worker") and not spec.get("chief"):
            raise _fail("cluster.worker", cluster.get("worker"), "the worker list is empty",
                        "list at least one \"host:port\" under cluster.worker")
        workers = list(spec.get("chief", ()) + spec.get("worker", ()))
        seen: dict[str, int] = {}
        for i, address in enumerate(workers):
            if address in seen:
                raise _fail("cluster", address,
                            f"the address appears twice (ranks {seen[address]} and {i})",
                            "give every task its own host:port")
            seen[address] = i

        task = config.get("task")
        if task is None:
            raise _fail("task", None, "missing",
                        'add "task": {"type": "worker", "index": <this process\'s index>}')
        if not isinstance(task, dict):
            raise _fail("task", task, "must be an object", 'write "task": {"type": "worker", "index": 0}')
        task_type = task.get("type")
        if task_type in _REJECTED_TASK_TYPES:
            raise _fail("task.type", task_type,
                        f"tfdp is synchronous all-reduce data parallelism; "
                        f"{_REJECTED_TASK_TYPES[task_type]}", "run this process as a 'worker'")
        if task_type not in spec:
            raise _fail("task.type", task_type,
                        f"must be one of the cluster's task types {sorted(spec)}",
                        "set task.type to 'worker' (or 'chief' if the cluster has one)")
        index = task.get("index", 0)
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        if isinstance(index, bool) or not isinstance(index, int):
            raise _fail("task.index", index, "must be an integer",
                        "set task.index to this process's position in its task list")
        if not 0 <= index < len(spec[task_type]):
            raise _fail("task.index", index,
                        f"out of range for {len(spec[task_type])} {task_type} address(es)",
                        f"use an index from 0 to {len(spec[task_type]) - 1}")
        return cls(workers=workers, task_type=task_type, task_index=index, cluster_spec=spec)

    def to_dict(self) -> dict:
        """The TF_CONFIG dictionary for this task (inverse of ``from_dict``)."""
        return {"cluster": {k: list(v) for k, v in self.cluster_spec.items()},
                "task": {"type": self.task_type, "index": self.task_index}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
