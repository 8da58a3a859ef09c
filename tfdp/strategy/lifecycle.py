"""A worker's life as the launcher and its peers see it: joining, SIGTERM, leaving together.

This is the worker's side of the launcher protocol (``tfdp.protocol``), kept apart from the
strategy's collectives and from the Keras integration. Four rules, one per mechanism:

* Joining. When tfdp-run gives ``TFDP_READY_FILE``, the strategy writes ``<file>.joining``
  before it joins the cluster and ``<file>`` once it has (``announce_joining``,
  ``announce_joined``): a worker stuck between the two is waiting for a missing peer, which
  the launcher can then name.
* SIGTERM. Joining a cluster lets TensorFlow's coordination service take SIGTERM over; the
  strategy gives it back to whatever Python had on record (``take_back_sigterm``).
* The job. The cluster of the last multi-worker strategy built in this process is the
  process's job (``job``), so "am I the chief?" has one answer inside and outside any scope.
* Leaving together (the orderly exit, below).

Orderly exit. At interpreter exit, unless the process is failing (an uncaught exception, or a non-zero
``sys.exit``), every worker first runs the hooks given to ``before_leaving`` (ZeRO-3's
whole-tensor reads: the chief lets the others go, the others serve its reads until it does,
zero3/whole_reads.py), then waits at one coordination-service barrier (at most the strategy's
collective timeout; it fails as soon as the service finds a peer dead), then the chief, whose
process hosts the service, waits until the other workers' processes are gone (at most
``CHIEF_EXIT_DRAIN_SECONDS``) before it exits. Failing exits never wait and keep their exit
code; a handler that cannot complete logs one warning and lets the process exit.
``TFDP_ORDERLY_EXIT=0`` (``tfdp.protocol.ORDERLY_EXIT_ENV``) turns it off. ``release()``
takes the handler and the ``sys.exit`` wrapper out again (tests, embedding).

Why. TensorFlow's coordination service, which every worker heartbeats to, runs in the chief's
process, and TensorFlow has no multi-worker shutdown: a worker still running when the chief
exits logs heartbeat errors (``Failed to connect to remote host``), and a chief still running
~10 s after the others exited logs them as crashed. ``DataParallelStrategy`` registers the
handler (``register``) when the first multi-worker strategy is built.

Pure Python apart from the barrier, which goes through ``tfdp._tf_private``.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time

from tfdp import process_state
from tfdp.cluster import ClusterConfig
from tfdp.protocol import ORDERLY_EXIT_ENV, READY_FILE_ENV

__all__ = ["register", "release", "before_leaving", "worker_address", "leave_together_at_exit", "announce_joining", "announce_joined",
           "take_back_sigterm", "job", "ORDERLY_EXIT_ENV", "CHIEF_EXIT_DRAIN_SECONDS"]

log = logging.getLogger("tfdp")

# After the exit barrier the other workers need about 1 s (measured: Python and TensorFlow
# teardown) to be gone; the chief waits at most this long for them. Well below the
# coordination service's 10 s heartbeat timeout, after which the chief's service would
# report the departed workers as crashed.
CHIEF_EXIT_DRAIN_SECONDS = 5.0
_EXIT_BARRIER_ID = "tfdp/orderly-exit"


# --- joining and the process's job ---------------------------------------------------------

_job: ClusterConfig | None = None


def job() -> ClusterConfig | None:
    """The cluster of the multi-worker job this process joined, or None if it joined none."""
    return _job


def _ready_file(environ=None) -> str | None:
    environ = os.environ if environ is None else environ
    return environ.get(READY_FILE_ENV) or None


def announce_joining(cluster: ClusterConfig, environ=None) -> None:
    """Tells tfdp-run (``TFDP_READY_FILE.joining``) that this worker is joining ``cluster``:
    if it never gets further, a peer is missing, and the launcher can name the peer."""
    path = _ready_file(environ)
    if path:
        with open(path + ".joining", "w") as f:
            f.write(f"{cluster.rank}\n")


def announce_joined(cluster: ClusterConfig, environ=None) -> None:
    """Records ``cluster`` as this process's job and tells tfdp-run it joined."""
    global _job
    if cluster.is_multi_worker:
        _job = cluster
    path = _ready_file(environ)
    if path:
        with open(path, "w") as f:
            f.write(f"{cluster.rank}\n")


