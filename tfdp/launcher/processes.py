"""How tfdp-run starts a worker process: on this machine, or on another host over ssh.

The rule: a started worker is a local process tfdp-run can read line by line, signal as a whole
(the worker and everything it started), and wait for with an exit code; it relays the worker's
control files (:mod:`tfdp.protocol`) into tfdp-run's control directory. What to start, when to
stop and whether to restart is decided elsewhere (:mod:`tfdp.launcher.cli`, :mod:`tfdp.launcher.policy`).

* **Local** (:class:`LocalWorker`): the command itself, in its own session, so a terminal's
  Ctrl-C reaches tfdp-run only (which forwards it) and a signal to the worker's process group
  also reaches what the worker started. Signals go to the group, SIGCONT first (a stopped
  worker cannot act on SIGTERM). The control files are written in place. On Linux the worker
  is SIGKILLed by the kernel when tfdp-run dies (``PR_SET_PDEATHSIG``), so a SIGKILLed or
  crashed launcher leaves no worker training on: its own session would otherwise keep it out
  of reach of a kill aimed at the launcher's group. (The kernel ties this to the thread that
  started the worker; tfdp-run starts them from the thread that then waits for them.)
* **Remote** (:class:`RemoteWorker`): ``ssh HOST`` runs :mod:`tfdp.launcher.remote` (sent over ssh's
  stdin; only a Python 3 is needed there: the one tfdp-run runs on, at the same path, else
  ``python3``, or ``--ssh-python``), which changes to tfdp-run's working directory, sets the
  job's environment and starts the command as given in its own session. Signals travel as lines
  on ssh's stdin and are sent to the remote worker's group; SIGKILL kills the local ssh, and
  the remote side kills the worker when ssh's stdin ends, so a worker never outlives a killed
  ssh or tfdp-run. ssh's exit code is the worker's; 255 with no ``started`` report means the
  host could not be reached (:data:`tfdp.protocol.EXIT_HOST_UNREACHABLE`).

Ports: every attempt asks each host for fresh free ports (:func:`probe`: local sockets here,
one ssh round trip per remote host, in parallel), as ``--workers`` does on 127.0.0.1; ports
returned twice across hosts (several loopback "hosts" are one kernel) are asked for again.

Environment passed to a remote worker (:func:`remote_environment`): every ``TF_*``, ``TFDP_*``,
``CUDA_*``, ``NCCL_*`` variable, ``PYTHONPATH``, ``PYTHONUNBUFFERED``, and the names given with
``--env``/``-x``; the remote login environment supplies the rest (``PATH``, ``HOME``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from tfdp.launcher import remote
from tfdp.cluster import ClusterConfig
from tfdp.cluster.placement import horovod_environment, placement_of, shared_host_environment
from tfdp.launcher.hosts import Host
from tfdp.protocol import (ATTEMPT_ENV, CONTROL_DIR_ENV, EVICT_FILE, EXIT_HOST_UNREACHABLE,
                           PEER_EXITED_FILE, RANK_ENV, READY_FILE_ENV, SLOT_ENV, exit_code_of,
                           progress_file)

__all__ = ["free_ports", "tf_configs", "Attempt", "LocalWorker", "RemoteWorker", "SshConfig", "WorkerLog", "probe",
           "HostUnreachableError", "ProbeError", "remote_environment", "watch_exit",
           "PASSED_PREFIXES", "PASSED_NAMES"]

PASSED_PREFIXES = ("TF_", "TFDP_", "CUDA_", "NCCL_", "HOROVOD_", "OMPI_COMM_WORLD_")
PASSED_NAMES = ("PYTHONPATH", "PYTHONUNBUFFERED")
# How long tfdp-run waits, after the workers of an attempt are gone, for the rest of their
# output (see Attempt.close).
OUTPUT_DRAIN_SECONDS = 15.0
# os.waitid (Linux; macOS from Python 3.13) lets a thread learn of an exit without reaping it,
# which keeps the order in which workers exited. Without it the launcher polls.
_HAVE_WAITID = hasattr(os, "waitid") and hasattr(os, "WNOWAIT")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_BOOTSTRAP = ('import sys,json;exec(compile(json.loads(sys.stdin.buffer.readline()),'
              '"tfdp_remote","exec"),{"__name__":"__main__"})')


def free_ports(n: int, host: str = "127.0.0.1", avoid=()) -> list:
    """``n`` distinct free TCP ports on ``host`` (held open together so they differ)."""
    return remote.free_ports(n, host, avoid)


def watch_exit(pid: int, key, exits: "queue.Queue"):
    """Puts ``key`` on ``exits`` when process ``pid`` exits, without reaping it.

    WNOWAIT: the supervising thread reaps, so a pid is never reused while the launcher may
    still signal its process group."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass
    exits.put(key)


