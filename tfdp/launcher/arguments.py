"""tfdp-run's command line: the flags, their checks and their defaults (``parse_args``).

Rule: every flag is checked here, before anything starts, and a bad one ends tfdp-run with
argparse's usage error naming the flag and the fix (exit 2). horovodrun's flags are translated
into tfdp-run's own by :mod:`tfdp.launcher.horovodrun`; the hosts are :mod:`tfdp.launcher.hosts`.
The launcher itself is :mod:`tfdp.launcher.cli`.
"""

from __future__ import annotations

import argparse
import os

from tfdp.launcher import horovodrun
from tfdp.launcher.hosts import HostsError, parse_hostfile, parse_hosts, with_addresses
from tfdp.protocol import DEFAULT_GRACE_SECONDS, GRACE_ENV

__all__ = ["parse_args", "DEFAULT_START_TIMEOUT"]

DEFAULT_START_TIMEOUT = 300.0


def _parser():
    parser = argparse.ArgumentParser(
        prog="tfdp-run", description="Start tfdp workers with TF_CONFIG, here or over ssh.",
        usage="tfdp-run (--workers N | -np N | --hosts H:N,... | --hostfile FILE) [options] -- "
              "CMD ...",
        epilog="Reference: docs/launcher.md")
    add = parser.add_argument
    add("--workers", type=int, default=None,
        help="number of worker processes (on this machine unless --hosts/--hostfile)")
    add("--cpu-replicas", type=int, default=None,
        help="logical CPU replicas per worker (sets TFDP_CPU_REPLICAS)")
    add("--max-restarts", type=int, default=None,
        help="restart all workers after a failure, up to this many times over the whole job "
             "(default 0: no restart)")
    add("--min-workers", type=int, default=None,
        help="with --max-restarts: drop a worker slot (a host: all its slots) that cannot come "
             "back or is evicted, and continue while at least this many remain (default: "
             "all workers, no elasticity)")
    add("--grace-period", type=float, default=DEFAULT_GRACE_SECONDS,
        help="seconds workers get to stop (back up) after SIGTERM before SIGKILL (default "
             f"{DEFAULT_GRACE_SECONDS:g}; sets {GRACE_ENV})")
    add("--timeout", type=float, default=None,
        help="stop the job after this many seconds, across restarts (exit 124)")
    add("--start-timeout", type=float, default=None,
        help="seconds (per attempt) for every worker to create its DataParallelStrategy (join "
             f"the cluster; default {DEFAULT_START_TIMEOUT:g}); 0 disables the check (exit 125)")
    add("--compile-cache", default=None, metavar="DIR|auto|off",
        help="where workers keep XLA's compiled programs across restarts and relaunches (sets "
             "TFDP_COMPILE_CACHE; default: $TFDP_COMPILE_CACHE if set, else auto: beside the "
             "backups, <backup_dir>-xla-cache, once the script creates "
             "tfdp.callbacks.BackupAndRestore, until then ~/.cache/tfdp/xla); DIR: there (a "
             "directory every host reaches can be shared); off: none")
    out = parser.add_argument_group("output")
    out.add_argument("--output", choices=("chief", "all"), default="chief",
                     help="chief (default): the terminal shows the chief's output; all: every "
                          "worker's, prefixed [w<rank>]")
    out.add_argument("--log-dir", default=None,
                     help="where each worker's output is written (attempt-<k>/worker-<slot>.log; "
                          "default: a new tfdp-run-logs-* directory in the temporary directory)")
    out.add_argument("--tf-cpp-logs", action="store_true",
                     help="let workers print TensorFlow's C++ INFO/WARNING lines (by default "
                          "tfdp-run sets TF_CPP_MIN_LOG_LEVEL=2 unless it is set)")
    hosts = parser.add_argument_group("many hosts (over ssh)")
    where = hosts.add_mutually_exclusive_group()
    where.add_argument("--hosts", "-H", default=None,
                       help="HOST:SLOTS,... e.g. a:2,b:2; localhost runs here without ssh (-H "
                            "is horovodrun's spelling)")
    where.add_argument("--hostfile", "-hostfile", default=None,
                       help="lines 'HOST slots=N'; # comments")
    hosts.add_argument("--address", action="append", default=[], metavar="HOST=ADDR",
                       help="the address peers dial for HOST's workers (default: the name)")
    hosts.add_argument("--network-interface", action="append", default=[],
                       metavar="[HOST=]IFACE",
                       help="use this interface's IPv4 address (for every host, or one)")
    hosts.add_argument("--env", "-x", action="append", default=[], metavar="NAME[=VALUE]",
                       help="pass this variable to remote workers too (TF_*, TFDP_*, CUDA_*, "
                            "NCCL_*, PYTHONPATH always are); =VALUE sets it for every worker")
    hosts.add_argument("--ssh-port", "-p", type=int, default=None, help="ssh -p PORT")
    hosts.add_argument("--ssh-config", default=None, help="ssh -F FILE")
    hosts.add_argument("--ssh-option", action="append", default=[], metavar="OPTION",
                       help="ssh -o OPTION (repeatable), e.g. IdentityFile=~/.ssh/job")
    hosts.add_argument("--ssh-python", default=None,
                       help="the Python tfdp-run's remote helper runs with (default: this "
                            "Python's path if it exists there, else python3)")
    horovodrun.add_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    return parser


