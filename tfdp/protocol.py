"""The launcher <-> worker protocol: environment variables, control files, exit codes.

Pure Python (no TensorFlow), so the launcher can import it cheaply. This is the one home of
every name that ``tfdp-run`` (or a scheduler standing in for it) and the workers share, the way
torchrun documents its "Environment Variables" in one section.

Environment variables the launcher sets for each worker
    ``TF_CONFIG``              the cluster and this task (built with :class:`tfdp.ClusterConfig`).
    ``TFDP_RANK``              this worker's rank in the current attempt (0 = chief).
    ``TFDP_SLOT``              the worker's stable slot: keeps its identity across restarts,
                               while ranks are renumbered (slot order) when a slot is dropped.
    ``TFDP_ATTEMPT``           0 for the first launch, k after the k-th restart.
    ``TFDP_CONTROL_DIR``       this attempt's control directory (files below); on a host reached
                               over ssh, a private directory whose files tfdp-run relays.
    ``TFDP_READY_FILE``        the file the strategy writes once the worker joined the cluster,
                               so the launcher can tell a worker that never joined from a slow one.
    ``TFDP_MIN_WORKERS``       ``--min-workers``; with ``TFDP_RESTARTS_LEFT`` it tells a worker
    ``TFDP_RESTARTS_LEFT``     whether asking to shrink (exit 75) can be granted.
    ``TFDP_GRACE_SECONDS``     the preemption grace period the launcher grants after SIGTERM.
    ``TFDP_CPU_REPLICAS``      ``--cpu-replicas K``: ``DataParallelStrategy()`` splits the CPU
                               into K logical replicas.
    ``TFDP_COMPILE_CACHE``     where XLA's compiled programs are kept across restarts and
                               relaunches (``--compile-cache``): a directory, ``off``, or
                               ``auto`` (the default): beside the backups
                               (``<backup_dir>-xla-cache``) once the worker creates a
                               ``BackupAndRestore``, until then ``$XDG_CACHE_HOME/tfdp/xla``
                               (``~/.cache/tfdp/xla``) of the worker's host. A value already in
                               tfdp-run's environment is kept. Read by ``import tfdp`` before
                               TensorFlow initialises its devices (tfdp.resilience.compile_cache);
                               a ``TF_XLA_FLAGS`` that names
                               ``--tf_xla_persistent_cache_directory`` wins.
    ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
    ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``, and ``OMPI_COMM_WORLD_RANK``, ``_SIZE``,
    ``_LOCAL_RANK``, ``_LOCAL_SIZE``
                               what horovodrun (and Open MPI) give a process: the values
                               ``hvd.rank()``, ``hvd.local_rank()``, ... report (one rule,
                               ``tfdp.cluster.placement.horovod_environment``), for scripts
                               that read them before ``hvd.init()``. tfdp itself never reads
                               them (TF_CONFIG is the cluster).

Environment variables the user may set
    ``TFDP_ELASTIC_DIR``       where ``hvd.elastic`` commits (rank 0 writes and, at a relaunch,
                               reads; on several hosts a directory every host reaches). Default:
                               under tfdp-run on one machine, the job's own directory (removed
                               when the job ends); else a private temporary directory
                               (tfdp.horovod.elastic).
    ``TFDP_COMPILE_CACHE``     also outside tfdp-run: a directory, ``auto`` (as tfdp-run's
                               workers), or ``off`` (then not even a ``BackupAndRestore`` created
                               early puts one beside its backups).
    ``TFDP_COMPILE_CACHE_MAX_MB`` the cache's size bound (default 4096): the oldest entries
                               are evicted when a worker starts.
    ``TFDP_ORDERLY_EXIT``      ``0`` turns off the workers' exit barrier (tfdp.strategy.lifecycle).
    ``TFDP_PORT_BASE``         the first of the ports workers listen on when tfdp builds the
                               cluster itself (Slurm, SageMaker's ``SM_HOSTS``; tfdp.cluster.slurm).
    ``TFDP_EVICT_EXIT_CODE``   the code workers exit with to ask for a restart without a worker
                               (default 75); a scheduler that retries only codes >= 128
                               (Kubeflow ``restartPolicy: ExitCode``) needs one of those.
    ``TFDP_PREEMPTION_SIGNALS`` the signals BackupAndRestore reads as a preemption, comma-
                               separated (``SIGTERM,SIGUSR1``; must include SIGTERM); default
                               SIGTERM, plus SIGUSR1,SIGUSR2 inside a Slurm job
                               (tfdp.resilience.preemption).

Directories
    ``tfdp-run-*``             ``JOB_DIR_PREFIX``: the job's directory tfdp-run makes (and
                               removes when the job ends) on its machine; every local attempt's
                               ``TFDP_CONTROL_DIR`` is made inside it, so a worker whose control
                               directory's parent is one knows it has the job's directory
                               (``hvd.elastic`` commits there).

Control files, under ``TFDP_CONTROL_DIR`` (fresh for every attempt)
    ``step-{rank}``            written by a worker after its first completed training step of
                               the attempt; a slot that fails before any exists "could not come
                               back" (tfdp.launcher.policy).
    ``evict.json``             written by the chief before the workers exit with
                               ``EXIT_RESTART_REQUESTED``: ``{"rank": R, "reason": "..."}``, the
                               rank (this attempt's numbering) the job asks to drop.
    ``peer-exited.json``       written by tfdp-run when a worker exits on its own (a crash, or
                               a signal that is not a preemption): ``{"slot": S, "rank": R,
                               "exit": "137 (SIGKILL)"}``. The others cannot finish a step
                               without it: a worker whose step waits in a collective aborts
                               it at once (tfdp.strategy.deadline) instead of waiting ~10 s
                               for TensorFlow's heartbeat timeout. Workers on a host reached
                               over ssh get it in their private control directory (relayed
                               through ssh's stdin, tfdp.launcher.remote).

Exit codes
    0     the job (or worker) finished.
    75    ``EXIT_RESTART_REQUESTED`` (EX_TEMPFAIL): the workers ask their launcher to restart
          with another membership (evict.json says how). Only tfdp-run grants it: workers ask
          only when ``TFDP_MIN_WORKERS`` and ``TFDP_RESTARTS_LEFT`` allow shrinking.
    124   ``EXIT_TIMEOUT``: tfdp-run's ``--timeout`` passed.
    125   ``EXIT_NEVER_JOINED``: a worker never joined within ``--start-timeout``, no restart left.
    127   ``EXIT_CANNOT_START``: the worker command could not be started.
    130   ``EXIT_INTERRUPTED``: Ctrl-C (128 + SIGINT).
    143   ``EXIT_PREEMPTED``: SIGTERM (128 + SIGTERM), or another preemption signal
          (``TFDP_PREEMPTION_SIGNALS``; SIGUSR1/SIGUSR2 in a Slurm job); workers back up at the
          same step first.
    255   ``EXIT_HOST_UNREACHABLE``: ssh's own code; tfdp-run could not reach a host
          (``--hosts``/``--hostfile``), no restart left or it may not be dropped.
    128+S a process killed by signal S.
"""

