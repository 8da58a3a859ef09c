"""tfdp-run: start N local workers with their TF_CONFIG. Pure Python, no TensorFlow.

    tfdp-run --workers 2 [--cpu-replicas 2] [--timeout 600] [--start-timeout 120] -- python train.py

Each worker gets ``TF_CONFIG`` (free 127.0.0.1 ports), ``TFDP_RANK``, and, with
``--cpu-replicas K``, ``TFDP_CPU_REPLICAS=K`` which ``DataParallelStrategy()`` reads to split
the worker's CPU into K logical replicas. Output lines are prefixed with ``[w<rank>]``.

Failure handling:

* the first worker to exit non-zero decides the exit code; the others are stopped
  (SIGTERM, then SIGKILL after a grace period);
* a worker that has not joined the cluster within ``--start-timeout`` seconds (the
  strategy writes a ready file when it has) ends the job: TensorFlow's strategy
  constructor would otherwise wait for it forever;
* ``--timeout`` bounds the whole job;
* Ctrl-C (SIGINT) and SIGTERM are forwarded to every worker.

Exit codes: the failing worker's code (128+signal if it was killed by a signal), 124 for
a timeout, 125 for a worker that never joined, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from tfdp.cluster import CPU_REPLICAS_ENV, READY_FILE_ENV, RANK_ENV

EXIT_TIMEOUT = 124
EXIT_NEVER_JOINED = 125
EXIT_INTERRUPTED = 130


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free TCP ports on ``host`` (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_configs(num_workers: int, ports: Sequence[int], host: str = "127.0.0.1") -> list[str]:
    workers = [f"{host}:{p}" for p in ports]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            for i in range(num_workers)]


def _pump(stream, prefix: str, out, lock: threading.Lock):
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix} {line}\n")
            out.flush()
    stream.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Job:
    """N worker processes and their supervision."""

    def __init__(self, command, num_workers, cpu_replicas=None, env=None, out=None,
                 grace_seconds=5.0):
        self.command = list(command)
        self.num_workers = num_workers
        self.out = out or sys.stdout
        self.grace_seconds = grace_seconds
        self.procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._tmp = tempfile.mkdtemp(prefix="tfdp-run-")
        self.ready_files = [os.path.join(self._tmp, f"ready-{i}") for i in range(num_workers)]
        base = dict(os.environ if env is None else env)
        base["PYTHONUNBUFFERED"] = "1"
        if cpu_replicas:
            base[CPU_REPLICAS_ENV] = str(cpu_replicas)
        configs = tf_configs(num_workers, free_ports(num_workers))
        self.envs = []
        for i in range(num_workers):
            e = dict(base)
            e["TF_CONFIG"] = configs[i]
            e[RANK_ENV] = str(i)
            e[READY_FILE_ENV] = self.ready_files[i]
            self.envs.append(e)

    def log(self, message):
        with self._lock:
            self.out.write(f"[tfdp-run] {message}\n")
            self.out.flush()

    def start(self):
        for i, env in enumerate(self.envs):
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards
            # it, and stopping a worker's group also stops what the worker started.
            p = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[w{i}]", self.out, self._lock),
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def signal_all(self, sig):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop_all(self):
        """SIGTERM every running worker, SIGKILL what is left after the grace period."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for t in self._threads:
            t.join(timeout=2)

    def joined(self, rank: int) -> bool:
        """The worker's strategy is up: it is connected to every peer."""
        return os.path.exists(self.ready_files[rank])

    def joining(self, rank: int) -> bool:
        """The worker has started creating its strategy (and may be waiting for peers)."""
        return os.path.exists(self.ready_files[rank] + ".joining")

    def supervise(self, timeout=None, start_timeout=None, poll_seconds=0.05) -> int:
        start = time.monotonic()
        interrupted = []

        def on_signal(signum, frame):
            interrupted.append(signum)

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            while True:
                if interrupted:
                    self.log(f"received {signal.Signals(interrupted[0]).name}; forwarding to "
                             "all workers")
                    self.signal_all(signal.SIGINT)
                    self.stop_all()
                    return EXIT_INTERRUPTED
                codes = [p.poll() for p in self.procs]
                for rank, code in enumerate(codes):
                    if code not in (None, 0):
                        self.log(f"worker {rank} exited with code {_exit_code(code)}; stopping "
                                 "the other workers")
                        self.stop_all()
                        return _exit_code(code)
                if all(c == 0 for c in codes):
                    for t in self._threads:
                        t.join(timeout=2)
                    return 0
                elapsed = time.monotonic() - start
                if start_timeout and elapsed > start_timeout:
                    missing = [r for r in range(self.num_workers)
                               if codes[r] is None and not self.joined(r)]
                    if missing:
                        absent = [r for r in missing if not self.joining(r)] or missing
                        waiting = [r for r in missing if r not in absent]
                        self.log(
                            f"worker(s) {absent} did not join the cluster within "
                            f"{start_timeout:g} s (never created a DataParallelStrategy)"
                            + (f"; worker(s) {waiting} are waiting for them" if waiting else "")
                            + ". Stopping the job. Check the worker's output above, or raise "
                            "--start-timeout (0 disables the check) if it needs longer to "
                            "start.")
                        self.stop_all()
                        return EXIT_NEVER_JOINED
                    start_timeout = None  # everyone joined (or finished): stop checking
                if timeout is not None and elapsed > timeout:
                    self.log(f"job exceeded --timeout {timeout:g} s; stopping all workers")
                    self.stop_all()
                    return EXIT_TIMEOUT
                time.sleep(poll_seconds)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="tfdp-run", description="Start N local tfdp workers with TF_CONFIG.",
        usage="tfdp-run --workers N [--cpu-replicas K] [--timeout S] [--start-timeout S] -- CMD ...")
    parser.add_argument("--workers", type=int, required=True, help="number of worker processes")
    parser.add_argument("--cpu-replicas", type=int, default=None,
                        help="logical CPU replicas per worker (sets TFDP_CPU_REPLICAS)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop the job after this many seconds (exit 124)")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="seconds for every worker to create its DataParallelStrategy "
                             "(join the cluster); 0 disables the check (exit 125)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given; write: tfdp-run --workers 2 -- python train.py")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: need at least 1 worker")
    if args.cpu_replicas is not None and args.cpu_replicas < 1:
        parser.error(f"--cpu-replicas {args.cpu_replicas}: need at least 1")
    args.command = command
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    job = Job(args.command, args.workers, cpu_replicas=args.cpu_replicas)
    job.log(f"starting {args.workers} worker(s): {' '.join(args.command)}")
    job.start()
    code = job.supervise(timeout=args.timeout, start_timeout=args.start_timeout)
    job.log(f"job finished with exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
