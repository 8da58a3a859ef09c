"""ZeRO-3's whole-tensor reads on several workers: led by the chief, served by the others.

Rule. Reading a sharded variable whole outside a step (``model.save``, ``get_weights``, a
checkpoint) gathers its slices from every worker: a collective every worker must run. The
chief (worker 0) leads each such read: it announces the read, numbered, in the coordination
service (``tfdp/whole-read/<n>`` = the variable), and enters the gather once every other
worker has acknowledged it (``tfdp/whole-read/<n>/ack/<rank>``). Another worker takes part in
read n in one of two ways:

* it makes the same call (every worker saves, as tfdp's callbacks do): its n-th read must be
  the variable the chief announced as n (else an error naming both); it acknowledges it and
  gathers;
* it waits where tfdp serves the chief's reads: at its exit (before the exit barrier,
  lifecycle.py), it acknowledges and gathers each read the chief announces, until the chief
  announces the end at its own exit.

So Horovod's idiom ``if rank == 0: model.save(path)`` works under ZeRO-3: the other workers,
done with their script, serve the chief's save from their exit. A worker that goes on to other
collective work (another ``fit``) cannot serve; it must make the call too.

Failure. A wait for the other side (the chief's for an acknowledgement, a worker's for an
announcement) checks every second that the other process is still there (its TensorFlow
server's port accepts connections): one that is gone ends the wait within seconds with an
error naming it; one that lives but neither makes the call nor waits where tfdp serves ends it
at the strategy's deadline (``timeout_seconds``, one deadline for all of them), naming every
such worker and the fix. No bound without ``timeout_seconds``, as for every collective. A read
the chief gives up is marked abandoned in its announcement: a worker still to take part skips
it (serving) or fails with the chief's reason (its own call), so the numbers stay in step.

Which variable. Each sharded variable of a multi-worker strategy is registered when it is
created (``register``) under ``<strategy key>:<number>``, its creation order within its
strategy: the same on every worker, since every worker builds the same variables in the same
order, and never reused within a process. A worker other than the chief keeps the variables of
the last multi-worker strategy that registered one until ``tfdp.reset()`` (the chief keeps
none: it never serves), so a model the script has let go of (returned from ``main()``) still
serves the chief's save at exit; an earlier strategy's are let go.

Read numbers are never reused in a process (``tfdp.reset()`` keeps them): the coordination
service keeps its keys for the life of the job.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from tfdp import process_state
from tfdp.strategy import deadline, lifecycle

__all__ = ["register", "take_part", "serve_until_the_chief_ends", "end_for_the_others",
           "clear", "registered", "take_number", "WholeReadError"]

log = logging.getLogger("tfdp")

_PREFIX = "tfdp/whole-read"
_END = "end"
_OK = "ok"
# How often a wait looks whether the other process is still there: a gone worker is named
# within about this long, well inside the coordination service's 10 s heartbeat timeout.
_LOOK_SECONDS = 1.0

_lock = threading.Lock()
_next = [0]          # this worker's next read number (never reset: see the docstring)
_counts = {}         # strategy key -> its variables registered so far (ids never reused)
_registry = {}       # read id -> zero-argument gather (no protocol); other workers only
_strategy_key = [None]  # the strategy whose variables this worker holds for serving
_ended = [False]     # the chief has announced the end
_ABANDONED = "abandoned"


class WholeReadError(RuntimeError):
    """A whole-tensor read on several workers that cannot happen (a peer gone, late, or
    reading something else); the message names the worker and the fix."""


def register(strategy, gather) -> str:
    """Registers a sharded variable of ``strategy`` (several workers) whose whole read is
    ``gather()`` (the collective, without this protocol); returns its read id."""
    key = strategy.key_base  # tfdp's own strategy: one id per strategy
    with _lock:
        number = _counts.get(key, 0)
        _counts[key] = number + 1
        read_id = f"{key}:{number}"
        if strategy.cluster.rank != 0:  # the chief leads and never serves: it keeps nothing
            if _strategy_key[0] != key:
                # A later strategy is the job's: its variables are the ones served; an earlier
                # one's are let go (its reads are answered "no longer holds").
                _registry.clear()
                _strategy_key[0] = key
            _registry[read_id] = gather
    lifecycle.before_leaving(_at_exit)
    return read_id


def registered() -> int:
    """How many sharded variables of multi-worker strategies this process has registered."""
    return sum(_counts.values())


def clear() -> None:
    """Forgets the registered variables (``tfdp.reset()``); the read numbers stay."""
    with _lock:
        _counts.clear()
        _registry.clear()
        _strategy_key[0] = None
        _ended[0] = False


def _key(number: int) -> str:
    return f"{_PREFIX}/{number}"


def take_number() -> int:
    """This worker's next read number, taken (every read, made or served, takes one, so the
    workers' numbers stay in step)."""
    with _lock:
        number = _next[0]
        _next[0] += 1
        return number