def take_back_sigterm() -> None:
    """Puts back the SIGTERM handler Python has on record, after TensorFlow replaced it.

    Joining a multi-worker cluster starts TensorFlow's coordination service, which installs
    a C-level SIGTERM handler of its own (the preemption notifier behind
    ``tf.distribute.experimental.PreemptionCheckpointHandler``) that only records the
    signal. Without this a worker ignores ``kill``, Kubernetes' and Slurm's termination and
    tfdp-run's stop until SIGKILL arrives, and a handler installed before the strategy is
    silently dead. Python still believes its own handler (by default: terminate) is in
    place, so installing that again restores what the script expects. tfdp's own preemption
    path (``tfdp.callbacks.BackupAndRestore``) installs its handler later, through Python.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; TensorFlow's stays
    on_record = signal.getsignal(signal.SIGTERM)
    if on_record is not None:  # None: installed from outside Python, not ours to change
        signal.signal(signal.SIGTERM, on_record)


# --- the orderly exit ----------------------------------------------------------------------

def leave_together_at_exit(uncaught_exception: bool, exit_code, environ=None) -> bool:
    """Whether this worker should take part in the orderly exit; pure policy.

    Args:
        uncaught_exception: the interpreter is exiting because of an uncaught exception.
        exit_code: the argument of ``sys.exit`` if it was called (None otherwise). ``None``
            and ``0`` mean success, anything else (a non-zero int, a message) failure.
        environ: the environment (default ``os.environ``); ``TFDP_ORDERLY_EXIT=0`` opts out.

    A failing worker must not wait for peers: they may be blocked in a collective with it,
    and only its exit tells them (and tfdp-run, which reports the first failing code).
    """
    environ = os.environ if environ is None else environ
    if environ.get(ORDERLY_EXIT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return not uncaught_exception and exit_code in (None, 0)


def worker_address(cluster: ClusterConfig, rank: int) -> tuple:
    """(host, port) of worker ``rank``'s TensorFlow server (its TF_CONFIG address)."""
    host, _, port = cluster.workers[rank].rpartition(":")
    return host.strip("[]"), int(port)


def _peer_addresses(cluster: ClusterConfig) -> list:
    """(host, port) of every other worker of the job."""
    return [worker_address(cluster, rank) for rank in range(len(cluster.workers))
            if rank != cluster.rank]


def _wait_until_gone(addresses, timeout_seconds: float) -> list:
    """Waits until no process listens at ``addresses`` any more; returns those still there.

    A worker's TensorFlow server listens on its TF_CONFIG address for the life of the
    process, and the operating system closes the socket when the process ends. So: connect,
    then block reading until the peer closes the connection (process gone; a refused
    connection means already gone). Event-driven, bounded by ``timeout_seconds`` in all.
    """
    deadline = time.monotonic() + timeout_seconds
    remaining = []
    for address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            remaining.append(address)
            continue
        try:
            conn = socket.create_connection(address, timeout=left)
        except OSError:
            continue  # refused or unreachable: nobody there
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    remaining.append(address)
                    break
                conn.settimeout(left)
                if not conn.recv(4096):
                    break  # closed by the peer's exit
        except socket.timeout:
            remaining.append(address)
        except OSError:
            pass  # reset by the peer's exit
        finally:
            conn.close()
    return remaining


# Run at an orderly exit before the barrier, in order: hook(cluster, timeout_seconds).
_before_leaving = []


