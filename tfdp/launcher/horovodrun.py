"""horovodrun's command line on tfdp-run: a Horovod job script keeps its flags. Pure.

Rule. Every flag of ``horovodrun`` (Horovod 0.28) is known to tfdp-run, and each one either
does what it did there, expressed in tfdp-run's own flags (:func:`translate`, a pure function
of what was given), is accepted with a one-line note saying why it has nothing to do in tfdp
(tuning of Horovod's background engine, MPI/Gloo choices), or is refused with an error that
names the tfdp way (elastic host discovery, mpirun arguments, YAML configuration). Nothing is
silently dropped. What maps:

* ``-np N`` / ``--num-proc N``: N processes. With ``-H``/``--hostfile`` the hosts are filled in
  order, each to its slots, as horovodrun does (``-np 3 -H a:2,b:2`` runs 2 on ``a``, 1 on
  ``b``); more processes than slots is an error. (``--workers N`` must match the slots.)
* ``--min-np M`` -> ``--min-workers M``, ``--reset-limit R`` -> ``--max-restarts R`` (tfdp-run
  drops a slot only when it restarts the job, so ``--min-np`` below ``-np`` needs a restart
  count); ``--max-np N``: tfdp-run never adds processes to a job, so any N >= ``-np`` holds.
* ``--start-timeout S`` is tfdp-run's own flag; without it, ``HOROVOD_START_TIMEOUT`` is read
  as horovodrun does (tfdp-run's default stays 300 s).
* ``--output-filename DIR`` -> ``--log-dir DIR`` (each worker's stdout and stderr together in
  ``DIR/attempt-<k>/worker-<slot>.log``, where horovodrun wrote ``DIR/rank.<r>/stdout|stderr``).
* ``--verbose``: tfdp-run also logs every worker's rank, slot, host, address and local rank
  (:func:`describe_workers`) at each attempt.
* ``-p``/``--ssh-port`` is tfdp-run's ``--ssh-port``; ``-i FILE``/``--ssh-identity-file FILE``
  -> ``--ssh-option IdentityFile=FILE``; ``-hostfile`` is ``--hostfile``; ``-H`` is ``--hosts``;
  ``--network-interfaces IFACE`` (one) -> ``--network-interface IFACE``.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from typing import Mapping, Optional, Sequence

from tfdp.cluster.placement import placement_of

__all__ = ["HorovodrunFlagError", "Translation", "translate", "network_interfaces", "add_flags",
           "apply", "given", "describe_workers", "local_ranks", "START_TIMEOUT_ENV", "IGNORED",
           "REFUSED"]

# horovodrun reads it when --start-timeout is not given.
START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"

_ENGINE = "tfdp has no background engine to tune: TensorFlow's collectives run inside the step"
_NO_MPI = ("tfdp-run starts the processes itself and they communicate through TensorFlow's "
           "collectives (gRPC ring, NCCL on GPUs), as horovodrun --gloo did")
_LOGS = "tfdp logs through Python's logging (the 'tfdp' logger)"
_DISCOVERY = ("tfdp-run has no host discovery: list the hosts with -H/--hostfile; with "
              "--max-restarts R --min-workers M a job continues on fewer hosts after failures "
              "(docs/launcher.md)")

# flag -> (how many values it takes, why tfdp-run accepts it and does nothing).
IGNORED = {
    "--disable-cache": (0, "tfdp-run keeps no cache of host checks"),
    "--gloo": (0, _NO_MPI), "--mpi": (0, _NO_MPI), "--tcp": (0, _NO_MPI),
    "--fusion-threshold-mb": (1, "each reduction of tfdp.horovod already packs its tensors "
                                 "(DistributedOptimizer: all gradients of a step together); "
                                 "tfdp.DataParallelStrategy(bucket_bytes=...) sizes buckets"),
    "--cycle-time-ms": (1, _ENGINE), "--cache-capacity": (1, _ENGINE),
    "--hierarchical-allreduce": (0, _ENGINE), "--no-hierarchical-allreduce": (0, _ENGINE),
    "--hierarchical-allgather": (0, _ENGINE), "--no-hierarchical-allgather": (0, _ENGINE),
    "--autotune": (0, _ENGINE), "--no-autotune": (0, _ENGINE),
    "--autotune-log-file": (1, _ENGINE), "--autotune-warmup-samples": (1, _ENGINE),
    "--autotune-steps-per-sample": (1, _ENGINE), "--autotune-bayes-opt-max-samples": (1, _ENGINE),
    "--autotune-gaussian-process-noise": (1, _ENGINE),
    "--num-nccl-streams": (1, _ENGINE), "--thread-affinity": (1, _ENGINE),
    "--mpi-threads-disable": (0, _NO_MPI), "--no-mpi-threads-disable": (0, _NO_MPI),
    "--gloo-timeout-seconds": (1, _NO_MPI),
    "--timeline-filename": (1, "use the TensorBoard profiler: keras.callbacks.TensorBoard("
                               "profile_batch=...)"),
    "--timeline-mark-cycles": (0, "no timeline (see --timeline-filename)"),
    "--no-timeline-mark-cycles": (0, "no timeline (see --timeline-filename)"),
    "--no-stall-check": (0, "a stalled collective ends the job with an error after the "
                            "strategy's timeout_seconds (300 s with several workers); "
                            "--timeout bounds the whole job"),
    "--stall-check": (0, "see --no-stall-check"),
    "--stall-check-warning-time-seconds": (1, "see --no-stall-check"),
    "--stall-check-shutdown-time-seconds": (1, "see --no-stall-check"),
    "--log-level": (1, _LOGS), "--log-with-timestamp": (0, _LOGS),
    "--log-without-timestamp": (0, _LOGS), "--log-hide-timestamp": (0, _LOGS),
    "--no-log-hide-timestamp": (0, _LOGS), "-prefix-timestamp": (0, _LOGS),
    "--prefix-output-with-timestamp": (0, _LOGS),
    "--elastic-timeout": (1, "--start-timeout bounds the start of every attempt, restarts "
                             "included"),
    "--blacklist-cooldown-range": (2, "tfdp-run drops a slot that cannot come back and never "
                                      "adds it again"),
}

# flag -> (how many values it takes, the error: the tfdp way).
REFUSED = {
    "--host-discovery-script": (1, _DISCOVERY),
    "--slots-per-host": (1, _DISCOVERY),
    "--mpi-args": (1, "tfdp-run has no mpirun: set variables with -x NAME=VALUE, the hosts "
                      "with -H/--hostfile, and process binding in the command itself (e.g. "
                      "numactl ... python train.py)"),
    "--binding-args": (1, "tfdp-run has no mpirun: bind processes in the command itself "
                          "(e.g. numactl ... python train.py)"),
    "--jsrun": (0, "tfdp-run starts the processes itself (locally, or over ssh with "
                   "-H/--hostfile); it has no jsrun"),
    "--config-file": (1, "give the settings of the YAML file as flags on the command line"),
    "--check-build": (0, "tfdp has no build options to check; `python -c \"import "
                         "tfdp.horovod as hvd; print(hvd.nccl_built())\"` says whether NCCL "
                         "is there"),
}
_SHORT = {"-cb": "--check-build"}


class HorovodrunFlagError(ValueError):
    """A horovodrun flag tfdp-run cannot honour; the message names the tfdp way."""


@dataclasses.dataclass
class Translation:
    """What the horovodrun flags set, in tfdp-run's terms (None: left as given), and the notes
    tfdp-run prints at start."""

    workers: Optional[int] = None
    hosts: Optional[list] = None
    min_workers: Optional[int] = None
    max_restarts: Optional[int] = None
    start_timeout: Optional[float] = None
    log_dir: Optional[str] = None
    ssh_options: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)


def _fill_hosts(hosts: Sequence, count: int) -> list:
    """The first ``count`` slots of ``hosts`` in order (horovodrun's host assignment)."""
    out, left = [], count
    for host in hosts:
        if left <= 0:
            break
        take = min(host.slots, left)
        out.append(dataclasses.replace(host, slots=take))
        left -= take
    return out


def _agree(alias: str, value, own: str, own_value) -> None:
    """A horovodrun flag and the tfdp-run flag it maps to, both given: they must agree."""
    if value is not None and own_value is not None and own_value != value:
        raise HorovodrunFlagError(f"{alias} {value} and {own} {own_value} disagree; give one")


def _processes(g: Mapping, t: Translation):
    """``-np`` against ``--workers`` and the hosts' slots; returns the process count."""
    np_, workers, hosts = g.get("num_proc"), g.get("workers"), g.get("hosts")
    if np_ is None:
        return workers if hosts is None else sum(h.slots for h in hosts)
    if np_ < 1:
        raise HorovodrunFlagError(f"-np {np_}: need at least 1 process")
    _agree("-np", np_, "--workers", workers)
    if hosts is None:
        t.workers = np_
        return np_
    slots = sum(h.slots for h in hosts)
    if np_ > slots:
        raise HorovodrunFlagError(f"-np {np_}: the hosts have only {slots} slots; give more "
                                  "hosts or slots, or fewer processes")
    if np_ < slots:
        t.hosts = _fill_hosts(hosts, np_)
        placed = ", ".join(f"{h.name}:{h.slots}" for h in t.hosts)
        t.notes.append(f"-np {np_} of {slots} slots: the hosts are filled in order, as "
                       f"horovodrun does: {placed}")
    t.workers = np_
    return np_


def _elastic(g: Mapping, t: Translation, processes: Optional[int]) -> None:
    """``--min-np``, ``--max-np``, ``--reset-limit`` against tfdp-run's restart flags."""
    reset, restarts = g.get("reset_limit"), g.get("max_restarts")
    if reset is not None:
        _agree("--reset-limit", reset, "--max-restarts", restarts)
        t.max_restarts = reset
        restarts = reset
    min_np, min_workers = g.get("min_np"), g.get("min_workers")
    if min_np is not None:
        _agree("--min-np", min_np, "--min-workers", min_workers)
        if processes is not None and min_np < processes and not restarts:
            raise HorovodrunFlagError(
                f"--min-np {min_np} needs --reset-limit R (tfdp-run's --max-restarts R): "
                "tfdp-run continues on fewer processes only when it restarts the job after a "
                "failure, at most R times")
        t.min_workers = min_np
    max_np = g.get("max_np")
    if max_np is not None:
        if processes is not None and max_np < processes:
            raise HorovodrunFlagError(f"--max-np {max_np} is below -np {processes}")
        t.notes.append(f"--max-np {max_np}: tfdp-run never adds processes to a running job, "
                       "so the job stays within it")


def network_interfaces(values: Sequence[str]) -> list:
    """``--network-interface(s)`` values, horovodrun's comma lists included, as tfdp-run's
    (one interface, or ``HOST=IFACE``, each); pure."""
    out = []
    for value in values or ():
        if "=" in value:
            out.append(value)
            continue
        names = sorted({n.strip() for n in value.split(",") if n.strip()})
        if len(names) != 1:
            raise HorovodrunFlagError(
                f"--network-interface(s) {value}: tfdp-run gives each worker one address that "
                "its peers dial; name one interface (--network-interface IFACE, or "
                "HOST=IFACE per host), or the address itself (--address HOST=ADDR)")
        out.append(names[0])
    return out


def translate(g: Mapping, environ: Mapping) -> Translation:
    """horovodrun's flags (``given``'s keys) in tfdp-run's terms; pure.

    Args:
        g: ``num_proc``, ``workers``, ``hosts`` (a list of ``tfdp.launcher.hosts.Host`` or
            None), ``min_np``, ``max_np``, ``reset_limit``, ``min_workers``,
            ``max_restarts``, ``start_timeout``, ``output_filename``, ``log_dir``,
            ``ssh_identity_file``, ``horovodrun_flags`` (``[(flag, values)]`` of the ignored
            and refused flags);
            None or absent: not given.
        environ: the environment (``HOROVOD_START_TIMEOUT``).

    Raises:
        HorovodrunFlagError: a refused flag, or flags that contradict each other.
    """
    t = Translation()
    for flag, values in g.get("horovodrun_flags") or ():
        if flag in REFUSED:
            raise HorovodrunFlagError(f"horovodrun's {flag} is not supported: "
                                      f"{REFUSED[flag][1]}")
        shown = " ".join([flag, *map(str, values)])
        t.notes.append(f"horovodrun's {shown}: ignored ({IGNORED[flag][1]})")
    processes = _processes(g, t)
    _elastic(g, t, processes)
    if g.get("start_timeout") is None and environ.get(START_TIMEOUT_ENV, "").strip():
        text = environ[START_TIMEOUT_ENV].strip()
        try:
            t.start_timeout = float(text)
        except ValueError:
            raise HorovodrunFlagError(f"{START_TIMEOUT_ENV}={text!r} is not a number of "
                                      "seconds") from None
        t.notes.append(f"--start-timeout {t.start_timeout:g} (from {START_TIMEOUT_ENV})")
    out, log_dir = g.get("output_filename"), g.get("log_dir")
    if out is not None:
        _agree("--output-filename", out, "--log-dir", log_dir)
        t.log_dir = out
        t.notes.append(f"--output-filename {out}: each worker's stdout and stderr go to "
                       f"{out}/attempt-<k>/worker-<slot>.log (tfdp-run's --log-dir)")
    if g.get("ssh_identity_file"):
        t.ssh_options.append(f"IdentityFile={g['ssh_identity_file']}")
    return t


# --- the command line ---------------------------------------------------------------------

class _Record(argparse.Action):
    """Records ``(flag, values)`` of an ignored or refused flag, in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        values = [] if values is None else values if isinstance(values, list) else [values]
        flag = _SHORT.get(option_string, option_string)
        namespace.horovodrun_flags = list(namespace.horovodrun_flags or []) + [(flag, values)]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds horovodrun's flags that tfdp-run's own do not already spell."""
    group = parser.add_argument_group(
        "horovodrun's flags (docs/horovod.md; tuning flags are accepted and ignored)")
    add = group.add_argument
    add("-np", "--num-proc", dest="num_proc", type=int, default=None,
        help="processes; with -H/--hostfile the hosts are filled in order (horovodrun)")
    add("--min-np", "--min-num-proc", dest="min_np", type=int, default=None,
        help="--min-workers")
    add("--max-np", "--max-num-proc", dest="max_np", type=int, default=None,
        help="at least -np (tfdp-run never adds processes)")
    add("--reset-limit", dest="reset_limit", type=int, default=None, help="--max-restarts")
    add("--output-filename", dest="output_filename", default=None, help="--log-dir")
    add("--verbose", action="store_true",
        help="also log every worker's rank, slot, host and address at each attempt")
    add("-i", "--ssh-identity-file", dest="ssh_identity_file", default=None,
        help="ssh -o IdentityFile=FILE")
    add("--network-interfaces", dest="network_interfaces", action="append", default=[],
        help="one interface: --network-interface")
    counts = {f: n for f, (n, _) in {**IGNORED, **REFUSED}.items()}
    counts.update({short: counts[flag] for short, flag in _SHORT.items()})
    for flag, count in counts.items():
        add(flag, action=_Record, nargs=count if count != 1 else None, dest="horovodrun_flags",
            help=argparse.SUPPRESS)
    parser.set_defaults(horovodrun_flags=[])


def apply(args, environ: Mapping, default_start_timeout: float) -> None:
    """Applies :func:`translate` to tfdp-run's parsed ``args`` (an ``argparse.Namespace``
    with ``host_list``), in place; ``args.notes`` gets the notes to print at start."""
    t = translate(given(args), environ)
    for name in ("workers", "min_workers", "max_restarts", "start_timeout", "log_dir"):
        if getattr(t, name) is not None:
            setattr(args, name, getattr(t, name))
    if t.hosts is not None:
        args.host_list = t.hosts
    args.ssh_option = list(args.ssh_option) + t.ssh_options
    args.notes = t.notes
    args.max_restarts = 0 if args.max_restarts is None else args.max_restarts
    if args.start_timeout is None:
        args.start_timeout = default_start_timeout


def given(args) -> dict:
    """The values :func:`translate` reads, from tfdp-run's parsed arguments."""
    names = ("num_proc", "workers", "min_np", "max_np", "reset_limit", "min_workers",
             "max_restarts", "start_timeout", "output_filename", "log_dir",
             "ssh_identity_file", "horovodrun_flags")
    values = {name: getattr(args, name, None) for name in names}
    values["hosts"] = getattr(args, "host_list", None)
    return values


# --- --verbose ------------------------------------------------------------------------------

def local_ranks(hosts: Sequence[str]) -> list:
    """``(local rank, local size)`` of every rank whose host is ``hosts[rank]``, Horovod's
    definition (ranks of one host in rank order); pure."""
    places = [placement_of(list(hosts), r) for r in range(len(hosts))]
    return [(p.local_rank, p.local_size) for p in places]


def describe_workers(slots: Sequence[int], hosts: Sequence, addresses: Sequence[str]) -> list:
    """One line per rank for ``--verbose``: slot, host, address, local rank. ``hosts``: each
    rank's ``tfdp.launcher.hosts.Host``, or None for this machine."""
    names = [socket.gethostname() if h is None else h.name for h in hosts]
    lines = []
    for rank, ((local, size), slot, host, address) in enumerate(
            zip(local_ranks(names), slots, names, addresses)):
        lines.append(f"rank {rank}: slot {slot}, host {host}, address {address}, "
                     f"local rank {local} of {size}")
    return lines
