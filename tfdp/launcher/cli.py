"""tfdp-run: start the workers of a job, here or on many hosts, and restart them after failures.

    tfdp-run --workers N [options] -- python train.py
    tfdp-run --hosts a:2,b:2 [options] -- python train.py        (or --hostfile FILE)

The full reference (flags, output, logs, exit codes, hosts) is docs/launcher.md; the flags
and their checks are :mod:`tfdp.launcher.arguments`. Pure Python.

Every *attempt* (the first launch, and each restart) gives each worker fresh free ports in
``TF_CONFIG`` (built with :class:`tfdp.ClusterConfig`; ranks 0..W-1 in slot order, so rank 0,
the chief, is the lowest remaining slot; ``--workers``: 127.0.0.1), a fresh control directory and
the variables of :mod:`tfdp.protocol`. Where each worker runs and how it is started (local
process, ssh) is :mod:`tfdp.launcher.processes`; the hosts and addresses are :mod:`tfdp.launcher.hosts`.

Output: the terminal shows tfdp-run's own ``[tfdp-run]`` lines and the chief's output, prefixed
``[w0]``; ``--output all`` shows every worker, prefixed ``[w<rank>]``. Every worker's whole
output goes to ``LOG_DIR/attempt-<k>/worker-<slot>.log`` (``--log-dir``, default a fresh
``tfdp-run-logs-*`` directory in the system's temporary directory), named at every attempt's
start. On a failure tfdp-run names the worker (rank, slot, host) and prints the last 40 lines
of its log, unless they were already on the terminal. Workers get ``TF_CPP_MIN_LOG_LEVEL=2``
(no TensorFlow C++ INFO/WARNING lines) unless it is set already or ``--tf-cpp-logs`` is given.

Failure handling (the restart and membership rules are in :mod:`tfdp.launcher.policy`):

* the first worker observed to exit non-zero is the failure; the others are stopped (those
  that exited 143 or 75 were stopping together, so the others first get ``--grace-period`` to
  finish by themselves; then SIGTERM, and SIGKILL after ``--grace-period``, or after
  ``NEVER_JOINED_GRACE_SECONDS`` when none of the others has joined the cluster: they have
  not trained, and those waiting for the failed worker in the strategy constructor ignore
  SIGTERM);
* a worker that has not joined the cluster within ``--start-timeout`` seconds of its
  attempt's start (the strategy writes a ready file when it has) is a failure too:
  TensorFlow's strategy constructor would otherwise wait for it forever. No worker has
  trained then, so the others get ``NEVER_JOINED_GRACE_SECONDS`` (at most the grace
  period) after SIGTERM before SIGKILL;
* a host ssh cannot reach is a failure of every worker on it;
* with ``--max-restarts R`` all workers are started again after a failure, up to R times,
  each restart logged with its cause; with ``--min-workers M`` a slot that cannot come back
  (a host that cannot: all its slots), or that the job evicts (exit 75 + ``evict.json``), is
  dropped while M slots remain;
* ``--timeout`` bounds the whole job, across restarts;
* SIGTERM to tfdp-run is forwarded to every worker (tfdp's callbacks make them back up at the
  same step and exit 143); after ``--grace-period`` what is left is SIGKILLed; no restart.
  Ctrl-C (SIGINT) is forwarded the same way. A second signal SIGKILLs at once.

Exit codes (names in :mod:`tfdp.protocol`):

    0     an attempt ended with every worker exiting 0: the job finished
    N     the failing worker's code (128+S if killed by signal S), once no restart is left
          (or a slot that cannot come back may not be dropped: below --min-workers)
    124   --timeout passed (it bounds the whole job, across restarts)
    125   a worker never joined the cluster within --start-timeout, no restart left
    127   the worker command (or ssh) could not be started
    130   Ctrl-C (SIGINT) to tfdp-run: forwarded, no restart
    143   SIGTERM to tfdp-run: forwarded (workers back up and exit 143), no restart
    75    the workers asked to evict a worker (exit 75 + evict.json) and no restart was left
    255   a host could not be reached over ssh, no restart left (or below --min-workers)
"""

from __future__ import annotations