def _gone(cluster, rank: int) -> bool:
    """Whether worker ``rank``'s process is gone: nothing accepts connections at its address
    any more (a refused connection). A slow or unreachable host is not taken as gone."""
    try:
        socket.create_connection(lifecycle.worker_address(cluster, rank),
                                 timeout=_LOOK_SECONDS).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _wait_for(key: str, cluster, other: int, seconds):
    """The value posted under ``key``; ``("gone", None)`` when worker ``other``'s process is
    gone first, ``("late", None)`` after ``seconds`` (None: no bound), else ``("set", value)``."""
    from tfdp import _tf_private

    give_up = None if seconds is None else time.monotonic() + seconds
    while True:
        left = _LOOK_SECONDS if give_up is None else min(_LOOK_SECONDS, give_up - time.monotonic())
        if left <= 0:
            return "late", None
        try:
            return "set", _tf_private.read_from_coordination_service(key, left)
        except Exception:  # tf.errors.OpError: not set yet, or the service is gone
            pass
        if _gone(cluster, other):
            return "gone", None


def _bound(strategy):
    return deadline.deadline_seconds(getattr(strategy, "timeout_seconds", None), False)


def _abandon(number: int, reason: str) -> None:
    """The chief's read ``number`` failed: its announcement becomes ``abandoned`` so that a
    worker still to take part skips it instead of gathering alone (numbers stay in step)."""
    from tfdp import _tf_private

    _tf_private.delete_from_coordination_service(_key(number))
    try:
        _tf_private.publish_to_coordination_service(_key(number), f"{_ABANDONED} {reason}")
    except Exception:  # the service is gone: nobody is left to tell
        pass


def take_part(strategy, read_id: str, name: str, what: str, fix: str) -> None:
    """Before this worker's gather of ``read_id`` (see the module's rule): the chief announces
    it and waits until every other worker has acknowledged it; another worker checks it
    against the chief's announcement and acknowledges it.

    Raises:
        WholeReadError: a peer is gone, did not take part within the deadline, or reads
            another variable; the message names it, ``what`` is read and ``fix``.
    """
    from tfdp import _tf_private

    cluster = strategy.cluster
    if not cluster.is_multi_worker or not _tf_private.coordination_service_configured():
        return
    number = take_number()
    seconds = _bound(strategy)
    head = f"tfdp: {what} on worker {cluster.rank} of {cluster.num_workers}"
    if cluster.rank == 0:
        if _ended[0]:
            raise WholeReadError(f"{head}: the chief has already let the other workers go (its "
                                 "exit began), so nobody can take part. Read it before the end "
                                 "of the script.")
        _tf_private.publish_to_coordination_service(_key(number), f"read {read_id} {name}")
        try:
            _wait_for_every_acknowledgement(cluster, number, seconds, head, fix)
        except WholeReadError as e:
            _abandon(number, str(e).splitlines()[0][:300])
            raise
        for rank in range(1, cluster.num_workers):  # everyone has read the announcement
            _tf_private.delete_from_coordination_service(f"{_key(number)}/ack/{rank}")
        _tf_private.delete_from_coordination_service(_key(number))
        return
    state, value = _wait_for(_key(number), cluster, 0, seconds)
    if state == "gone":
        raise WholeReadError(f"{head} failed: the chief's process (worker 0) is gone, and it "
                             "holds slices of every sharded variable. Its log says why it ended.")
    if state == "set" and value.startswith(_ABANDONED):
        reason = value[len(_ABANDONED):].strip()
        raise WholeReadError(f"{head}: the chief abandoned this read ({reason}).")
    if state == "late" or value == _END:
        raise WholeReadError(
            f"{head}: the chief (worker 0) did not make this read within {seconds:g} s"
            f"{' (it has finished its script)' if value == _END else ''}. Only reads the "
            "chief makes can be served: make this call on the chief as well (on every "
            f"worker, in the same order). {fix}")
    chief_id, chief_name = _parse(value)
    if chief_id != read_id:
        _tf_private.publish_to_coordination_service(
            f"{_key(number)}/ack/{cluster.rank}",
            f"reads {name!r} whole at this point, not {chief_name!r}.")
        raise WholeReadError(
            f"{head}: the chief reads {chief_name!r} whole at this point (its read {number}), "
            f"this worker {name!r}. Every worker must read the same sharded variables whole "
            "in the same order (the same saves, get_weights and checkpoints), or only the "
            "chief reads them and the others finish their script (they serve its reads from "
            "their exit).")
    _tf_private.publish_to_coordination_service(f"{_key(number)}/ack/{cluster.rank}", _OK)