from __future__ import annotations

import os
import signal

__all__ = [
    "READY_FILE_ENV", "RANK_ENV", "SLOT_ENV", "ATTEMPT_ENV", "CONTROL_DIR_ENV",
    "MIN_WORKERS_ENV", "RESTARTS_LEFT_ENV", "GRACE_ENV", "CPU_REPLICAS_ENV", "ORDERLY_EXIT_ENV",
    "EVICT_FILE", "PEER_EXITED_FILE", "JOB_DIR_PREFIX", "progress_file", "DEFAULT_GRACE_SECONDS", "PORT_BASE_ENV",
    "EVICT_EXIT_CODE_ENV", "PREEMPTION_SIGNALS_ENV", "ELASTIC_DIR_ENV", "COMPILE_CACHE_ENV",
    "COMPILE_CACHE_MAX_MB_ENV", "COMPILE_CACHE_AUTO", "default_compile_cache_dir",
    "restart_requested_exit_code",
    "EXIT_RESTART_REQUESTED", "EXIT_TIMEOUT", "EXIT_NEVER_JOINED", "EXIT_CANNOT_START",
    "EXIT_INTERRUPTED", "EXIT_PREEMPTED", "EXIT_TERMINATED", "EXIT_HOST_UNREACHABLE",
    "exit_code_of", "describe_exit",
]