class WorkerLog:
    """Where one worker's output lines go: its log file, the terminal if shown, a tail.

    Args:
        path: the log file (created).
        prefix: the terminal prefix, e.g. ``[w1]``.
        out: the terminal stream, or None when this worker is not shown.
        lock: serialises writes to ``out`` (shared by all workers and the launcher).
        tail_lines: how many last lines to keep for the failure report.
    """

    def __init__(self, path, prefix, out, lock, tail_lines=40):
        self.path, self.prefix, self.out, self._lock = path, prefix, out, lock
        self._file = open(path, "w", encoding="utf-8", buffering=1)
        self._tail = collections.deque(maxlen=tail_lines)

    @property
    def shown(self) -> bool:
        return self.out is not None

    def write(self, line: str):
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
            self._tail.append(line)
            if self.out is not None:
                self.out.write(f"{self.prefix} {line}\n")
                self.out.flush()

    def tail(self) -> list:
        with self._lock:
            return list(self._tail)

    def close(self):
        with self._lock:
            self._file.close()


def _pump(stream, write: Callable[[str], None]):
    for raw in iter(stream.readline, b""):
        write(raw.decode("utf-8", errors="replace").rstrip("\n"))
    stream.close()


def _thread(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def _die_with_launcher():
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies (Linux's
    ``PR_SET_PDEATHSIG``; subprocess has no flag for it); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not after the fork
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def in_child():
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the line above: follow it
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


class LocalWorker:
    """The command on this machine, in its own session; output to ``log``."""

    host = None
    started = True

    def __init__(self, command: Sequence[str], env: Mapping[str, str], log: WorkerLog):
        self.popen = subprocess.Popen(list(command), env=dict(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_launcher())
        self._pumps = [_thread(_pump, self.popen.stdout, log.write)]

    def send_signal(self, sig: int):
        """To the worker's process group. Call only before the process is reaped."""
        try:
            os.killpg(self.popen.pid, signal.SIGCONT)
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def join_output(self, timeout: float):
        for t in self._pumps:
            t.join(timeout=timeout)


@dataclasses.dataclass(frozen=True)
class SshConfig:
    """How tfdp-run runs ssh.

    Args:
        port: ``--ssh-port`` (ssh ``-p``), or None for ssh's default.
        config_file: ``--ssh-config`` (ssh ``-F``), or None.
        options: ``--ssh-option`` values, each passed as ``-o OPTION`` (before tfdp-run's own
            defaults, so they win: ssh keeps the first value of an option).
        python: the remote Python for :mod:`tfdp.launcher.remote`; None: this Python's path if it
            exists there, else ``python3``.
        connect_timeout: seconds ssh waits for a host (``ConnectTimeout``) unless an option
            says otherwise.
        program: the ssh client.
    """

    port: Optional[int] = None
    config_file: Optional[str] = None
    options: tuple = ()
    python: Optional[str] = None
    connect_timeout: float = 10.0
    program: str = "ssh"

    def argv(self, host: Host, remote_command: str) -> list:
        argv = [self.program, "-T", "-x"]
        if self.config_file:
            argv += ["-F", self.config_file]
        if self.port:
            argv += ["-p", str(self.port)]
        for option in self.options:
            argv += ["-o", option]
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(self.connect_timeout))}"]
        return argv + [host.name, remote_command]

    def remote_command(self) -> str:
        """A POSIX shell line that starts tfdp.launcher.remote's bootstrap with the remote Python."""
        if self.python:
            python = f"PY={shlex.quote(self.python)}"
        else:
            python = f'PY={shlex.quote(sys.executable)}; [ -x "$PY" ] || PY=python3'
        return f'{python}; exec "$PY" -c {shlex.quote(_BOOTSTRAP)}'

    def get_config(self) -> dict:
        return dataclasses.asdict(self)


def _remote_source() -> bytes:
    with open(remote.__file__, encoding="utf-8") as f:
        return (json.dumps(f.read()) + "\n").encode()


