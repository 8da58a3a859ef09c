"""Slurm's step environment -> the workers of a tfdp job. Pure Python, no TensorFlow.

Under ``srun`` every task of the step is one tfdp worker, so ``srun -N2 -n2 python train.py``
trains one job of two workers with no ``TF_CONFIG`` written by hand. One rule per mechanism:

* **When.** A process is a task of an srun step when ``SLURM_STEP_ID`` and ``SLURM_PROCID`` are
  set; the step has ``SLURM_STEP_NUM_TASKS`` tasks. A step of one task is a single worker. The
  batch script of an ``sbatch`` job is not a step (it has ``SLURM_NTASKS`` but no
  ``SLURM_STEP_ID``): a Python started there is one process, whatever the allocation holds.
* **Ranks and hosts.** Rank = ``SLURM_PROCID``. The hosts are the step's nodes in the order of
  ``SLURM_STEP_NODELIST`` (``SLURM_JOB_NODELIST`` if absent), expanded here
  (:func:`expand_hostlist`: ``a[01-03,7],b5`` -> ``a01 a02 a03 a7 b5``) and never sorted:
  TensorFlow's ``SlurmClusterResolver`` sorts host names, which puts rank 0 of ``node[9-10]``
  on ``node10``. A worker's address is its node's name as the node list spells it.
* **Task layout.** ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) says how many tasks each node
  runs; :func:`task_layout` places ranks on nodes the way srun did: ``block`` (the default),
  ``cyclic`` or ``plane=N`` from ``SLURM_DISTRIBUTION``. ``arbitrary`` (a host file) cannot be
  reproduced and is refused. The result is checked against this task's own ``SLURM_NODEID``,
  ``SLURM_LOCALID`` and ``SLURMD_NODENAME``, so a layout tfdp got wrong is an error, not a
  cluster whose workers wait for each other at the wrong addresses.
* **Ports** (:func:`worker_ports`). Each step owns a block of ``PORTS_PER_STEP`` (32) ports,
  block ``(SLURM_JOB_ID + 101 * SLURM_STEP_ID) mod 397`` above ``DEFAULT_PORT_BASE`` (20000): the
  window 20000-32703 lies below Linux's ephemeral range (32768-60999), so no outgoing connection
  holds one of these ports. Inside the block a task's offset is its rank when the step has at
  most 32 tasks, else its local task id on its node (``SLURM_LOCALID``; more than 32 tasks on one
  node is refused). Why nothing collides: two tasks of one step differ in rank, or, in a larger
  step, in local id when they share a node; so they differ in offset. Two steps of one job
  differ in step id by less than 397 while they run together, and 397 is prime, so their
  blocks differ. Steps of two jobs sharing a node get the same block only when their
  ``job id + 101 * step id`` agree modulo 397: Slurm numbers jobs consecutively, so for step 0
  of both that means two jobs submitted a multiple of 397 jobs apart running on one node at once;
  ``TFDP_PORT_BASE=P`` (ports ``P..P+31``, no block arithmetic) is the way out, and the way to
  meet a firewall's port range. Emulated nodes of one host (``slurmd -N``) share its ports: a
  small step still gives each task its own port, because the offset is the rank.
* **GPUs** (:func:`task_gpus`). tfdp uses what Slurm made visible and never renumbers
  ``CUDA_VISIBLE_DEVICES`` over devices the task does not own. When Slurm bound GPUs to tasks
  (``--gpus-per-task``, ``--gpu-bind``), each task sees fewer GPUs than the step has on the node
  (``SLURM_STEP_GPUS``) and uses all it sees. When every task of a node sees the node's whole
  step allocation (``--gres=gpu:8 --ntasks-per-node=8`` without binding), task ``l`` of ``m``
  takes positions ``[l*k, (l+1)*k)`` of its own ``CUDA_VISIBLE_DEVICES`` list, ``k = GPUs / m``
  (two NCCL ranks on one GPU fail); an uneven split is an error. Without ``SLURM_STEP_GPUS``
  nothing proves the GPUs are shared, and the task uses all it sees.

References:
    Slurm ``srun(1)`` (OUTPUT ENVIRONMENT VARIABLES, ``--distribution``), ``slurm.conf(5)``;
    TensorFlow's ``tf.distribute.cluster_resolver.SlurmClusterResolver``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from tfdp.cluster.errors import DEFAULT_PORT_BASE, ClusterConfigError, port_base
from tfdp.cluster.layout import Layout

__all__ = ["expand_hostlist", "parse_tasks_per_node", "task_layout", "worker_ports",
           "task_gpus", "SlurmStep", "read_step", "read_layout", "batch_step_note",
           "DEFAULT_PORT_BASE",
           "PORTS_PER_STEP", "PORT_BLOCKS"]

PORTS_PER_STEP = 32
PORT_BLOCKS = 397  # prime: steps of one job never share a block (see the module docstring)
_STEP_STRIDE = 101

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _error(variable: str, value, problem: str, fix: str) -> ClusterConfigError:
    return ClusterConfigError(f"Slurm {variable}={value!r}: {problem}. Fix: {fix}.")


def _split_top_level(text: str, variable: str) -> list:
    """Splits at commas outside brackets; checks the brackets balance."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _error(variable, text, "nested '[' in the host list", "pass Slurm's value unchanged")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _error(variable, text, "a ']' without its '['", "pass Slurm's value unchanged")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _error(variable, text, "a '[' without its ']'", "pass Slurm's value unchanged")
    items.append(text[start:])
    return items


def _expand_ranges(body: str, text: str, variable: str) -> list:
    """``01-03,7`` -> ``['01', '02', '03', '7']``: the width of a range is its first bound's."""
    out = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise _error(variable, text, f"{part!r} is not a number or a range 'lo-hi'",
                         "write ranges as n[1-4] or n[01-04,7]")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise _error(variable, text, f"the range {part!r} runs backwards",
                         "write the smaller bound first")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str, variable: str = "SLURM_STEP_NODELIST") -> list:
    """Slurm's compressed host list, expanded in its own order (what ``scontrol show hostnames``
    prints): ``n[1-2]`` -> ``n1 n2``; ``node[9-10]`` -> ``node9 node10``; ``a[01-03,7],b5`` ->
    ``a01 a02 a03 a7 b5`` (zero padding kept); ``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``.

    Args:
        text: the list, e.g. the value of ``SLURM_STEP_NODELIST``.
        variable: the variable it came from, named in errors.

    Raises:
        ClusterConfigError: an empty or malformed list, naming ``variable``.
    """
    if not isinstance(text, str) or not text.strip():
        raise _error(variable, text, "the host list is empty", "run under srun, or set TF_CONFIG")
    hosts = []
    for item in _split_top_level(text.strip(), variable):
        if not item:
            raise _error(variable, text, "an empty host name", "pass Slurm's value unchanged")
        names = [""]
        for literal, bracket in re.findall(r"([^\[\]]*)(\[[^\]]*\])?", item):
            values = _expand_ranges(bracket[1:-1], text, variable) if bracket else [""]
            names = [n + literal + v for n in names for v in values]
        hosts.extend(names)
    return hosts