def _wait_for_every_acknowledgement(cluster, number, seconds, head, fix) -> None:
    """Returns once every other worker has acknowledged read ``number``; one deadline for
    all of them (``seconds``; None: none). Raises WholeReadError naming every worker gone,
    late, or answering otherwise."""
    give_up = None if seconds is None else time.monotonic() + seconds
    gone, late = [], []
    for rank in range(1, cluster.num_workers):
        left = None if give_up is None else max(_LOOK_SECONDS, give_up - time.monotonic())
        state, value = _wait_for(f"{_key(number)}/ack/{rank}", cluster, rank, left)
        if state == "gone":
            gone.append(rank)
        elif state == "late":
            late.append(rank)
        elif value != _OK:
            raise WholeReadError(f"{head} failed: worker {rank} {value}")
    if gone:
        who = ", ".join(f"worker {r} ({cluster.workers[r]})" for r in gone)
        raise WholeReadError(
            f"{head} failed: the process of {who} is gone (nothing listens at its address any "
            "more), and every worker holds slices of every sharded variable, so none can be "
            "read whole any more. Its own log says why it ended (tfdp-run names it); the job's "
            "last backup (tfdp.callbacks.BackupAndRestore) holds whole tensors.")
    if late:
        ranks = ", ".join(map(str, late))
        raise WholeReadError(
            f"{head} did not start within {seconds:g} s (DataParallelStrategy's "
            f"timeout_seconds): worker(s) {ranks} took no part. Worker(s) {ranks} never "
            "arrived at it: every other worker must make this call too, in the same order, or "
            "have finished its script (at its exit a worker serves the chief's reads, unless "
            "TFDP_ORDERLY_EXIT=0; a worker busy elsewhere, in another fit or evaluate, or on a "
            f"host that no longer answers, cannot). {fix}")


def _parse(announcement: str):
    _, read_id, name = announcement.split(" ", 2)
    return read_id, name


def serve_until_the_chief_ends(cluster, timeout_seconds) -> int:
    """On a worker other than the chief: takes part in each read the chief announces, until
    the chief announces the end (or its process is gone, or none comes within
    ``timeout_seconds``); returns how many it served. Nothing on the chief or without
    registered variables."""
    from tfdp import _tf_private

    if cluster.rank == 0 or not _registry or not _tf_private.coordination_service_configured():
        return 0
    served = 0
    while True:
        with _lock:
            number = _next[0]
        state, value = _wait_for(_key(number), cluster, 0, timeout_seconds)
        if state == "gone":
            log.info("tfdp: the chief's process ended before it let this worker go; "
                     "%d of its whole-tensor reads served.", served)
            return served
        if state == "late":
            log.warning("tfdp: waited %.0f s at exit for the chief's next whole-tensor read or "
                        "its end; leaving (%d served).", timeout_seconds, served)
            return served
        take_number()
        if value == _END:
            return served
        if value.startswith(_ABANDONED):
            continue
        read_id, name = _parse(value)
        gather = _registry.get(read_id)
        ack = f"{_key(number)}/ack/{cluster.rank}"
        if gather is None:
            _tf_private.publish_to_coordination_service(
                ack, f"no longer holds {name!r} (a variable of an earlier strategy): it cannot "
                "serve this read. Read it on every worker instead.")
            continue
        _tf_private.publish_to_coordination_service(ack, _OK)
        gather()
        served += 1


def end_for_the_others(cluster) -> None:
    """On the chief, at its exit: tells the workers serving its reads that none will come."""
    from tfdp import _tf_private

    if cluster.rank != 0 or not _counts or not _tf_private.coordination_service_configured():
        return
    with _lock:
        if _ended[0]:
            return
        _ended[0] = True
    _tf_private.publish_to_coordination_service(_key(take_number()), _END)


def _at_exit(cluster, timeout_seconds) -> None:
    """lifecycle's hook before the exit barrier (orderly exits only)."""
    if cluster.rank == 0:
        end_for_the_others(cluster)
    else:
        serve_until_the_chief_ends(cluster, timeout_seconds)


process_state.register("ZeRO-3 whole reads", __name__, registered, clear)
