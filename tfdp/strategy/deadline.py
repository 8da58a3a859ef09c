"""Step deadlines: a step that waits too long for its peers ends with an error, not a hang.

Rule. TensorFlow's collectives run without a deadline of their own. A peer that dies or
freezes is found by TensorFlow's coordination service, which every worker heartbeats to: about
10 s after its last heartbeat every collective in flight fails with ``UnavailableError`` naming
the task. A peer that is alive but never reaches the collective (a deadlock, a callback or an
input pipeline that blocks, a different number of steps) still heartbeats; for it, tfdp keeps
one deadline per process: while a step runs (Keras's train and test functions, tfdp's own
agreements, a custom step under ``DataParallelStrategy.step_deadline()``), a watchdog thread
aborts TensorFlow's collectives once the step has run ``timeout_seconds``, and the step fails
with ``DeadlineExceededError`` saying what waited and what to do. The first run of each step
function (tracing, XLA compilation, peers still starting) gets ``FIRST_STEP_FACTOR`` times as
long. Under a strategy without ``timeout_seconds`` (one process, by default) nothing is armed.

Why not TensorFlow's own per-collective timeout (``CommunicationOptions.timeout_seconds``, which
tfdp passed before): TensorFlow 2.21 implements it by starting, for every collective, threads
that sleep for the whole timeout whether or not the collective finished. Measured on this host:
two threads per collective, each alive for the timeout; a 2-worker job at 400 steps/s held
16,000 threads after 19 s and died with ``std::system_error: Resource temporarily unavailable``
(SIGABRT). A job at 10 steps/s with two local replicas held about 12,000 sleeping threads
at all times. One watchdog thread per process costs a lock and a notify per step.

Outside a step: the initial-value broadcast. Every variable created in ``strategy.scope()`` on
several workers is a collective (the chief sends its initial value, the others receive it), run
when the variable is created, outside any step. ``variable_broadcast`` puts it under the same
deadline (the first variable of a strategy, where the workers first meet, gets
``FIRST_STEP_FACTOR`` times as long), and each worker posts its arrival at that first one in the
coordination service, so the error names the worker(s) that never came.

Other collectives outside a step (``collective_outside_step``): Horovod's eager collectives
(``hvd.broadcast_variables``, ``allreduce`` ... called outside a ``tf.function``), ZeRO-3's
whole-tensor reads (``model.save``, ``get_weights``: every worker gathers every slice) and
Keras's predict steps. Each call posts this worker's arrival (numbered per kind, the same on
every worker since all call them in the same order) and runs under the deadline; a call that
fails, by the deadline or because a peer left, fails naming the worker(s) that never arrived
and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from tfdp import process_state

__all__ = ["FIRST_STEP_FACTOR", "deadline_seconds", "overdue_message", "Watchdog", "watching",
           "variable_broadcast", "broadcast_overdue_message", "collective_outside_step",
           "outside_step_message"]

FIRST_STEP_FACTOR = 6


def deadline_seconds(timeout_seconds, first: bool):
    """How long a step may run before its collectives are aborted (None: no deadline)."""
    if not timeout_seconds:
        return None
    return float(timeout_seconds) * (FIRST_STEP_FACTOR if first else 1)


def overdue_message(what: str, seconds: float, rank: int, num_workers: int,
                    missing=None) -> str:
    """The error of a step that ran past its deadline.

    Args:
        missing: the ranks that never started this step function (known at its first run;
            None: unknown).
    """
    head = (f"tfdp: {what} on worker {rank} of {num_workers} did not finish within {seconds:g} s "
            "(DataParallelStrategy's timeout_seconds), so tfdp aborted its collectives. ")
    if missing:
        return head + (f"Worker(s) {', '.join(map(str, missing))} never started it: every "
                       "worker must run it (an `if is_chief` around model.evaluate, predict or "
                       "fit, or a worker stuck before it, leaves the others waiting). If a "
                       "worker legitimately arrives this much later, raise timeout_seconds.")
    if num_workers == 1:
        return head + ("One of this process's replicas never reached a collective the others "
                       "wait in (a collective under a condition some replicas skip). If a step "
                       "legitimately takes this long, raise timeout_seconds.")
    return head + ("Every peer is still alive (a dead or frozen one fails the step within about "
                   "10 s instead), so one is not taking part: it is stuck outside the step (a "
                   "callback, its input pipeline, a deadlock) or runs a different number of "
                   "steps. The worker logs show which one is behind. If a step legitimately "
                   "takes this long, raise timeout_seconds.")


class Watchdog:
    """One thread that calls ``abort(message)`` when the innermost armed deadline passes.

    ``arm`` pushes a deadline (nested ones, e.g. an agreement inside a step, are a stack)
    and returns a token for ``disarm``; the thread sleeps until the innermost deadline and
    starts only at the first ``arm``.

    Args:
        abort: called once per overdue step, from the watchdog's thread, with the message
            (``arm``'s ``message``, called first if it is callable: formatted only when due).
    """

    def __init__(self, abort):
        self._abort = abort
        self._cond = threading.Condition()
        self._armed = []  # [(due, message, token)], innermost last
        self._tokens = 0
        self._thread = None
        self._closing = None  # the thread told to end by close()

    def arm(self, seconds: float, message) -> int:
        with self._cond:
            self._tokens += 1
            self._armed.append((time.monotonic() + seconds, message, self._tokens))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="tfdp-step-deadline",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._tokens

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Ends the thread (``tfdp.reset()``); a later ``arm`` starts a new one. Armed
        deadlines are dropped."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._armed = []
            self._closing = thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed = [entry for entry in self._armed if entry[2] != token]
            self._cond.notify()  # an outer deadline may be due sooner than the one it waits for

    def _watch(self):
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._armed and self._closing is not me:
                    self._cond.wait()
                if self._closing is me:
                    self._closing = None
                    return
                due, message, token = self._armed[-1]
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed.pop()
            self._abort(message() if callable(message) else message)


def _abort_collectives(message):
    from tfdp import _tf_private

    _tf_private.abort_collective_ops(message)


_watchdog = Watchdog(_abort_collectives)


@contextlib.contextmanager
def watching(strategy, what: str, first: bool = False):
    """Arms the deadline of ``strategy`` (its ``timeout_seconds``) for the ``with`` body.

    Args:
        strategy: any strategy; only a tfdp one with ``timeout_seconds`` set arms anything.
        what: names the step in the error (``"training step"``).
        first: the first run of a step function (``FIRST_STEP_FACTOR`` times as long).
    """
    seconds = deadline_seconds(getattr(strategy, "timeout_seconds", None), first)
    if seconds is None:
        yield
        return
    cluster = strategy.cluster
    message = functools.partial(overdue_message, what, seconds, cluster.rank, cluster.num_workers)
    if first and cluster.is_multi_worker and hasattr(strategy, "_tfdp_key_base"):
        # The first run of a step function: each worker posts its arrival, so the error names
        # the ones that never came (every worker builds its step functions in one order).
        from tfdp import _tf_private

        if _tf_private.coordination_service_configured():
            base = f"tfdp/first-step/{strategy._tfdp_key_base}/{what}"  # noqa: SLF001
            key = f"{base}/{_next_call_number(base)}"
            _tf_private.publish_to_coordination_service(f"{key}/{cluster.rank}", "1")
            message = functools.partial(_overdue_naming, what, seconds, cluster, key)
    token = _watchdog.arm(seconds, message)
    try:
        yield
    finally:
        _watchdog.disarm(token)


def _overdue_naming(what, seconds, cluster, key):
    return overdue_message(what, seconds, cluster.rank, cluster.num_workers,
                           _missing_arrivals(key, cluster.num_workers))


# --- the initial-value broadcast of a variable (outside any step) ---------------------------

_ARRIVAL_KEY = "tfdp/first-variable"


def broadcast_overdue_message(variable: str, seconds: float, rank: int, num_workers: int,
                              missing=None) -> str:
    """The error of an initial-value broadcast past its deadline.

    Args:
        missing: the ranks that never reached the strategy's first variable (None: unknown).
    """
    head = (f"tfdp: the initial-value broadcast of variable {variable!r} on worker {rank} of "
            f"{num_workers} did not finish within {seconds:g} s (DataParallelStrategy's "
            "timeout_seconds), so tfdp aborted its collectives. Each variable created in "
            "strategy.scope() is a collective: the chief (worker 0) sends its initial value "
            "and every other worker receives it, so every worker must create the same "
            "variables in the same order. ")
    if missing:
        who = (f"Worker(s) {', '.join(map(str, missing))} never reached this strategy's first "
               "variable: they are stuck before building the model (input preparation, a "
               "download, a blocking call) or skip it (an `if is_chief` / `if rank == 0` "
               "around building a model, optimizer or variable). ")
    else:
        who = ("Every worker reached this strategy's first variable, so one creates a variable "
               "the others do not (an `if is_chief` / `if rank == 0` around creating a model, "
               "optimizer, metric or variable inside strategy.scope()) or is stuck between two "
               "variables. The worker logs show which one is behind. ")
    return head + who + ("Build the same model on every worker; if a worker legitimately "
                         "reaches it this much later, raise timeout_seconds.")


def _missing_arrivals(key: str, num_workers: int, per_key_seconds: float = 1.0,
                     budget_seconds: float = 10.0) -> list:
    """The ranks whose arrival under ``key`` is not in the coordination service. A posted key
    answers at once; a read with a 1 ms timeout failed for posted ones on a loaded host (the
    chief named itself missing), so each missing one costs ``per_key_seconds``, within
    ``budget_seconds`` in all (ranks not read by then are not named)."""
    import time

    from tfdp import _tf_private

    missing, give_up = [], time.monotonic() + budget_seconds
    for rank in range(num_workers):
        left = give_up - time.monotonic()
        if left <= 0:
            break
        try:
            _tf_private.read_from_coordination_service(f"{key}/{rank}",
                                                       min(per_key_seconds, left))
        except Exception:  # noqa: BLE001  (tf.errors.OpError: not there, or the service is gone)
            missing.append(rank)
    return missing


@contextlib.contextmanager
def variable_broadcast(strategy, variable: str, first: bool):
    """Arms ``strategy``'s deadline around creating ``variable`` (its initial-value broadcast)
    on several workers; see the module docstring.

    Args:
        strategy: a tfdp strategy (nothing is armed for one worker or no ``timeout_seconds``).
        variable: the variable's name, for the error.
        first: the strategy's first variable: the workers first meet there (a longer
            deadline), and each posts its arrival so the error can name the missing ones.
    """
    cluster = getattr(strategy, "cluster", None)
    seconds = deadline_seconds(getattr(strategy, "timeout_seconds", None), first)
    if cluster is None or not cluster.is_multi_worker or seconds is None:
        yield
        return
    from tfdp import _tf_private

    key = f"{_ARRIVAL_KEY}/{strategy._tfdp_key_base}"  # noqa: SLF001 (per strategy, same on all)
    known = first and _tf_private.coordination_service_configured()
    if known:
        _tf_private.publish_to_coordination_service(f"{key}/{cluster.rank}", "1")

    def message():
        missing = _missing_arrivals(key, cluster.num_workers) if known else None
        return broadcast_overdue_message(variable, seconds, cluster.rank, cluster.num_workers,
                                         missing)

    token = _watchdog.arm(seconds, message)
    try:
        yield
    finally:
        _watchdog.disarm(token)


# --- other collectives outside a step ------------------------------------------------------

def outside_step_message(what: str, seconds: float, rank: int, num_workers: int, missing,
                         fix: str, cause: str = "") -> str:
    """The error of a collective outside a step that did not finish.

    Args:
        missing: the ranks that never arrived at it (None: unknown).
        fix: what the user should do, for this kind of collective.
        cause: the error the collective ended with ("" when the deadline ended it).
    """
    if cause:
        head = (f"tfdp: {what} on worker {rank} of {num_workers} failed ({cause}). ")
    else:
        head = (f"tfdp: {what} on worker {rank} of {num_workers} did not finish within "
                f"{seconds:g} s (DataParallelStrategy's timeout_seconds), so tfdp aborted its "
                "collectives. ")
    if missing:
        who = (f"Worker(s) {', '.join(map(str, missing))} never arrived at it: every worker "
               "must make this call, in the same order. ")
    elif missing is not None:
        who = "Every worker arrived at it; one is stuck or slower than the deadline. "
    else:
        who = "The worker logs show which one is behind. "
    return head + who + fix


_outside_counts: dict = {}
_outside_lock = threading.Lock()


def _next_call_number(key: str) -> int:
    with _outside_lock:
        n = _outside_counts.get(key, 0)
        _outside_counts[key] = n + 1
        return n


@contextlib.contextmanager
def collective_outside_step(strategy, what: str, fix: str, kind: str | None = None,
                            first: bool | None = None):
    """Bounds one collective call outside a training step on several workers (module
    docstring): posts this worker's arrival, arms ``strategy``'s deadline, and turns a
    failure into an error naming the worker(s) that never arrived and ``fix``.

    Args:
        strategy: a tfdp strategy (nothing is done for one worker or no ``timeout_seconds``).
        what: names the call in the error ("tfdp.horovod.broadcast_variables").
        fix: the fix, in the error.
        kind: calls of one kind are numbered together (default: ``what``).
        first: the first call (tracing, peers still starting): ``FIRST_STEP_FACTOR`` times
            as long; None: whether this is the first call of its kind.
    """
    cluster = getattr(strategy, "cluster", None)
    if (cluster is None or not cluster.is_multi_worker
            or deadline_seconds(getattr(strategy, "timeout_seconds", None), False) is None):
        yield
        return
    import tensorflow as tf

    from tfdp import _tf_private

    base = f"tfdp/outside/{strategy._tfdp_key_base}/{kind or what}"  # noqa: SLF001
    number = _next_call_number(base)
    seconds = deadline_seconds(strategy.timeout_seconds, number == 0 if first is None else first)
    key = f"{base}/{number}"
    known = _tf_private.coordination_service_configured()
    if known:
        _tf_private.publish_to_coordination_service(f"{key}/{cluster.rank}", "1")
        if number >= 2:
            # The service keeps what it is given: drop this worker's arrival two calls back
            # (a peer at most one call ahead still finds the one before).
            _tf_private.delete_from_coordination_service(f"{base}/{number - 2}/{cluster.rank}")

    def message(cause=""):
        missing = _missing_arrivals(key, cluster.num_workers) if known else None
        return outside_step_message(what, seconds, cluster.rank, cluster.num_workers, missing,
                                    fix, cause)

    token = _watchdog.arm(seconds, message)
    try:
        yield
    except tf.errors.OpError as e:
        if "tfdp:" in (e.message or ""):
            raise  # the deadline's own message
        raise type(e)(e.node_def, e.op, message(f"{type(e).__name__}: {e.message}")) from e
    finally:
        _watchdog.disarm(token)


def _stop_watching() -> None:
    _watchdog.close()
    with _outside_lock:
        _outside_counts.clear()


process_state.register("step-deadline watchdog", __name__,
                       lambda: (_watchdog.running(), len(_outside_counts)), _stop_watching)