def parse_tasks_per_node(text: str, variable: str = "SLURM_STEP_TASKS_PER_NODE") -> list:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``: the tasks of each node, in node-list order.

    Raises:
        ClusterConfigError: a malformed value or a count below 1, naming ``variable``.
    """
    counts = []
    for part in (text or "").split(","):
        m = _COUNT.match(part.strip())
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise _error(variable, text, f"{part!r} is not 'N' or 'N(xM)' with N, M >= 1",
                         "pass Slurm's value unchanged, e.g. '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def task_layout(tasks_per_node: Sequence[int], distribution: str = "block",
                plane_size: int | None = None) -> list:
    """``[(node index, local task id)]`` of every rank, as srun distributes tasks over nodes.

    ``block``: consecutive ranks fill a node before the next. ``cyclic``: one rank per node in
    turn, skipping full nodes. ``plane``: ``plane_size`` consecutive ranks per node in turn.

    Args:
        tasks_per_node: each node's task count (:func:`parse_tasks_per_node`).
        distribution: the node-level method, the part of ``SLURM_DISTRIBUTION`` before ':'.
        plane_size: the block of the ``plane`` method (``SLURM_DIST_PLANESIZE``).
    """
    counts = list(tasks_per_node)
    if distribution in ("block", "*", ""):
        return [(node, local) for node, n in enumerate(counts) for local in range(n)]
    if distribution not in ("cyclic", "plane"):
        raise _error("SLURM_DISTRIBUTION", distribution,
                     "tfdp cannot tell which node runs which rank under this distribution",
                     "use srun -m block (the default), cyclic or plane=N, or set TF_CONFIG "
                     "for every task yourself")
    chunk = 1 if distribution == "cyclic" else plane_size
    if not isinstance(chunk, int) or chunk < 1:
        raise _error("SLURM_DIST_PLANESIZE", plane_size, "the plane distribution needs a size >= 1",
                     "pass Slurm's value unchanged")
    placed, layout = [0] * len(counts), []
    while len(layout) < sum(counts):
        for node, n in enumerate(counts):
            take = min(chunk, n - placed[node])
            layout.extend((node, placed[node] + k) for k in range(take))
            placed[node] += take
    return layout


def worker_ports(layout: Sequence[tuple], job_id: int, step_id: int,
                 environ: Mapping[str, str]) -> list:
    """The port of every rank: a block per step, an offset per task (see the module docstring).

    Args:
        layout: :func:`task_layout`'s result.
        job_id, step_id: ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``.
        environ: read for ``TFDP_PORT_BASE``, which replaces the block arithmetic.

    Raises:
        ClusterConfigError: more than ``PORTS_PER_STEP`` tasks on one node of a large step, or
            a bad ``TFDP_PORT_BASE``.
    """
    num_tasks = len(layout)
    offsets = list(range(num_tasks)) if num_tasks <= PORTS_PER_STEP else [local for _, local in layout]
    if max(offsets) >= PORTS_PER_STEP:
        raise _error("SLURM_STEP_TASKS_PER_NODE", max(offsets) + 1,
                     f"more than {PORTS_PER_STEP} tasks of one step on a node do not fit the "
                     "step's port block",
                     "run fewer tasks per node (one task can drive every GPU of its node, or "
                     "several CPU replicas with TFDP_CPU_REPLICAS), or set TF_CONFIG yourself")
    block = (job_id + _STEP_STRIDE * step_id) % PORT_BLOCKS
    base = port_base(environ, DEFAULT_PORT_BASE + PORTS_PER_STEP * block, span=PORTS_PER_STEP)
    return [base + offset for offset in offsets]


def task_gpus(visible: str | None, step_gpus: str | None, tasks_on_node: int,
              local_id: int) -> tuple | None:
    """Positions in ``CUDA_VISIBLE_DEVICES`` this task uses, or None for all it sees.

    Args:
        visible: this task's ``CUDA_VISIBLE_DEVICES`` (None if unset).
        step_gpus: ``SLURM_STEP_GPUS``, the step's GPUs on this node (None if unset).
        tasks_on_node: tasks of the step on this node.
        local_id: this task's ``SLURM_LOCALID``.

    Raises:
        ClusterConfigError: the node's tasks share GPUs that do not split evenly among them.
    """
    seen = [g for g in (visible or "").split(",") if g.strip()]
    owned = [g for g in (step_gpus or "").split(",") if g.strip()]
    if not seen or visible.strip() == "NoDevFiles" or tasks_on_node <= 1 or not owned:
        return None
    if len(seen) != len(owned):
        return None  # Slurm bound a share to each task (or the step owns none of them)
    if len(seen) % tasks_on_node:
        raise _error("SLURM_STEP_GPUS", step_gpus,
                     f"{tasks_on_node} tasks on this node all see the same {len(seen)} GPU(s), "
                     "which do not split evenly (two NCCL ranks cannot share a GPU)",
                     f"run one task per node (tfdp uses every GPU it sees), or "
                     f"--ntasks-per-node dividing {len(seen)}, or --gpus-per-task")
    share = len(seen) // tasks_on_node
    return tuple(range(local_id * share, (local_id + 1) * share))


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """A multi-task srun step as tfdp sees it: ``workers[rank]`` is this task's address."""

    workers: list
    rank: int
    gpus: tuple | None
    job_id: int
    step_id: int
    nodes: list