class RemoteWorker:
    """The command on ``host`` over ssh, through :mod:`tfdp.launcher.remote`.

    Args:
        command, env: the worker command line and the variables to set there.
        log: where its output (and ssh's own messages) go.
        host, ssh: where and how.
        cwd: the remote working directory.
        private_env: {variable: control file name or ""} to point into the remote worker's
            private control directory.
        watch: the control file names the remote side relays.
        on_file: called with (name, text) for every control file the remote side relays.
    """

    def __init__(self, command, env, log: WorkerLog, host: Host, ssh: SshConfig, cwd: str,
                 private_env: Mapping[str, str], watch: Sequence[str],
                 on_file: Callable[[str, str], None]):
        self.host = host
        self.started = False  # set when the remote side reports the worker running
        self._log, self._on_file = log, on_file
        self._stdin_lock = threading.Lock()
        self.popen = subprocess.Popen(ssh.argv(host, ssh.remote_command()),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        job = {"mode": "run", "command": list(command), "cwd": cwd, "env": dict(env),
               "host": host.name, "private_env": dict(private_env),
               "watch": list(watch)}
        self._write(_remote_source() + (json.dumps(job) + "\n").encode())
        self._pumps = [_thread(_pump, self.popen.stdout, log.write),
                       _thread(_pump, self.popen.stderr, self._on_stderr)]

    def _write(self, data: bytes):
        with self._stdin_lock:
            try:
                self.popen.stdin.write(data)
                self.popen.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # ssh has ended; its exit tells the launcher

    def _on_stderr(self, line: str):
        if not line.startswith(remote.MARK):
            self._log.write(line)  # ssh's own messages (cannot connect, ...) or the remote side's
            return
        message = json.loads(line[len(remote.MARK):])
        if "started" in message:
            self.started = True
        if "file" in message:
            self._on_file(message["file"], message["text"])

    def send_signal(self, sig: int):
        """Relayed to the remote worker's group; SIGKILL kills ssh (the remote side follows)."""
        if sig == signal.SIGKILL:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        self._write(f"SIGCONT\n{signal.Signals(sig).name}\n".encode())

    def send_file(self, name: str, text: str):
        """Writes control file ``name`` into the remote worker's private control directory."""
        self._write((json.dumps({"file": name, "text": text}) + "\n").encode())

    def join_output(self, timeout: float):
        for t in self._pumps:
            t.join(timeout=timeout)


class ProbeError(RuntimeError):
    """A host answered but cannot run workers as configured (e.g. no such network interface)."""


class HostUnreachableError(RuntimeError):
    """ssh could not reach the host. Args: host, detail (what ssh said)."""

    def __init__(self, host: Host, detail: str):
        super().__init__(f"cannot reach host {host.name}: {detail}")
        self.host, self.detail = host, detail


def _probe_one(host: Host, count: int, ssh: SshConfig, avoid=()) -> tuple:
    if host.is_local:
        address = host.interface and remote.interface_address(host.interface)
        return address or host.default_address, free_ports(count, "", avoid)
    job = json.dumps({"mode": "probe", "ports": count, "interface": host.interface,
                      "avoid": sorted(avoid)})
    try:
        proc = subprocess.run(ssh.argv(host, ssh.remote_command()),
                              input=_remote_source() + (job + "\n").encode(),
                              capture_output=True, timeout=ssh.connect_timeout + 60)
    except subprocess.TimeoutExpired:
        raise HostUnreachableError(host, f"ssh did not answer within "
                                         f"{ssh.connect_timeout + 60:g} s") from None
    said = proc.stderr.decode("utf-8", "replace").strip()
    if proc.returncode == EXIT_HOST_UNREACHABLE:
        raise HostUnreachableError(host, f"ssh exited {EXIT_HOST_UNREACHABLE}: {said or 'no message'}")
    if proc.returncode != 0:
        raise ProbeError(f"host {host.name}: {said or f'exit code {proc.returncode}'}")
    answer = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return answer["address"] or host.default_address, answer["ports"]


def probe(hosts: Sequence[Host], counts: Sequence[int], ssh: SshConfig,
          retries: int = 5, avoid=()) -> list:
    """For each host, ``(address peers dial, [count free ports])``, none in ``avoid``; hosts
    asked in parallel.

    Raises :class:`HostUnreachableError` (the first host, in order, that ssh could not reach) or
    :class:`ProbeError`."""
    results: list = [None] * len(hosts)

    def ask(i):
        try:
            results[i] = _probe_one(hosts[i], counts[i], ssh, avoid)
        except (HostUnreachableError, ProbeError, SystemExit) as e:
            results[i] = e

    todo = list(range(len(hosts)))
    for _ in range(retries):
        threads = [_thread(ask, i) for i in todo]
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, SystemExit):
                raise ProbeError(str(r))
            if isinstance(r, Exception):
                raise r
        owners: dict = {}
        for i, (_, ports) in enumerate(results):
            for p in ports:
                owners.setdefault(p, []).append(i)
        todo = sorted({i for shared in owners.values() if len(shared) > 1 for i in shared[1:]})
        if not todo:
            return results
    raise ProbeError(f"hosts kept returning the same ports after {retries} tries: {results}")