def before_leaving(hook) -> None:
    """Runs ``hook(cluster, timeout_seconds)`` at this worker's orderly exit, before the exit
    barrier (once, however often it is given)."""
    if hook not in _before_leaving:
        _before_leaving.append(hook)


class _OrderlyExit:
    """Process-wide exit handler of multi-worker strategies (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cluster = None
        self._timeout = None
        self._exit_code = None
        self._exit_wrapper = None

    def register(self, cluster: ClusterConfig, timeout_seconds: float):
        with self._lock:
            first = self._cluster is None
            self._cluster = cluster
            self._timeout = timeout_seconds
            if not first:
                return
            # sys.exit(code) is the one failing exit the handler could not tell from success
            # otherwise: SystemExit never reaches sys.excepthook, and atexit handlers do not
            # see the code. The wrapper only records it.
            original_exit = sys.exit

            def exit(status=None):  # same name as what it wraps
                if threading.current_thread() is threading.main_thread():
                    self._exit_code = status  # elsewhere it only ends that thread
                original_exit(status)

            exit.__doc__ = original_exit.__doc__
            exit.__wrapped__ = original_exit
            sys.exit = self._exit_wrapper = exit
            atexit.register(self._on_exit)

    def release(self):
        with self._lock:
            if self._cluster is None:
                return
            if sys.exit is self._exit_wrapper:  # not if someone wrapped it after us
                sys.exit = self._exit_wrapper.__wrapped__
            atexit.unregister(self._on_exit)
            self._cluster = self._timeout = self._exit_code = None

    def _on_exit(self):
        # An uncaught exception sets sys.last_value before atexit handlers run.
        failing = getattr(sys, "last_value", None) is not None
        if not leave_together_at_exit(failing, self._exit_code):
            return
        cluster = self._cluster
        try:
            from tfdp import _tf_private  # inside: an exit handler must not raise

            if not _tf_private.coordination_service_configured():
                return
            for hook in list(_before_leaving):
                try:
                    hook(cluster, self._timeout)
                except Exception as e:  # an exit handler must not raise
                    log.warning("tfdp: orderly exit: %s failed: %s: %s", getattr(
                        hook, "__qualname__", hook), type(e).__name__, str(e)[:300])
            _tf_private.wait_at_coordination_barrier(_EXIT_BARRIER_ID, self._timeout)
        except Exception as e:  # an exit handler must not raise
            reason = (str(e).splitlines() or [""])[0][:200]
            log.warning("tfdp: orderly exit: the exit barrier failed (a worker died, or did not "
                        "arrive within %.0f s): %s: %s. Exiting without waiting for the others.",
                        self._timeout, type(e).__name__, reason)
            return
        if cluster.is_chief:
            left = _wait_until_gone(_peer_addresses(cluster), CHIEF_EXIT_DRAIN_SECONDS)
            if left:
                log.info("tfdp: orderly exit: worker(s) at %s still running %.0f s after the "
                         "exit barrier; the chief exits anyway.",
                         ", ".join(f"{h}:{p}" for h, p in left), CHIEF_EXIT_DRAIN_SECONDS)


_orderly_exit = _OrderlyExit()


def register(cluster: ClusterConfig, timeout_seconds: float) -> None:
    """Makes this process leave together with the other workers of ``cluster``.

    Args:
        cluster: the job's cluster (several workers).
        timeout_seconds: how long the exit barrier waits for the others (the strategy's
            collective timeout).
    """
    if not timeout_seconds or timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds={timeout_seconds!r}: the exit barrier needs a "
                         "positive bound.")
    _orderly_exit.register(cluster, float(timeout_seconds))


def release() -> None:
    """Undoes ``register`` and forgets the job: ``sys.exit`` and the exit handlers are as
    they were before the first multi-worker strategy (tests, programs that embed tfdp)."""
    global _job
    _orderly_exit.release()
    _before_leaving.clear()
    _job = None


process_state.register("job", __name__, lambda: (job(), sys.exit.__module__), release)