def _int(environ: Mapping[str, str], *names: str, required: bool = True) -> int | None:
    for name in names:
        value = environ.get(name)
        if value is None:
            continue
        if not value.strip().isdigit():
            raise _error(name, value, "not a non-negative integer", "pass Slurm's value unchanged")
        return int(value)
    if required:
        raise _error(names[0], None, "missing inside an srun step",
                     "run the script with srun, or set TF_CONFIG")
    return None


def read_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """The step this process is a task of, or None (not an srun task, or a one-task step).

    Raises:
        ClusterConfigError: a missing or malformed Slurm variable, named in the message.
    """
    if "SLURM_PROCID" not in environ or not ({"SLURM_STEP_ID", "SLURM_STEPID"} & set(environ)):
        return None
    num_tasks = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if num_tasks <= 1:
        return None
    rank = _int(environ, "SLURM_PROCID")
    job_id = _int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    step_id = _int(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    node_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    nodes = expand_hostlist(environ.get(node_var), node_var)
    count_var = ("SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ
                 else "SLURM_TASKS_PER_NODE")
    counts = parse_tasks_per_node(environ.get(count_var), count_var)
    if len(counts) != len(nodes):
        raise _error(count_var, environ.get(count_var),
                     f"{len(counts)} node count(s) for the {len(nodes)} nodes of {node_var}="
                     f"{environ.get(node_var)!r}", "pass Slurm's values unchanged")
    if sum(counts) != num_tasks:
        raise _error(count_var, environ.get(count_var),
                     f"{sum(counts)} tasks in all, but SLURM_STEP_NUM_TASKS={num_tasks}",
                     "pass Slurm's values unchanged")
    if rank >= num_tasks:
        raise _error("SLURM_PROCID", rank, f"not below the step's {num_tasks} tasks",
                     "pass Slurm's values unchanged")
    # "cyclic:block", "block,Pack", "plane=4": the node-level method comes first.
    method, _, size = environ.get("SLURM_DISTRIBUTION", "block").split(":")[0].split(",")[0].partition("=")
    plane = _int(environ, "SLURM_DIST_PLANESIZE", required=False)
    if plane is None and size.strip().isdigit():
        plane = int(size)
    distribution = method.strip()
    layout = task_layout(counts, distribution, plane)
    node, local = layout[rank]
    _check_own_placement(environ, nodes, node, local, rank)
    ports = worker_ports(layout, job_id, step_id, environ)
    workers = [f"{nodes[n]}:{port}" for (n, _), port in zip(layout, ports)]
    gpus = task_gpus(environ.get("CUDA_VISIBLE_DEVICES"), environ.get("SLURM_STEP_GPUS"),
                     counts[node], local)
    return SlurmStep(workers=workers, rank=rank, gpus=gpus, job_id=job_id, step_id=step_id,
                     nodes=nodes)


def read_layout(environ: Mapping[str, str]) -> Layout | None:
    """:func:`read_step` as a :class:`~tfdp.cluster.layout.Layout` (source ``"Slurm"``), or None."""
    step = read_step(environ)
    if step is None:
        return None
    return Layout.of_workers(step.workers, step.rank, "Slurm", task_gpus=step.gpus,
                             notes=(f"Slurm job {step.job_id} step {step.step_id}",))


def _check_own_placement(environ, nodes, node, local, rank):
    """Slurm's own word on where this task runs must match the layout tfdp computed."""
    actual = {"SLURM_NODEID": _int(environ, "SLURM_NODEID", required=False),
              "SLURM_LOCALID": _int(environ, "SLURM_LOCALID", required=False),
              "SLURMD_NODENAME": environ.get("SLURMD_NODENAME")}
    expected = {"SLURM_NODEID": node, "SLURM_LOCALID": local, "SLURMD_NODENAME": nodes[node]}
    for name, value in actual.items():
        if value is not None and value != expected[name]:
            raise _error("SLURM_DISTRIBUTION", environ.get("SLURM_DISTRIBUTION", "block"),
                         f"tfdp placed rank {rank} at {name}={expected[name]!r}, but Slurm says "
                         f"{name}={value!r}: a task layout tfdp does not reproduce",
                         "use srun -m block (the default), cyclic or plane=N, or set TF_CONFIG "
                         "for every task yourself")


def batch_step_note(environ: Mapping[str, str]) -> str | None:
    """A note for a process in an sbatch script (not under srun) of a multi-task allocation."""
    if "SLURM_JOB_ID" not in environ or {"SLURM_STEP_ID", "SLURM_STEPID"} & set(environ):
        return None
    tasks = environ.get("SLURM_NTASKS", "1").strip()
    if not tasks.isdigit() or int(tasks) <= 1:
        return None
    return (f"a Slurm batch script of a {tasks}-task allocation, not an srun task: one worker. "
            f"Start the workers with `srun python ...` to train on all {tasks} tasks")
