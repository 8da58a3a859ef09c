"""Where this process sits in a job -> ``ClusterConfig``. Pure Python, no TensorFlow import.

``ClusterConfig.from_env()`` tries these sources in turn; the first one present wins, and the
strategy logs which one it was (``ClusterConfig.source``) once at INFO:

1. ``TF_CONFIG``: what Kubeflow's TFJob operator, Vertex AI, SageMaker (multi-worker mirrored
   mode), tfdp-run and hand-written set-ups give.
2. ``CLUSTER_SPEC``: Vertex AI's layout, worker pools ``workerpool0`` (the primary replica:
   chief) and ``workerpool1`` (workers).
3. ``SM_HOSTS`` + ``SM_CURRENT_HOST``: SageMaker's host list; every host is a worker, rank =
   its position in ``SM_HOSTS``, port ``TFDP_PORT_BASE`` (default 20000) + rank.
4. Slurm: inside an ``srun`` step of several tasks, every task is a worker (``tfdp.slurm``).
5. Otherwise one worker.

``ClusterConfig.from_resolver`` takes any TensorFlow ``ClusterResolver`` instead (duck typed:
``cluster_spec()``, ``task_type``, ``task_id``).

Task types. tfdp is synchronous all-reduce data parallelism: the training ring is the
``worker``s plus an optional ``chief`` (rank 0; ``master``, the older name TFJob and SageMaker
still write, is the chief). An ``evaluator`` entry (TFJob's Evaluator replica, Vertex's
``workerpool3``) is not part of the ring: the training tasks leave it out, and the evaluator
task itself gets an error saying what to run there instead. Parameter servers (``ps``, Vertex's
``workerpool2``, which may also be its Reduction Server) are refused with the reason. Other
top-level keys (``environment``, ``job``, ``rpc_layer``) are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

__all__ = ["ClusterConfig", "ClusterConfigError", "CPU_REPLICAS_ENV", "READY_FILE_ENV", "RANK_ENV",
           "SLOT_ENV", "ATTEMPT_ENV", "CONTROL_DIR_ENV", "MIN_WORKERS_ENV", "RESTARTS_LEFT_ENV",
           "GRACE_ENV", "EXIT_PREEMPTED", "EXIT_RESTART_REQUESTED", "EVICT_FILE", "progress_file",
           "DEFAULT_PORT_BASE", "port_base"]

# The launcher protocol's names live in tfdp.protocol; re-exported here because earlier
# releases defined them in this module.
from tfdp.protocol import (ATTEMPT_ENV, CONTROL_DIR_ENV, CPU_REPLICAS_ENV,  # noqa: E402,F401
                           EVICT_FILE, EXIT_PREEMPTED, EXIT_RESTART_REQUESTED, GRACE_ENV,
                           MIN_WORKERS_ENV, PORT_BASE_ENV, RANK_ENV, READY_FILE_ENV,
                           RESTARTS_LEFT_ENV, SLOT_ENV, progress_file)

# Below Linux's ephemeral port range (32768-60999): no outgoing connection holds these.
DEFAULT_PORT_BASE = 20000

# Key -> role, for each layout. Roles: the ring ("chief", "worker"), "evaluator" (left out),
# and refused ones (_REFUSED).
_TF_CONFIG_ROLES = {"chief": "chief", "master": "chief", "worker": "worker",
                    "evaluator": "evaluator", "ps": "ps"}
_VERTEX_ROLES = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps/reduction",
                 "workerpool3": "evaluator"}
_REFUSED = {
    "ps": ("parameter servers belong to ParameterServerStrategy",
           "remove the parameter servers and run every process as a worker (TFJob: no PS "
           "replicas; SageMaker: distribution={'multi_worker_mirrored_strategy': {'enabled': "
           "True}} instead of 'parameter_server')"),
    "ps/reduction": ("the third worker pool holds parameter servers or Vertex AI's Reduction "
                     "Server, and tfdp all-reduces between the workers with TensorFlow's "
                     "collectives, using neither",
                     "leave workerPoolSpecs[2] empty"),
}


class ClusterConfigError(ValueError):
    """A malformed or unsupported cluster description; names the field, value and fix."""


def _fail(origin: str, field: str, value: Any, problem: str, fix: str) -> ClusterConfigError:
    return ClusterConfigError(f"{origin} {field}={value!r}: {problem}. Fix: {fix}.")


def _parse_address(origin: str, field: str, address: Any) -> str:
    if not isinstance(address, str) or not address:
        raise _fail(origin, field, address, "an address must be a non-empty 'host:port' string",
                    "write each address as \"host:port\", e.g. \"10.0.0.2:2222\"")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise _fail(origin, field, address, "the address has no ':port' part",
                    "write it as \"host:port\", e.g. \"10.0.0.2:2222\"")
    if not port.isdigit():
        raise _fail(origin, field, address, f"the port {port!r} is not a number",
                    "use a decimal port between 1 and 65535")
    if not 0 < int(port) < 65536:
        raise _fail(origin, field, address, f"the port {port} is out of range",
                    "use a port between 1 and 65535")
    return address


def port_base(environ: Mapping[str, str], default: int = DEFAULT_PORT_BASE, span: int = 1) -> int:
    """``TFDP_PORT_BASE`` if set (checked: ``span`` ports from it must exist), else ``default``."""
    text = environ.get(PORT_BASE_ENV, "").strip()
    if not text:
        return default
    if not text.isdigit() or not 1024 <= int(text) <= 65536 - span:
        raise ClusterConfigError(
            f"{PORT_BASE_ENV}={text!r}: not a port from 1024 to {65536 - span}. Fix: give the "
            f"first of {span} free port(s), e.g. {PORT_BASE_ENV}={DEFAULT_PORT_BASE}.")
    return int(text)


def _evaluator_error(origin: str, task_type: str) -> ClusterConfigError:
    return _fail(
        origin, "task.type", task_type,
        "this process is the job's evaluator, which is not part of tfdp's synchronous training "
        "ring, so it cannot build a DataParallelStrategy",
        f"in this process evaluate without a strategy, branching on task.type of {origin} "
        "(e.g. for each path in tf.train.checkpoints_iterator(backup_dir): load the weights, "
        "model.evaluate(...)); or drop the evaluator replicas and give model.fit "
        "validation_data on the workers")


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
            ``"SM_HOSTS"``, ``"Slurm"``, ``"cluster_resolver"``, ``"single"`` (nothing found)
            or ``"given"`` (constructed directly). Not part of equality.
        task_gpus: positions in ``CUDA_VISIBLE_DEVICES`` this task uses, or None for all it
            sees (set under Slurm when a node's tasks share its GPUs; ``tfdp.slurm``).
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
    def single_worker(cls, note: str | None = None) -> "ClusterConfig":
        return cls(source="single", notes=(note,) if note else ())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClusterConfig":
        """The first of ``TF_CONFIG``, ``CLUSTER_SPEC``, ``SM_HOSTS``, a Slurm step of several
        tasks, else one worker (see the module docstring). ``environ`` defaults to
        ``os.environ``.

        Raises:
            ClusterConfigError: the source found is malformed or unsupported.
        """
        environ = os.environ if environ is None else environ
        for variable in ("TF_CONFIG", "CLUSTER_SPEC"):
            text = environ.get(variable, "")
            if text.strip():
                return cls.from_json(text, origin=variable)
        if environ.get("SM_HOSTS", "").strip():
            return cls.from_sagemaker(environ)
        from tfdp.cluster import slurm  # imports this module: loaded late

        step = slurm.read_step(environ)
        if step is not None:
            return cls(workers=list(step.workers), task_type="worker", task_index=step.rank,
                       cluster_spec={"worker": tuple(step.workers)}, source="Slurm",
                       task_gpus=step.gpus,
                       notes=(f"Slurm job {step.job_id} step {step.step_id}",))
        return cls.single_worker(slurm.batch_step_note(environ))

    @classmethod
    def from_json(cls, text: str, origin: str = "TF_CONFIG") -> "ClusterConfig":
        """Parses ``TF_CONFIG`` (or, with ``origin="CLUSTER_SPEC"``, Vertex AI's layout)."""
        try:
            config = json.loads(text)
        except (TypeError, ValueError) as e:
            raise _fail(origin, "(whole value)", text, f"not valid JSON ({e})",
                        'set it to JSON like {"cluster": {"worker": ["h0:2222", "h1:2222"]}, '
                        '"task": {"type": "worker", "index": 0}}') from None
        return cls.from_dict(config, origin=origin)

    @classmethod
    def from_dict(cls, config: Any, origin: str = "TF_CONFIG") -> "ClusterConfig":
        """The parsed ``{"cluster": ..., "task": ...}`` of ``origin`` (see ``from_json``)."""
        roles = _VERTEX_ROLES if origin == "CLUSTER_SPEC" else _TF_CONFIG_ROLES
        if not isinstance(config, dict):
            raise _fail(origin, "(whole value)", config, "must be a JSON object",
                        'give an object with "cluster" and "task" keys')
        spec, notes = _ring_from_cluster(config.get("cluster"), origin, roles)
        task_type, index = _task_of(config.get("task"), spec, origin, roles)
        return cls(workers=list(spec.get("chief", ()) + spec.get("worker", ())),
                   task_type=task_type, task_index=index, cluster_spec=spec, source=origin,
                   notes=tuple(notes))

    @classmethod
    def from_sagemaker(cls, environ: Mapping[str, str]) -> "ClusterConfig":
        """SageMaker's ``SM_HOSTS`` (a JSON list) and ``SM_CURRENT_HOST``: every host a worker,
        rank = position in ``SM_HOSTS``, port ``TFDP_PORT_BASE`` (default 20000) + rank."""
        origin = "SM_HOSTS"
        try:
            hosts = json.loads(environ.get("SM_HOSTS", ""))
        except ValueError as e:
            raise _fail(origin, "(whole value)", environ.get("SM_HOSTS"), f"not valid JSON ({e})",
                        'pass SageMaker\'s value unchanged, e.g. ["algo-1", "algo-2"]') from None
        if (not isinstance(hosts, list) or not hosts
                or not all(isinstance(h, str) and h.strip() for h in hosts)):
            raise _fail(origin, "(whole value)", hosts, "must be a non-empty list of host names",
                        'pass SageMaker\'s value unchanged, e.g. ["algo-1", "algo-2"]')
        if len(set(hosts)) != len(hosts):
            raise _fail(origin, "(whole value)", hosts, "a host appears twice",
                        "list every host once")
        current = environ.get("SM_CURRENT_HOST", "")
        if current not in hosts:
            raise _fail("SM_CURRENT_HOST", "(whole value)", current,
                        f"not one of SM_HOSTS {hosts}", "pass SageMaker's values unchanged")
        base = port_base(environ, span=len(hosts))
        workers = [f"{host}:{base + i}" for i, host in enumerate(hosts)]
        return cls(workers=workers, task_type="worker", task_index=hosts.index(current),
                   cluster_spec={"worker": tuple(workers)}, source=origin)

    @classmethod
    def from_resolver(cls, resolver: Any) -> "ClusterConfig":
        """A TensorFlow ``tf.distribute.cluster_resolver.ClusterResolver`` (or anything with
        ``cluster_spec()``, ``task_type`` and ``task_id``); see ``from_resolver_spec``."""
        for name in ("cluster_spec", "task_type", "task_id"):
            if not hasattr(resolver, name):
                raise TypeError(f"cluster_resolver={resolver!r} has no {name!r}: pass a "
                                "tf.distribute.cluster_resolver.ClusterResolver.")
        spec = resolver.cluster_spec()
        spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
        return cls.from_resolver_spec(spec, resolver.task_type, resolver.task_id)

    @classmethod
    def from_resolver_spec(cls, spec: Mapping[str, Any], task_type: Any,
                           task_id: Any) -> "ClusterConfig":
        """A resolver's ``cluster_spec().as_dict()``, ``task_type`` and ``task_id`` (pure).

        Jobs are named as in ``TF_CONFIG`` (``chief``/``master``, ``worker``, ``evaluator``;
        ``ps`` refused). A sparse job (``{task index: address}``) must list indices 0..n-1. An
        empty spec is one worker.
        """
        origin = "cluster_resolver"
        if not isinstance(spec, Mapping):
            raise _fail(origin, "cluster_spec()", spec, "not a mapping of job -> addresses",
                        "return a tf.train.ClusterSpec from cluster_spec()")
        if not spec:
            return cls(source=origin)
        cluster = {}
        for job, tasks in spec.items():
            if isinstance(tasks, Mapping):
                if sorted(tasks) != list(range(len(tasks))):
                    raise _fail(origin, f"cluster.{job}", dict(tasks),
                                "task indices must be 0..n-1 with none missing",
                                "give every task of the job an address")
                tasks = [tasks[i] for i in range(len(tasks))]
            cluster[job] = list(tasks) if isinstance(tasks, (list, tuple)) else tasks
        if task_type is None:
            raise _fail(origin, "task.type", None, "the resolver names no task type",
                        "set the resolver's task_type and task_id for this process")
        config = cls.from_dict({"cluster": cluster, "task": {"type": task_type,
                                                             "index": task_id or 0}}, origin)
        return dataclasses.replace(config, source=origin)

    def to_dict(self) -> dict:
        """The TF_CONFIG dictionary for this task (inverse of ``from_dict``)."""
        return {"cluster": {k: list(v) for k, v in self.cluster_spec.items()},
                "task": {"type": self.task_type, "index": self.task_index}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _ring_from_cluster(cluster: Any, origin: str, roles: Mapping[str, str]) -> tuple:
    """``({"chief": (...), "worker": (...)}, notes)`` from a layout's ``cluster`` object."""
    example = 'add "cluster": {"worker": ["host:port", ...]}'
    if cluster is None:
        raise _fail(origin, "cluster", None, "missing", example)
    if not isinstance(cluster, dict):
        raise _fail(origin, "cluster", cluster, "must be an object of task type -> address list",
                    example)
    spec, notes, named = {}, [], {}
    for key, addresses in cluster.items():
        role = roles.get(key)
        if role in _REFUSED:
            problem, fix = _REFUSED[role]
            raise _fail(origin, f"cluster.{key}", addresses,
                        f"tfdp is synchronous all-reduce data parallelism; {problem}", fix)
        if role is None:
            known = ", ".join(repr(k) for k, r in roles.items() if r in ("chief", "worker"))
            raise _fail(origin, f"cluster.{key}", addresses, "unknown task type",
                        f"use only {known}")
        if not isinstance(addresses, list):
            raise _fail(origin, f"cluster.{key}", addresses, "must be a list of addresses",
                        f'write "{key}": ["host:port", ...]')
        if role == "evaluator":
            notes.append(f"{key} ({len(addresses)} task(s)) is not part of training")
            continue
        if role in named:
            raise _fail(origin, f"cluster.{key}", addresses,
                        f"both {named[role]!r} and {key!r} name the {role}", "keep one of them")
        named[role] = key
        if key != role:
            notes.append(f"{key} is the {role}")
        spec[role] = tuple(_parse_address(origin, f"cluster.{key}[{i}]", a)
                           for i, a in enumerate(addresses))
    if len(spec.get("chief", ())) > 1:
        key = named["chief"]
        raise _fail(origin, f"cluster.{key}", list(spec["chief"]), "there can be only one chief",
                    "list one chief address, or make the others workers")
    if not spec.get("worker") and not spec.get("chief"):
        key = next((k for k, r in roles.items() if r == "worker"), "worker")
        raise _fail(origin, f"cluster.{key}", cluster.get(key), "the worker list is empty",
                    f'list at least one "host:port" under cluster.{key}')
    workers = spec.get("chief", ()) + spec.get("worker", ())
    seen: dict[str, int] = {}
    for i, address in enumerate(workers):
        if address in seen:
            raise _fail(origin, "cluster", address,
                        f"the address appears twice (ranks {seen[address]} and {i})",
                        "give every task its own host:port")
        seen[address] = i
    return {r: spec[r] for r in ("chief", "worker") if r in spec}, notes


def _task_of(task: Any, spec: Mapping[str, tuple], origin: str,
             roles: Mapping[str, str]) -> tuple:
    """``(task type, index)`` of this process, mapped to the ring's names."""
    if task is None:
        raise _fail(origin, "task", None, "missing",
                    'add "task": {"type": "worker", "index": <this process\'s index>}')
    if not isinstance(task, dict):
        raise _fail(origin, "task", task, "must be an object",
                    'write "task": {"type": "worker", "index": 0}')
    given = task.get("type")
    role = roles.get(given) if isinstance(given, str) else None
    if role == "evaluator":
        raise _evaluator_error(origin, given)
    if role in _REFUSED:
        problem, fix = _REFUSED[role]
        raise _fail(origin, "task.type", given,
                    f"tfdp is synchronous all-reduce data parallelism; {problem}", fix)
    if role not in spec:
        names = sorted(k for k, r in roles.items() if r in spec)
        raise _fail(origin, "task.type", given,
                    f"must be one of the cluster's task types {names}",
                    "set task.type to the type this process was given in the cluster")
    index = task.get("index", 0)
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail(origin, "task.index", index, "must be an integer",
                    "set task.index to this process's position in its task list")
    if not 0 <= index < len(spec[role]):
        raise _fail(origin, "task.index", index,
                    f"out of range for {len(spec[role])} {given} address(es)",
                    f"use an index from 0 to {len(spec[role]) - 1}")
    return role, index