READY_FILE_ENV = "TFDP_READY_FILE"
RANK_ENV = "TFDP_RANK"
SLOT_ENV = "TFDP_SLOT"
ATTEMPT_ENV = "TFDP_ATTEMPT"
CONTROL_DIR_ENV = "TFDP_CONTROL_DIR"
MIN_WORKERS_ENV = "TFDP_MIN_WORKERS"
RESTARTS_LEFT_ENV = "TFDP_RESTARTS_LEFT"
GRACE_ENV = "TFDP_GRACE_SECONDS"
CPU_REPLICAS_ENV = "TFDP_CPU_REPLICAS"
ORDERLY_EXIT_ENV = "TFDP_ORDERLY_EXIT"
PORT_BASE_ENV = "TFDP_PORT_BASE"
EVICT_EXIT_CODE_ENV = "TFDP_EVICT_EXIT_CODE"
PREEMPTION_SIGNALS_ENV = "TFDP_PREEMPTION_SIGNALS"
ELASTIC_DIR_ENV = "TFDP_ELASTIC_DIR"
COMPILE_CACHE_ENV = "TFDP_COMPILE_CACHE"
COMPILE_CACHE_MAX_MB_ENV = "TFDP_COMPILE_CACHE_MAX_MB"
COMPILE_CACHE_AUTO = "auto"  # tfdp-run's default TFDP_COMPILE_CACHE

EVICT_FILE = "evict.json"
PEER_EXITED_FILE = "peer-exited.json"
JOB_DIR_PREFIX = "tfdp-run-"

# Kubernetes' default terminationGracePeriodSeconds.
DEFAULT_GRACE_SECONDS = 30.0

EXIT_RESTART_REQUESTED = 75
EXIT_TIMEOUT = 124
EXIT_NEVER_JOINED = 125
EXIT_CANNOT_START = 127  # the shell's "command not found"
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_PREEMPTED = 128 + signal.SIGTERM
# The launcher itself was asked to stop: the same code as a preempted worker.
EXIT_TERMINATED = EXIT_PREEMPTED
# ssh exits 255 when it cannot connect (or loses the connection).
EXIT_HOST_UNREACHABLE = 255


def progress_file(control_dir: str, rank: int) -> str:
    """The file a worker writes after its first completed training step of an attempt."""
    return os.path.join(control_dir, f"step-{rank}")


def restart_requested_exit_code(environ=None) -> int:
    """The code workers exit with to ask for a restart with another membership.

    ``EXIT_RESTART_REQUESTED`` (75) unless ``TFDP_EVICT_EXIT_CODE`` names another code from 1
    to 255. Kubeflow's ``restartPolicy: ExitCode`` retries only codes >= 128 and fails the job
    on lower ones, so a job that lets a straggler be evicted there sets e.g. 200 (not 128 + a
    signal's number, which would read as that signal). A launcher recognising the request
    must read the same variable.

    Raises:
        ValueError: the variable is not an integer from 1 to 255.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(EVICT_EXIT_CODE_ENV, "").strip()
    if not text:
        return EXIT_RESTART_REQUESTED
    if not text.isdigit() or not 1 <= int(text) <= 255:
        raise ValueError(f"{EVICT_EXIT_CODE_ENV}={text!r} is not an exit code from 1 to 255. "
                         f"Fix: unset it (code {EXIT_RESTART_REQUESTED}) or give e.g. 200.")
    return int(text)


def default_compile_cache_dir(environ=None) -> str:
    """Where ``TFDP_COMPILE_CACHE=auto`` (tfdp-run's default) keeps compiled programs until a
    ``BackupAndRestore`` moves them beside its backups: ``$XDG_CACHE_HOME/tfdp/xla`` (XDG's
    default ``~/.cache``). Per user, so every relaunch of a job on this host finds it; entries
    are named by what makes them valid (tfdp.resilience.compile_cache), so jobs can share it.

    Args:
        environ: the environment to read ``XDG_CACHE_HOME`` and ``HOME`` from (default
            ``os.environ``): each worker reads its own host's.
    """
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or os.path.expanduser("~")
    base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(base, "tfdp", "xla")


def exit_code_of(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell exit code: killed by signal N (-N) => 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(code: int) -> str:
    """``137 (SIGKILL)``, ``143 (SIGTERM, preempted)``, ``75 (restart requested)``, ``3``."""
    if code == EXIT_PREEMPTED:
        return f"{code} (SIGTERM, preempted)"
    if code == EXIT_RESTART_REQUESTED:
        return f"{code} (restart requested)"
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return str(code)