import os
import signal
import shutil
import socket
import sys
import tempfile
import threading
import time

from tfdp.launcher import horovodrun
from tfdp.launcher.arguments import DEFAULT_START_TIMEOUT, parse_args  # noqa: F401  (kept here)
from tfdp.launcher import policy as restart_policy
from tfdp.launcher import processes
from tfdp.launcher.hosts import ranks_by_host, slot_hosts
from tfdp.launcher.processes import Attempt, SshConfig, WorkerLog, free_ports
from tfdp.protocol import (COMPILE_CACHE_AUTO, COMPILE_CACHE_ENV, CPU_REPLICAS_ENV,
                           DEFAULT_GRACE_SECONDS, EVICT_FILE, JOB_DIR_PREFIX,
                           EXIT_CANNOT_START, EXIT_INTERRUPTED, EXIT_NEVER_JOINED,
                           EXIT_PREEMPTED, EXIT_TERMINATED, EXIT_TIMEOUT, GRACE_ENV,
                           MIN_WORKERS_ENV, RESTARTS_LEFT_ENV, describe_exit,
                           restart_requested_exit_code)

__all__ = ["main", "parse_args", "free_ports", "tf_configs", "Attempt", "Launcher",
           "EXIT_TIMEOUT", "EXIT_NEVER_JOINED", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "EXIT_CANNOT_START", "DEFAULT_GRACE_SECONDS"]

_POLL_SECONDS = 0.05
TAIL_LINES = 40
# SIGTERM to SIGKILL when a worker never joined: enough for a Python worker to run its exit
# handlers, since no worker has a backup to write yet.
NEVER_JOINED_GRACE_SECONDS = 5.0
# Quiet TensorFlow's C++ logging (coordination service, gRPC server INFO lines) in workers.
TF_CPP_LOG_ENV, TF_CPP_QUIET = "TF_CPP_MIN_LOG_LEVEL", "2"


def tf_configs(num_workers: int, ports, host: str = "127.0.0.1") -> list:
    """Every rank's ``TF_CONFIG`` for ``num_workers`` workers on ``host`` at ``ports``."""
    return processes.tf_configs([f"{host}:{p}" for p in list(ports)[:num_workers]])