def _host_list(parser, args):
    """--hosts/--hostfile (+ --address, --network-interface) -> [Host], or None."""
    try:
        if args.hostfile:
            try:
                with open(args.hostfile) as f:
                    hosts = parse_hostfile(f.read(), args.hostfile)
            except OSError as e:
                parser.error(f"--hostfile {args.hostfile}: {e.strerror}")
        elif args.hosts:
            hosts = parse_hosts(args.hosts)
        else:
            if args.address or args.network_interface:
                parser.error("--address/--network-interface need --hosts or --hostfile")
            return None
        return with_addresses(hosts, args.address, args.network_interface)
    except HostsError as e:
        parser.error(str(e))


def _env_args(parser, values):
    names, settings = [], {}
    for value in values:
        name, sep, setting = value.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_"):
            parser.error(f"--env {value}: expected NAME or NAME=VALUE")
        if sep:
            settings[name] = setting
        elif name not in os.environ:
            parser.error(f"--env {name}: {name} is not set here; export it, or give "
                         f"--env {name}=VALUE")
        names.append(name)
    return names, settings


def parse_args(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:  # horovodrun's flags in tfdp-run's terms (tfdp/launcher/horovodrun.py)
        args.network_interface = horovodrun.network_interfaces(
            args.network_interface + args.network_interfaces)
        args.host_list = _host_list(parser, args)
        horovodrun.apply(args, os.environ, DEFAULT_START_TIMEOUT)
    except horovodrun.HorovodrunFlagError as e:
        parser.error(str(e))
    if not command:
        parser.error("no command given; write: tfdp-run --workers 2 -- python train.py")
    if args.host_list is not None:
        slots = sum(h.slots for h in args.host_list)
        if args.workers not in (None, slots):
            parser.error(f"--workers {args.workers} but the hosts have {slots} slots; leave out "
                         "--workers or make them agree")
        args.workers = slots
    elif args.workers is None:
        parser.error("give --workers N (this machine), or --hosts/--hostfile")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: need at least 1 worker")
    if args.cpu_replicas is not None and args.cpu_replicas < 1:
        parser.error(f"--cpu-replicas {args.cpu_replicas}: need at least 1")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if args.min_workers is None:
        args.min_workers = args.workers
    if not 1 <= args.min_workers <= args.workers:
        parser.error(f"--min-workers {args.min_workers}: must be between 1 and --workers "
                     f"{args.workers}")
    if args.min_workers < args.workers and args.max_restarts == 0:
        parser.error(f"--min-workers {args.min_workers} needs --max-restarts: a worker slot is "
                     "dropped only when the job restarts; add e.g. --max-restarts 3")
    if args.grace_period < 0:
        parser.error(f"--grace-period {args.grace_period:g}: must be 0 or more seconds")
    args.env_names, args.env_values = _env_args(parser, args.env)
    if args.log_dir:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as e:
            parser.error(f"--log-dir {args.log_dir}: cannot create it ({e.strerror})")
    args.command = command
    return args
