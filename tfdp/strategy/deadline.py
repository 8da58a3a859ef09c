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

A peer that exits under ``tfdp-run`` (a crash, SIGKILL) is announced at once: the launcher
writes ``PEER_EXITED_FILE`` in the attempt's control directory, and the watchdog, which looks
for it every ``PEER_EXIT_POLL_SECONDS`` while a step is armed, aborts the step's collectives
with a message naming the worker, instead of leaving them to TensorFlow's 10 s heartbeat
timeout (a restart's survivor sat there 10-12 s, docs/benchmarks/bench_restart.md).

Rule for every place the workers meet outside a step (those two, and the first run of a step
function): it goes through one ``Arrivals`` (its key in the coordination service, this worker's
``arrive``, the deadline ``watch`` arms and disarms, ``missing``), and its error is built by
``stall_message`` (what stalled on which worker, within which deadline or with which cause,
who never arrived, the fix). A strategy is named in the keys by ``strategy_key``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time

from tfdp import process_state
from tfdp.protocol import CONTROL_DIR_ENV, PEER_EXITED_FILE

__all__ = ["FIRST_STEP_FACTOR", "PEER_EXIT_POLL_SECONDS", "peer_exited_message",
           "deadline_seconds", "overdue_message", "Watchdog", "watching",
           "variable_broadcast", "broadcast_overdue_message", "collective_outside_step",
           "outside_step_message", "stall_message", "Arrivals", "strategy_key"]

FIRST_STEP_FACTOR = 6
# How often an armed watchdog looks for tfdp-run's PEER_EXITED_FILE (a stat; only under tfdp-run).
PEER_EXIT_POLL_SECONDS = 0.25


def deadline_seconds(timeout_seconds, first: bool):
    """How long a step may run before its collectives are aborted (None: no deadline)."""
    if not timeout_seconds:
        return None
    return float(timeout_seconds) * (FIRST_STEP_FACTOR if first else 1)


def stall_message(what: str, seconds: float, rank: int, num_workers: int, missing, *,
                  named: str, everyone: str, unknown: str, fix: str = "", context: str = "",
                  cause: str = "") -> str:
    """The error of a collective that did not finish: ``what`` on which worker, past which
    deadline (or failed with ``cause``), ``context``, who did not arrive, ``fix``.

    Args:
        missing: the ranks that never arrived ([]: every worker did; None: unknown).
        named: follows "Worker(s) 1, 2 " when some are missing.
        everyone, unknown: the sentence when every worker arrived, and when it is unknown.
        cause: the error the collective ended with ("" when the deadline ended it).
    """
    if cause:
        head = f"tfdp: {what} on worker {rank} of {num_workers} failed ({cause}). "
    else:
        head = (f"tfdp: {what} on worker {rank} of {num_workers} did not finish within "
                f"{seconds:g} s (DataParallelStrategy's timeout_seconds), so tfdp aborted its "
                "collectives. ")
    if missing:
        who = f"Worker(s) {', '.join(map(str, missing))} {named}"
    else:
        who = everyone if missing is not None else unknown
    return head + context + who + fix


_RAISE_FOR_A_STEP = "If a step legitimately takes this long, raise timeout_seconds."
_ONE_PROCESS_STALLED = ("One of this process's replicas never reached a collective the others "
                        "wait in (a collective under a condition some replicas skip). ")
_A_PEER_STALLED = ("Every peer is still alive (a dead or frozen one fails the step within about "
                   "10 s instead), so one is not taking part: it is stuck outside the step (a "
                   "callback, its input pipeline, a deadlock) or runs a different number of "
                   "steps. The worker logs show which one is behind. ")


def overdue_message(what: str, seconds: float, rank: int, num_workers: int,
                    missing=None) -> str:
    """The error of a step that ran past its deadline.

    Args:
        missing: the ranks that never started this step function (known at its first run;
            None: unknown).
    """
    # Each case carries its own fix: a late arrival and a long step ask for different words.
    still_alive = (_ONE_PROCESS_STALLED if num_workers == 1 else _A_PEER_STALLED) + \
        _RAISE_FOR_A_STEP
    return stall_message(
        what, seconds, rank, num_workers, missing, everyone=still_alive, unknown=still_alive,
        named=("never started it: every worker must run it (an `if is_chief` around "
               "model.evaluate, predict or fit, or a worker stuck before it, leaves the others "
               "waiting). If a worker legitimately arrives this much later, raise "
               "timeout_seconds."))


class Watchdog:
    """One thread that calls ``abort(message)`` when the innermost armed deadline passes.

    ``arm`` pushes a deadline (nested ones, e.g. an agreement inside a step, are a stack)
    and returns a token for ``disarm``; the thread sleeps until the innermost deadline and
    starts only at the first ``arm``.

    Args:
        abort: called once per overdue step, from the watchdog's thread, with the message
            (``arm``'s ``message``, called first if it is callable: formatted only when due).
        poll: None, or a function called every ``poll_seconds`` while a deadline is armed;
            a message it returns ends the innermost armed step at once, with that message
            (a peer that exited).
        poll_seconds: how often ``poll`` is called.
    """

    def __init__(self, abort, poll=None, poll_seconds: float = PEER_EXIT_POLL_SECONDS):
        self._abort = abort
        self._poll, self._poll_seconds = poll, poll_seconds
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
                # Polled at every wake, the arm of each step included: a step that starts
                # after its peer died ends before its collectives try the dead address (one
                # failed open() a step, in this thread).
                news = self._poll() if self._poll is not None else None
                if news is not None:
                    message = news
                elif left > 0:
                    self._cond.wait(left if self._poll is None
                                    else min(left, self._poll_seconds))
                    continue
                self._armed.pop()
            self._abort(message() if callable(message) else message)


def _abort_collectives(message):
    from tfdp import _tf_private

    _tf_private.abort_collective_ops(message)


def peer_exited_message(info: dict) -> str:
    """The error of a step ended because tfdp-run announced that a peer exited."""
    return (f"tfdp: worker {info.get('slot', '?')} (rank {info.get('rank', '?')}) exited with "
            f"code {info.get('exit', '?')}, so this worker's step cannot finish (its "
            "collectives wait for that worker): tfdp-run announced the exit and tfdp ended the "
            "step at once. tfdp-run restarts the job if --max-restarts allows; see that "
            "worker's output for why it exited.")


def _peer_exit_news(control_dir: str):
    """The message of tfdp-run's PEER_EXITED_FILE in ``control_dir``, or None."""
    try:
        with open(os.path.join(control_dir, PEER_EXITED_FILE)) as f:
            return peer_exited_message(json.load(f))
    except (OSError, ValueError, AttributeError):
        return None


def _make_watchdog(environ=os.environ) -> Watchdog:
    # Only a worker of tfdp-run has a control directory to look in; elsewhere nothing polls.
    control = environ.get(CONTROL_DIR_ENV, "").strip()
    return Watchdog(_abort_collectives,
                    poll=functools.partial(_peer_exit_news, control) if control else None)


_watchdog = _make_watchdog()


def strategy_key(strategy):
    """The id that names ``strategy`` in coordination-service keys, or None.

    Reads ``DataParallelStrategy.key_base``, the base of the strategy's collective-key range,
    drawn from one process-wide counter at construction: the same on every worker (each
    builds its strategies in one order) and different for each strategy of a process. Other
    strategies have none.
    """
    return getattr(strategy, "key_base", None)


class Arrivals:
    """Where the workers of ``strategy`` meet outside a step: this worker's arrival, posted in
    the coordination service, and the deadline around the meeting (module docstring).

    Args:
        strategy: the strategy whose workers meet (its ``cluster``; ``strategy_key``).
        kind, name: name the meeting in the service (``tfdp/{kind}/{strategy key}/{name}``).
        numbered: the meeting recurs; each ``arrive`` takes the next number under its key,
            the same on every worker since all meet in the same order.
        prune: with ``numbered``, an arrival drops this worker's arrival two meetings back
            (the service keeps what it is given; a peer at most one meeting behind still finds
            the one before). For meetings as frequent as the calls that make them.
    """

    # A posted key answers at once; a read with a 1 ms timeout failed for posted ones on a
    # loaded host (the chief named itself missing), so each missing one costs READ_SECONDS,
    # within READ_BUDGET_SECONDS in all (ranks not read by then are not named).
    READ_SECONDS = 1.0
    READ_BUDGET_SECONDS = 10.0

    def __init__(self, strategy, kind: str, name: str = "", numbered: bool = False,
                 prune: bool = False):
        self._cluster = strategy.cluster
        key = strategy_key(strategy)
        self._postable = self._cluster.is_multi_worker and key is not None
        self._base = f"tfdp/{kind}/{key}" + (f"/{name}" if name else "")
        self._numbered, self._prune = numbered, prune
        self.number = None  # set by arrive() when numbered
        self.key = None if numbered else self._base
        self._posted = False
        self._watched = None  # (seconds, describe) while watch() runs

    def can_post(self) -> bool:
        """Whether there is a coordination service to post arrivals in (several workers, a
        tfdp strategy)."""
        from tfdp import _tf_private

        return self._postable and _tf_private.coordination_service_configured()

    def arrive(self) -> None:
        """Takes this meeting's number (when numbered) and posts this worker's arrival where
        there is a coordination service to post it in."""
        from tfdp import _tf_private

        if self._numbered:
            self.number = _next_call_number(self._base)
            self.key = f"{self._base}/{self.number}"
        if not self.can_post():
            return
        rank = self._cluster.rank
        _tf_private.publish_to_coordination_service(f"{self.key}/{rank}", "1")
        self._posted = True
        if self._numbered and self._prune and self.number >= 2:
            _tf_private.delete_from_coordination_service(
                f"{self._base}/{self.number - 2}/{rank}")

    def missing(self):
        """The ranks whose arrival is not posted (None: this worker posted none, so unknown)."""
        if not self._posted:
            return None
        from tfdp import _tf_private

        missing, give_up = [], time.monotonic() + self.READ_BUDGET_SECONDS
        for rank in range(self._cluster.num_workers):
            left = give_up - time.monotonic()
            if left <= 0:
                break
            try:
                _tf_private.read_from_coordination_service(f"{self.key}/{rank}",
                                                           min(self.READ_SECONDS, left))
            except Exception:  # tf.errors.OpError: not there, or the service is gone
                missing.append(rank)
        return missing

    @contextlib.contextmanager
    def watch(self, seconds: float, describe):
        """Arms the deadline for the ``with`` body: when it passes, the watchdog aborts the
        collectives with ``message()``.

        Args:
            describe: ``describe(seconds, rank, num_workers, missing, **extra)`` is the error
                (one of this module's message functions, its first argument bound).
        """
        self._watched = (seconds, describe)
        token = _watchdog.arm(seconds, self.message)
        try:
            yield
        finally:
            _watchdog.disarm(token)

    def message(self, **extra) -> str:
        """The error of this meeting now, naming the workers that never arrived (called when
        it is due: reading the arrivals takes up to READ_BUDGET_SECONDS)."""
        seconds, describe = self._watched
        return describe(seconds, self._cluster.rank, self._cluster.num_workers, self.missing(),
                        **extra)


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
    meeting = Arrivals(strategy, "first-step", what, numbered=True)
    if first and meeting.can_post():
        # Later runs meet in the step's own collectives; only the first is worth a post (every
        # worker builds its step functions in one order, so the numbers agree). Alone, nothing
        # is posted and no number is taken (none would be read).
        meeting.arrive()
    with meeting.watch(seconds, functools.partial(overdue_message, what)):
        yield


# --- the initial-value broadcast of a variable (outside any step) ---------------------------

def broadcast_overdue_message(variable: str, seconds: float, rank: int, num_workers: int,
                              missing=None) -> str:
    """The error of an initial-value broadcast past its deadline.

    Args:
        missing: the ranks that never reached the strategy's first variable (None: unknown).
    """
    everyone = ("Every worker reached this strategy's first variable, so one creates a "
                "variable the others do not (an `if is_chief` / `if rank == 0` around creating a "
                "model, optimizer, metric or variable inside strategy.scope()) or is stuck "
                "between two variables. The worker logs show which one is behind. ")
    return stall_message(
        f"the initial-value broadcast of variable {variable!r}", seconds, rank, num_workers,
        missing, everyone=everyone, unknown=everyone,
        context=("Each variable created in strategy.scope() is a collective: the chief (worker "
                 "0) sends its initial value and every other worker receives it, so every "
                 "worker must create the same variables in the same order. "),
        named=("never reached this strategy's first variable: they are stuck before building "
               "the model (input preparation, a download, a blocking call) or skip it (an `if "
               "is_chief` / `if rank == 0` around building a model, optimizer or variable). "),
        fix=("Build the same model on every worker; if a worker legitimately reaches it this "
             "much later, raise timeout_seconds."))


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
    meeting = Arrivals(strategy, "first-variable")
    if first:
        meeting.arrive()
    with meeting.watch(seconds, functools.partial(broadcast_overdue_message, variable)):
        yield


# --- other collectives outside a step ------------------------------------------------------

def outside_step_message(what: str, seconds: float, rank: int, num_workers: int, missing,
                         fix: str, cause: str = "") -> str:
    """The error of a collective outside a step that did not finish.

    Args:
        missing: the ranks that never arrived at it (None: unknown).
        fix: what the user should do, for this kind of collective.
        cause: the error the collective ended with ("" when the deadline ended it).
    """
    return stall_message(
        what, seconds, rank, num_workers, missing, fix=fix, cause=cause,
        named="never arrived at it: every worker must make this call, in the same order. ",
        everyone="Every worker arrived at it; one is stuck or slower than the deadline. ",
        unknown="The worker logs show which one is behind. ")


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

    meeting = Arrivals(strategy, "outside", kind or what, numbered=True, prune=True)
    meeting.arrive()
    seconds = deadline_seconds(strategy.timeout_seconds,
                               meeting.number == 0 if first is None else first)
    with meeting.watch(seconds, functools.partial(outside_step_message, what, fix=fix)):
        try:
            yield
        except tf.errors.OpError as e:
            if "tfdp:" in (e.message or ""):
                raise  # the deadline's own message
            raise type(e)(e.node_def, e.op,
                          meeting.message(cause=f"{type(e).__name__}: {e.message}")) from e


def _stop_watching() -> None:
    _watchdog.close()
    with _outside_lock:
        _outside_counts.clear()


process_state.register("step-deadline watchdog", __name__,
                       lambda: (_watchdog.running(), len(_outside_counts)), _stop_watching)