class Launcher:
    """Runs attempts until the supervisor policy says the job is finished.

    Args:
        command: the worker command line.
        policy: a :class:`tfdp.launcher.policy.Policy` (workers, max restarts, min workers).
        cpu_replicas: logical CPU replicas per worker, or None.
        grace_seconds: how long workers get to stop after a signal before SIGKILL.
        env: base environment (default ``os.environ``).
        out: where output goes (default ``sys.stdout``).
        hosts: :class:`tfdp.launcher.hosts.Host` list whose slots add up to ``policy.num_workers``;
            None: every worker on this machine at 127.0.0.1 (``--workers``).
        ssh: :class:`tfdp.launcher.processes.SshConfig` for hosts other than this machine.
        output: ``"chief"`` (the terminal shows rank 0) or ``"all"``.
        log_dir: where worker logs go; None: a fresh temporary directory.
        pass_env: more variable names remote workers get.
        tf_cpp_logs: let workers print TensorFlow's C++ INFO lines.
        compile_cache: ``TFDP_COMPILE_CACHE`` for the workers (a directory, ``"off"`` or
            ``"auto"``); None: the environment's, else ``"auto"`` (beside the backups of the
            workers' ``BackupAndRestore``, until then ``default_compile_cache_dir()``).
        verbose: log every worker's rank, slot, host and address at each attempt.
    """

    def __init__(self, command, policy, cpu_replicas=None, grace_seconds=DEFAULT_GRACE_SECONDS,
                 env=None, out=None, *, hosts=None, ssh=None, output="chief", log_dir=None,
                 pass_env=(), tf_cpp_logs=False, verbose=False, compile_cache=None):
        if output not in ("chief", "all"):
            raise ValueError(f"output={output!r}: use 'chief' or 'all'")
        self.command = list(command)
        self.policy = policy
        self._used_ports = set()  # the last attempt's ports: the next one gets others
        self.grace_seconds = grace_seconds
        self.out = out or sys.stdout
        self._lock = threading.Lock()
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONUNBUFFERED"] = "1"
        if not tf_cpp_logs:
            self.env.setdefault(TF_CPP_LOG_ENV, TF_CPP_QUIET)
        if cpu_replicas:
            self.env[CPU_REPLICAS_ENV] = str(cpu_replicas)
        # XLA's compiled programs survive restarts (tfdp.resilience.compile_cache). "auto", not
        # a path: each worker resolves it on its own host, and only under "auto" may its
        # BackupAndRestore move the cache beside the backups (a directory named here or in
        # the environment is the user's choice and stays).
        if compile_cache:
            self.env[COMPILE_CACHE_ENV] = compile_cache
        self.env.setdefault(COMPILE_CACHE_ENV, COMPILE_CACHE_AUTO)
        # Workers ask for a restart without a worker with this code (75 unless
        # TFDP_EVICT_EXIT_CODE says otherwise); ValueError names a bad value.
        self.restart_code = restart_requested_exit_code(self.env)
        self.slot_hosts = None if hosts is None else slot_hosts(hosts)
        if self.slot_hosts is not None and len(self.slot_hosts) != policy.num_workers:
            raise ValueError(f"the hosts have {len(self.slot_hosts)} slots but the policy "
                             f"{policy.num_workers} workers")
        self.ssh = ssh or SshConfig()
        self.output = output
        self.log_dir = log_dir
        self.pass_env = tuple(pass_env)
        self.verbose = verbose
        self.signals: list = []  # signals the launcher itself received, in order

    def log(self, message):
        with self._lock:
            self.out.write(f"[tfdp-run] {message}\n")
            self.out.flush()

    def _worker(self, attempt, rank):
        slot = attempt.slots[rank]
        return f"worker {slot}" if slot == rank else f"worker {slot} (rank {rank})"

    def _host_name(self, attempt, rank):
        host = attempt.hosts[rank]
        return socket.gethostname() if host is None else host.name

    # --- output -------------------------------------------------------------------------------
    def _logs(self, state):
        folder = os.path.join(self.log_dir, f"attempt-{state.attempt}")
        os.makedirs(folder, exist_ok=True)
        def shown(rank):
            return self.output == "all" or rank == 0

        logs = [WorkerLog(os.path.join(folder, f"worker-{slot}.log"), f"[w{rank}]",
                          self.out if shown(rank) else None, self._lock, TAIL_LINES)
                for rank, slot in enumerate(state.slots)]
        who = ("every worker" if self.output == "all" else
               f"worker {state.slots[0]}'s (the chief)" + (" (--output all: every worker)"
                                                          if state.attempt == 0 else ""))
        self.log(f"each worker's output: {folder}/worker-<slot>.log; the terminal shows {who}")
        return logs

    def _report_failure(self, attempt, rank):
        """Names the failed worker and prints its log's last lines (if not shown already)."""
        worker, log = attempt.workers[rank], attempt.logs[rank]
        worker.join_output(timeout=2)  # its last lines (the traceback) are in the log
        who = (f"{self._worker(attempt, rank)} failed (rank {rank}, slot {attempt.slots[rank]}, "
               f"host {self._host_name(attempt, rank)})")
        if log.shown:
            self.log(f"{who}; its output is above; full log: {log.path}")
            return
        lines = log.tail()
        if not lines:
            self.log(f"{who}; it printed nothing (log: {log.path})")
            return
        with self._lock:
            self.out.write(f"[tfdp-run] {who}; last {len(lines)} lines of {log.path}:\n")
            self.out.writelines(f"{log.prefix} {line}\n" for line in lines)
            self.out.flush()

    # --- stopping -------------------------------------------------------------------------
    def _stop(self, attempt, phases, forwarded):
        """Stops the attempt and reaps every worker.

        For each ``(signal or None, seconds)`` phase: send the signal to the running workers
        (None: send nothing, let them finish by themselves) and wait up to ``seconds``. Then
        SIGKILL what is left. ``forwarded`` counts the launcher's own signals already passed on
        to the workers: a first signal arriving now is forwarded (and replaces the phases'
        signals: the workers were told); any further one SIGKILLs at once."""
        told = False  # a launcher signal was forwarded during this stop
        for sig, seconds in phases:
            if attempt.all_exited():
                break
            if sig is not None and not told:
                attempt.signal_running(sig)
            deadline = time.monotonic() + seconds
            while not attempt.all_exited():
                if len(self.signals) > forwarded:
                    name = signal.Signals(self.signals[-1]).name
                    if forwarded == 0:
                        self.log(f"received {name}; forwarding to all workers")
                        attempt.signal_running(self.signals[0])
                        forwarded = len(self.signals)
                        told = True
                    else:
                        self.log(f"received {name} again; killing all workers")
                        deadline = 0.0
                        phases = ()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                attempt.next_exit(timeout=min(left, _POLL_SECONDS))
            if not phases:
                break
        if not attempt.all_exited():
            if phases:
                still = [attempt.slots[r] for r in attempt.running()]
                self.log(f"worker(s) {still} still running after the grace period "
                         f"({phases[-1][1]:g} s); sending SIGKILL")
            attempt.signal_running(signal.SIGKILL)
            while not attempt.all_exited():
                attempt.next_exit(timeout=_POLL_SECONDS)
        attempt.close()

    # --- one attempt ------------------------------------------------------------------------
    def _failed(self, attempt, rank):
        """The AttemptEnd and stop phases for a worker that exited non-zero."""
        code, grace = attempt.codes[rank], self.grace_seconds
        attempt.workers[rank].join_output(timeout=2)  # all it said, a remote "started" included
        if attempt.unreachable(rank):
            host = attempt.hosts[rank]
            ranks = attempt.ranks_on(host)
            self.log(f"cannot reach host {host.name} to start {self._worker(attempt, rank)}: "
                     f"ssh exited {describe_exit(code)}; stopping the other workers")
            self._report_failure(attempt, rank)
            return restart_policy.HostUnreachable(host.name, ranks, code), [(signal.SIGTERM, grace)]
        progressed = attempt.progressed()
        self.log(f"{self._worker(attempt, rank)} exited with code {describe_exit(code)}; "
                 "stopping the other workers")
        # Workers exit 143 (preempted) or 75 (restart requested) together, after backing up
        # at the same step (and the chief writing evict.json): the others get the grace period
        # to finish by themselves, so no backup is cut short by SIGTERM.
        together = code in (EXIT_PREEMPTED, self.restart_code)
        if not together:
            # The others cannot finish a step without it: those waiting in a collective end
            # it now (PEER_EXITED_FILE) instead of after TensorFlow's 10 s heartbeat timeout.
            attempt.announce_exit(rank, describe_exit(code))
            self._report_failure(attempt, rank)
            if not any(attempt.joined(r) for r in attempt.running()):
                # Nobody left has joined the cluster: nobody has trained or has anything to
                # back up, and those waiting for the failed worker inside the strategy
                # constructor do not die of SIGTERM (as in _never_joined).
                grace = min(grace, NEVER_JOINED_GRACE_SECONDS)
        phases = [(None, grace)] if together else []
        return (restart_policy.WorkerExited(rank, code, progressed),
                phases + [(signal.SIGTERM, grace)])

    def _never_joined(self, attempt, start_timeout, missing):
        absent = [r for r in missing if not attempt.joining(r)] or missing
        waiting = [r for r in missing if r not in absent]
        def slots(ranks):
            return [attempt.slots[r] for r in ranks]

        where = ""
        if any(h is not None for h in attempt.hosts):
            where = "; " + ", ".join(f"worker {attempt.slots[r]} on host "
                                     f"{self._host_name(attempt, r)}" for r in absent)
        self.log(
            f"worker(s) {slots(absent)} did not join the cluster within "
            f"{start_timeout:g} s (never created a DataParallelStrategy{where})"
            + (f"; worker(s) {slots(waiting)} are waiting for them" if waiting else "")
            + ". Stopping the workers. Check the worker's output, or raise "
            "--start-timeout (0 disables the check) if it needs longer to start.")
        self._report_failure(attempt, absent[0])
        # Nobody has trained, so nobody has anything to back up; and a worker waiting inside
        # the strategy constructor does not die of SIGTERM (TensorFlow's coordination
        # service has taken the signal over by then), so the full grace period is only lost.
        grace = min(self.grace_seconds, NEVER_JOINED_GRACE_SECONDS)
        return restart_policy.NeverJoined(absent[0], start_timeout), [(signal.SIGTERM, grace)]

    def _supervise(self, attempt, job_deadline, timeout, start_timeout):
        """Watches the attempt until it ends; returns (AttemptEnd, stop phases)."""
        grace = self.grace_seconds
        while True:
            if self.signals:
                signum = self.signals[0]
                self.log(f"received {signal.Signals(signum).name}; forwarding to all workers")
                return restart_policy.Interrupted(signum), [(signum, grace)]
            rank = attempt.next_exit(timeout=_POLL_SECONDS)
            if rank is not None and attempt.codes[rank] != 0:
                return self._failed(attempt, rank)
            if attempt.all_exited():
                return restart_policy.Completed(), []
            now = time.monotonic()
            if start_timeout and now - attempt.started_at > start_timeout:
                missing = [r for r in attempt.running() if not attempt.joined(r)]
                if missing:
                    return self._never_joined(attempt, start_timeout, missing)
                start_timeout = None  # everyone joined (or finished): stop checking
            if job_deadline is not None and now > job_deadline:
                self.log(f"job exceeded --timeout {timeout:g} s; stopping all workers")
                return restart_policy.TimedOut(timeout), [(signal.SIGTERM, grace)]

    def _place(self, state):
        """Each rank's (host or None, ``host:port``) for this attempt, or a HostUnreachable."""
        # Fresh ports per attempt: none the previous attempt's workers used (its processes
        # may still hold them, and a peer must never dial a stale worker).
        avoid = self._used_ports
        if self.slot_hosts is None:
            ports = free_ports(state.num_workers, avoid=avoid)
            self._used_ports = set(ports)
            return [None] * state.num_workers, [f"127.0.0.1:{p}" for p in ports]
        hosts = [self.slot_hosts[s] for s in state.slots]
        grouped = ranks_by_host(hosts)
        try:
            answers = processes.probe(list(grouped), [len(r) for r in grouped.values()], self.ssh,
                                      avoid=avoid)
        except processes.HostUnreachableError as e:
            self.log(f"{e}; its worker(s) {[s for s, h in zip(state.slots, hosts) if h == e.host]}"
                     " cannot start")
            return restart_policy.HostUnreachable(e.host.name, grouped[e.host])
        addresses = [None] * state.num_workers
        self._used_ports = {p for _, ports in answers for p in ports}
        for (host, ranks), (address, ports) in zip(grouped.items(), answers):
            for rank, port in zip(ranks, ports):
                addresses[rank] = f"{address}:{port}"
            self.log(f"host {host.name}: worker(s) {[state.slots[r] for r in ranks]} at "
                     f"{address}")
        return hosts, addresses

    def _attempt(self, state, workdir, job_deadline, timeout, start_timeout):
        """Starts and supervises one attempt; returns its AttemptEnd (or an exit code)."""
        placed = self._place(state)
        if isinstance(placed, restart_policy.HostUnreachable):
            return placed
        protocol_env = {MIN_WORKERS_ENV: str(self.policy.min_workers),
                        RESTARTS_LEFT_ENV: str(state.restarts_left(self.policy)),
                        GRACE_ENV: f"{self.grace_seconds:g}"}
        attempt = Attempt(self.command, state.slots, state.attempt, self.env, workdir,
                          placed[1], self._logs(state), placed[0], protocol_env, self.ssh,
                          self.pass_env)
        if self.verbose:
            for line in horovodrun.describe_workers(state.slots, attempt.hosts, placed[1]):
                self.log(line)
        try:
            attempt.start()
        except OSError as e:
            self.log(f"cannot start the worker command {self.command[0]!r}: {e}. Check "
                     "the command after '--' (and that it is on PATH).")
            attempt.codes[len(attempt.workers):] = \
                [EXIT_CANNOT_START] * (attempt.num_workers - len(attempt.workers))
            self._stop(attempt, [(signal.SIGTERM, self.grace_seconds)], forwarded=0)
            return EXIT_CANNOT_START
        end, phases = self._supervise(attempt, job_deadline, timeout, start_timeout)
        self._stop(attempt, phases, forwarded=1 if isinstance(end, restart_policy.Interrupted) else 0)
        if not isinstance(end, (restart_policy.Interrupted, restart_policy.TimedOut,
                                restart_policy.Completed)):
            if self.signals:  # the launcher was signalled while it stopped the workers
                end = restart_policy.Interrupted(self.signals[0])
            elif job_deadline is not None and time.monotonic() > job_deadline:
                self.log(f"job exceeded --timeout {timeout:g} s while stopping the "
                         "workers; no restart")
                end = restart_policy.TimedOut(timeout)
        return self._with_eviction(attempt, end)

    # --- the job ----------------------------------------------------------------------------
    def run(self, timeout=None, start_timeout=None) -> int:
        job_deadline = None if timeout is None else time.monotonic() + timeout
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda signum, frame: self.signals.append(signum))
        workdir = tempfile.mkdtemp(prefix=JOB_DIR_PREFIX)
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="tfdp-run-logs-")
        policy = self.policy
        state = policy.initial_state()
        try:
            while True:
                if self.signals:  # arrived between attempts: nothing runs, nothing to stop
                    end = restart_policy.Interrupted(self.signals[0])
                    self.log(f"received {signal.Signals(end.signum).name}")
                    return self._finish(restart_policy.decide(policy, state, end))
                if state.attempt == 0:
                    self.log(f"starting {state.num_workers} worker(s): {' '.join(self.command)}")
                else:
                    self.log(f"attempt {state.attempt}: starting {state.num_workers} worker(s), "
                             f"slots {list(state.slots)} as ranks "
                             f"{list(range(state.num_workers))}")
                end = self._attempt(state, workdir, job_deadline, timeout, start_timeout)
                if isinstance(end, int):
                    return end
                decision = restart_policy.decide(policy, state, end)
                if not decision.restart:
                    return self._finish(decision)
                for message in decision.messages:
                    self.log(message)
                state = decision.next_state
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(workdir, ignore_errors=True)

    def _with_eviction(self, attempt, end):
        """A worker exit with the restart-requested code + a valid evict.json is an eviction."""
        if not (isinstance(end, restart_policy.WorkerExited) and end.code == self.restart_code):
            return end
        text = attempt.eviction_text()
        eviction = None if text is None else restart_policy.parse_eviction(text, attempt.num_workers)
        if eviction is None:
            self.log(f"{self._worker(attempt, end.rank)} asked for a restart without "
                     f"{EVICT_FILE}: restarting on the same workers if restarts are left")
            return end
        if isinstance(eviction, str):
            self.log(f"ignoring the eviction request: {eviction}")
            return end
        return restart_policy.EvictionRequested(end.rank, eviction, end.code)

    def _finish(self, decision) -> int:
        for message in decision.messages:
            self.log(message)
        return decision.exit_code


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    policy = restart_policy.Policy(args.workers, args.max_restarts, args.min_workers)
    connect = min(10.0, args.start_timeout) if args.start_timeout else 10.0
    ssh = SshConfig(port=args.ssh_port, config_file=args.ssh_config,
                    options=tuple(args.ssh_option), python=args.ssh_python,
                    connect_timeout=connect)
    env = dict(os.environ, **args.env_values)
    try:
        restart_requested_exit_code(env)
    except ValueError as e:
        print(f"tfdp-run: error: {e}", file=sys.stderr)
        return 2
    launcher = Launcher(args.command, policy, cpu_replicas=args.cpu_replicas,
                        grace_seconds=args.grace_period, env=env, hosts=args.host_list, ssh=ssh,
                        output=args.output, log_dir=args.log_dir, pass_env=args.env_names,
                        tf_cpp_logs=args.tf_cpp_logs, verbose=args.verbose,
                        compile_cache=args.compile_cache)
    for note in args.notes:
        launcher.log(note)
    code = launcher.run(timeout=args.timeout, start_timeout=args.start_timeout)
    launcher.log(f"job finished with exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