def remote_environment(env: Mapping[str, str], names: Sequence[str] = ()) -> dict:
    """The variables a remote worker gets: tfdp's and TensorFlow's, and ``names``."""
    return {k: v for k, v in env.items()
            if k.startswith(PASSED_PREFIXES) or k in PASSED_NAMES or k in names}


def tf_configs(addresses: Sequence[str]) -> list:
    """Every rank's ``TF_CONFIG``: the workers at ``addresses`` (rank order), this task's index."""
    cluster = {"worker": tuple(addresses)}
    return [ClusterConfig(workers=list(addresses), task_type="worker", task_index=i,
                          cluster_spec=cluster).to_json() for i in range(len(addresses))]


class Attempt:
    """One launch of the current slots: the worker processes, their output, their exits.

    Args:
        command: the worker command line.
        slots: the slots to run, ascending; rank i runs slot ``slots[i]``.
        number: 0 for the first launch, k after the k-th restart.
        env: the base environment for every worker.
        workdir: where this attempt's control directory is created.
        addresses: each rank's ``host:port`` in ``TF_CONFIG``.
        logs: each rank's :class:`WorkerLog`.
        hosts: each rank's :class:`tfdp.launcher.hosts.Host`; None (or a local host): this machine.
        protocol_env: launcher settings every worker sees (min workers, restarts left, grace).
        ssh: how remote hosts are reached.
        pass_env: more variable names a remote worker gets (:func:`remote_environment`).
    """

    def __init__(self, command, slots, number, env, workdir, addresses, logs, hosts=None,
                 protocol_env=None, ssh=None, pass_env=()):
        self.command = list(command)
        self.slots = tuple(slots)
        self.number = number
        self.logs = list(logs)
        self.hosts = list(hosts) if hosts is not None else [None] * len(self.slots)
        self.ssh = ssh or SshConfig()
        self.pass_env = tuple(pass_env)
        self.control_dir = tempfile.mkdtemp(prefix=f"attempt-{number}-", dir=workdir)
        self.ready_files = [os.path.join(self.control_dir, f"ready-{r}")
                            for r in range(len(self.slots))]
        configs = tf_configs(addresses)
        self.envs = []
        for rank, slot in enumerate(self.slots):
            e = dict(env)
            e.update(protocol_env or {})
            # horovodrun's HOROVOD_RANK, HOROVOD_LOCAL_RANK, ... (and Open MPI's), from the
            # rule hvd.local_rank() etc. answer with (tfdp.cluster.placement).
            place = placement_of(addresses, rank)
            e.update(horovod_environment(place))
            # Workers that share a host take GPU memory as needed (placement's GPU rule).
            e.update(shared_host_environment(place, e))
            e.update({"TF_CONFIG": configs[rank], RANK_ENV: str(rank), SLOT_ENV: str(slot),
                      ATTEMPT_ENV: str(number), CONTROL_DIR_ENV: self.control_dir,
                      READY_FILE_ENV: self.ready_files[rank]})
            self.envs.append(e)
        self.workers: list = []
        self.codes: list = [None] * len(self.slots)
        self._exits: "queue.Queue[int]" = queue.Queue()
        self.started_at = None

    @property
    def num_workers(self) -> int:
        return len(self.slots)

    @property
    def procs(self) -> list:
        return [w.popen for w in self.workers]

    def _control_files(self, rank: int) -> list:
        ready = os.path.basename(self.ready_files[rank])
        return [ready, ready + ".joining", os.path.basename(progress_file("", rank)), EVICT_FILE]

    def _relay(self, rank: int, name: str, text: str):
        """A control file a remote worker wrote on its host, written here (atomically)."""
        if name not in self._control_files(rank):
            return
        path = os.path.join(self.control_dir, name)
        tmp = f"{path}.relay-{rank}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def start(self):
        """Starts every worker; OSError if a command (or ssh) cannot be started."""
        self.started_at = time.monotonic()
        for rank, env in enumerate(self.envs):
            host = self.hosts[rank]
            if host is None or host.is_local:
                worker = LocalWorker(self.command, env, self.logs[rank])
            else:
                ready = os.path.basename(self.ready_files[rank])
                worker = RemoteWorker(
                    self.command, remote_environment(env, self.pass_env), self.logs[rank], host,
                    self.ssh, os.getcwd(), {CONTROL_DIR_ENV: "", READY_FILE_ENV: ready},
                    self._control_files(rank),
                    lambda name, text, rank=rank: self._relay(rank, name, text))
            self.workers.append(worker)
            if _HAVE_WAITID:
                _thread(watch_exit, worker.popen.pid, rank, self._exits)

    def next_exit(self, timeout: float) -> Optional[int]:
        """Waits up to ``timeout`` s for the next worker exit; reaps it and returns its rank."""
        if not _HAVE_WAITID:
            return self._poll_exit(timeout)
        try:
            rank = self._exits.get(timeout=timeout)
        except queue.Empty:
            return None
        self.codes[rank] = exit_code_of(self.workers[rank].popen.wait())
        return rank

    def _poll_exit(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while True:
            for rank in self.running():
                code = self.workers[rank].popen.poll()
                if code is not None:
                    self.codes[rank] = exit_code_of(code)
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def running(self) -> list:
        return [r for r, c in enumerate(self.codes) if c is None and r < len(self.workers)]

    def all_exited(self) -> bool:
        return all(c is not None for c in self.codes)

    def signal_running(self, sig: int):
        for rank in self.running():  # not reaped yet (only next_exit reaps): the pid is ours
            self.workers[rank].send_signal(sig)

    def unreachable(self, rank: int) -> bool:
        """The worker's host could not be reached: ssh failed before the worker started."""
        worker = self.workers[rank] if rank < len(self.workers) else None
        return (worker is not None and not worker.started
                and self.codes[rank] == EXIT_HOST_UNREACHABLE)

    def ranks_on(self, host) -> tuple:
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    def joined(self, rank: int) -> bool:
        """The worker's strategy is up: it is connected to every peer."""
        return os.path.exists(self.ready_files[rank])

    def joining(self, rank: int) -> bool:
        """The worker has started creating its strategy (and may be waiting for peers)."""
        return os.path.exists(self.ready_files[rank] + ".joining")

    def progressed(self) -> bool:
        """Some worker completed a training step in this attempt (wrote its progress file)."""
        return any(os.path.exists(progress_file(self.control_dir, r))
                   for r in range(self.num_workers))

    def announce_exit(self, rank: int, exit_text: str) -> None:
        """Tells the other workers of this attempt that worker ``rank`` exited on its own
        (``PEER_EXITED_FILE``, written atomically here and relayed to workers on other hosts):
        one blocked in a step's collective ends it at once (tfdp.strategy.deadline) instead of
        after TensorFlow's heartbeat timeout."""
        text = json.dumps({"slot": self.slots[rank], "rank": rank, "exit": exit_text})
        path = os.path.join(self.control_dir, PEER_EXITED_FILE)
        try:
            with open(f"{path}.tmp", "w") as f:
                f.write(text)
            os.replace(f"{path}.tmp", path)
        except OSError:
            pass  # the local others then wait for the heartbeat timeout, as before
        for other, worker in enumerate(self.workers):
            if other != rank and hasattr(worker, "send_file"):  # over ssh: relayed there
                worker.send_file(PEER_EXITED_FILE, text)

    def eviction_text(self) -> Optional[str]:
        try:
            with open(os.path.join(self.control_dir, EVICT_FILE)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def close(self):
        # Every line a worker wrote reaches its log and the terminal before tfdp-run moves on:
        # the pipes reach end-of-file as soon as the workers are gone, so this waits only for
        # the pump threads (seconds on a loaded host; 2 s lost lines). The bound is for a
        # worker's descendant that keeps the pipe open after the worker exited.
        deadline = time.monotonic() + OUTPUT_DRAIN_SECONDS
        for worker in self.workers:
            worker.join_output(timeout=max(0.0, deadline - time.monotonic()))
        for log in self.logs:
            log.close()
