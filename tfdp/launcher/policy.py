"""tfdp-run's restart and membership policy: pure functions over what an attempt ended with.

No processes, no clock, no TensorFlow: ``tfdp.launcher.cli`` observes the workers and turns what it saw
into an :class:`AttemptEnd`; :func:`decide` says whether the job finishes (and with which exit
code) or restarts (and on which slots), with the lines to log. Tests drive it with event
sequences.

Words. A *slot* is a worker position that keeps its identity across restarts (slot ``s`` is
"worker s" in every log line). An *attempt* is one launch of all current slots; attempt 0 is
the first launch, attempt ``k`` follows the k-th restart. In every attempt the current slots
get ranks ``0..W-1`` in slot order, so rank 0 (the chief) is always the lowest remaining slot.

Restart rule (torchrun's ``--max-restarts``). An attempt that ends with a worker failure, that
is, the first worker observed to exit non-zero (an error code, a signal, 143 = preempted,
75 = restart requested) or a worker that never joined the cluster within ``--start-timeout``,
restarts *all* workers while fewer than ``max_restarts`` restarts have been made; every restart,
with or without a membership change, uses one. With none left the job exits with the failing
code (125 for a worker that never joined). An attempt where every worker exits 0 ends the job
with 0. The launcher's own SIGTERM (exit 143) or SIGINT (exit 130), and ``--timeout`` (exit
124), end the job without a restart.

Membership rule (torchrun's ``--nnodes=MIN:MAX``, restart-based). Only when ``min_workers`` is
below the launch size (elastic job) is a slot ever dropped, in two cases:

* it *cannot come back*: in a restarted attempt (attempt >= 1) it is the failing worker and
  the attempt had not completed its first training step (no worker wrote its progress file,
  :func:`tfdp.cluster.progress_file`) -- it failed again before the restarted job got going;
* it is *evicted*: the workers exited with ``EXIT_RESTART_REQUESTED`` (75) and the chief
  named its rank in ``evict.json``;
* its host *cannot come back*: in a restarted attempt, ssh could not reach the host
  (:class:`HostUnreachable`); every slot on that host is dropped together.

A drop happens together with a restart and only while at least ``min_workers`` slots remain
afterwards. A slot that cannot come back when dropping it would leave fewer than
``min_workers`` ends the job with its code (restarting the same membership would fail the same
way). An eviction that is not allowed (below ``min_workers`` or no restarts left: the workers
should not have asked) is handled as a plain failure with code 75: a restart on the same slots
while restarts are left, else exit 75; the log says why. Without elasticity
(``min_workers == num_workers``, the default) no slot is judged: every failure is a plain
restart while restarts are left.

Exit codes of the job: 0 every worker of an attempt finished with 0; the failing worker's code
(128 + N for signal N) when restarts are exhausted or not allowed; 124 ``--timeout``; 125 a
worker never joined and no restart was left; 130 Ctrl-C (SIGINT) to the launcher; 143 SIGTERM
to the launcher (workers back up and stop, no restart); 75 an eviction that could not be
granted with no restart left; 255 a host that could not be reached (ssh's code), with no
restart left or below ``min_workers`` (the names are in :mod:`tfdp.protocol`).
"""

from __future__ import annotations

import dataclasses
import json
import signal
from typing import Optional, Sequence, Union

from tfdp.protocol import (EXIT_HOST_UNREACHABLE, EXIT_INTERRUPTED, EXIT_NEVER_JOINED,
                           EXIT_RESTART_REQUESTED, EXIT_TERMINATED, EXIT_TIMEOUT,
                           describe_exit, exit_code_of)

__all__ = ["EXIT_TIMEOUT", "EXIT_NEVER_JOINED", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "Policy", "JobState", "Completed", "WorkerExited", "NeverJoined", "EvictionRequested",
           "Interrupted", "TimedOut", "HostUnreachable", "Decision", "decide", "describe_exit", "exit_code_of",
           "parse_eviction", "Eviction", "AttemptEnd", "run_policy"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """The launcher's restart and membership limits.

    Args:
        num_workers: slots at launch (``--workers``).
        max_restarts: restarts allowed over the whole job (``--max-restarts``); 0 = none.
        min_workers: fewest slots the job may continue on (``--min-workers``); ``None`` means
            ``num_workers`` (no elasticity).
    """

    num_workers: int
    max_restarts: int = 0
    min_workers: Optional[int] = None

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers}: need at least 1 worker")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts}: must be 0 or more")
        if self.min_workers is None:
            object.__setattr__(self, "min_workers", self.num_workers)
        if not 1 <= self.min_workers <= self.num_workers:
            raise ValueError(
                f"min_workers={self.min_workers}: must be between 1 and num_workers="
                f"{self.num_workers}; lower it to at most --workers (or raise --workers)")

    @property
    def elastic(self) -> bool:
        """Slots may be dropped: the job may continue on fewer workers than it started with."""
        return self.min_workers < self.num_workers

    def initial_state(self) -> "JobState":
        return JobState(slots=tuple(range(self.num_workers)), attempt=0)

    def get_config(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class JobState:
    """Where the job is: the slots of the current attempt (ascending) and its number.

    ``attempt`` is also the number of restarts made so far.
    """

    slots: tuple
    attempt: int = 0

    @property
    def num_workers(self) -> int:
        return len(self.slots)

    def slot_of(self, rank: int) -> int:
        return self.slots[rank]

    def restarts_left(self, policy: Policy) -> int:
        return policy.max_restarts - self.attempt


# --- how an attempt ended (what the launcher observed) ------------------------------------

@dataclasses.dataclass(frozen=True)
class Completed:
    """Every worker of the attempt exited 0."""


@dataclasses.dataclass(frozen=True)
class WorkerExited:
    """The first worker observed to exit non-zero.

    Args:
        rank: its rank in this attempt.
        code: its exit code (128 + N if killed by signal N).
        progressed: some worker of this attempt had completed a training step (a progress
            file existed) when the failure was observed.
    """

    rank: int
    code: int
    progressed: bool = False


@dataclasses.dataclass(frozen=True)
class NeverJoined:
    """``--start-timeout`` passed and this worker had not joined the cluster (the first absent)."""

    rank: int
    start_timeout: float


@dataclasses.dataclass(frozen=True)
class Eviction:
    """The contents of ``evict.json``: the rank (this attempt's numbering) to drop, and why."""

    rank: int
    reason: str


@dataclasses.dataclass(frozen=True)
class EvictionRequested:
    """Workers exited with ``EXIT_RESTART_REQUESTED`` and ``evict.json`` named a valid rank."""

    exited_rank: int  # the first worker observed to exit (with code 75)
    eviction: Eviction  # what evict.json asked for
    # The code the workers exited with: 75, or TFDP_EVICT_EXIT_CODE
    # (tfdp.protocol.restart_requested_exit_code); the job's code if it ends.
    code: int = EXIT_RESTART_REQUESTED


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """The launcher itself received SIGTERM or SIGINT."""

    signum: int


@dataclasses.dataclass(frozen=True)
class TimedOut:
    """``--timeout`` passed (it bounds the whole job, across restarts)."""

    timeout: float


@dataclasses.dataclass(frozen=True)
class HostUnreachable:
    """ssh could not reach a host: none of its workers started (or its connection was lost).

    Args:
        host: the host's name.
        ranks: this attempt's ranks placed on that host, ascending.
        code: the exit code the job ends with if it ends now (ssh's 255).
    """

    host: str
    ranks: tuple
    code: int = EXIT_HOST_UNREACHABLE


AttemptEnd = Union[Completed, WorkerExited, NeverJoined, EvictionRequested, Interrupted,
                   TimedOut, HostUnreachable]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the launcher does next.

    Attributes:
        exit_code: the job's exit code, or ``None`` to restart.
        next_state: the state of the next attempt (``None`` when finishing).
        dropped_slot: the slot removed for the next attempt, if any (the first of
            ``dropped_slots``).
        dropped_slots: every slot removed for the next attempt (several: a lost host's).
        messages: lines to log (without the ``[tfdp-run]`` prefix), in order.
    """

    exit_code: Optional[int]
    next_state: Optional[JobState] = None
    dropped_slot: Optional[int] = None
    messages: tuple = ()
    dropped_slots: tuple = ()

    @property
    def restart(self) -> bool:
        return self.exit_code is None


def parse_eviction(text: str, num_workers: int) -> Union[Eviction, str]:
    """``evict.json``'s text -> :class:`Eviction`, or a string saying what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as e:
        return f"evict.json is not valid JSON ({e})"
    if not isinstance(data, dict):
        return "evict.json must be an object like {\"rank\": 2, \"reason\": \"...\"}"
    rank = data.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int):
        return f"evict.json rank={rank!r} is not an integer"
    if not 0 <= rank < num_workers:
        return f"evict.json rank={rank} is not a rank of this attempt (0..{num_workers - 1})"
    reason = data.get("reason") or "no reason given"
    return Eviction(rank=rank, reason=str(reason))


def _worker(state: JobState, rank: int) -> str:
    slot = state.slot_of(rank)
    return f"worker {slot}" if slot == rank else f"worker {slot} (rank {rank})"


def _finish(code: int, *messages: str) -> Decision:
    return Decision(exit_code=code, messages=tuple(messages))


def _restart(policy: Policy, state: JobState, cause: str, drop_ranks: Sequence[int] = (),
             drop_reason: str = "") -> Decision:
    attempt = state.attempt + 1
    messages = [f"restart {attempt}/{policy.max_restarts}: {cause}"]
    dropped = tuple(state.slot_of(r) for r in drop_ranks)
    slots = tuple(s for s in state.slots if s not in dropped)
    if dropped:
        who = f"worker {dropped[0]}" if len(dropped) == 1 else f"workers {list(dropped)}"
        messages.append(f"{who} dropped: {drop_reason}; continuing on {len(slots)} workers")
    return Decision(exit_code=None, next_state=JobState(slots=slots, attempt=attempt),
                    dropped_slot=dropped[0] if dropped else None, dropped_slots=dropped,
                    messages=tuple(messages))


def decide(policy: Policy, state: JobState, end: AttemptEnd) -> Decision:
    """The restart and membership rules (module docstring) applied to one attempt's end."""
    if isinstance(end, Completed):
        return _finish(0)
    if isinstance(end, Interrupted):
        name = signal.Signals(end.signum).name
        code = EXIT_TERMINATED if end.signum == signal.SIGTERM else 128 + end.signum
        return _finish(code, f"stopped by {name}: no restart")
    if isinstance(end, TimedOut):
        return _finish(EXIT_TIMEOUT)

    left = state.restarts_left(policy)
    n = state.num_workers
    below_min = n - 1 < policy.min_workers

    if isinstance(end, EvictionRequested):
        rank, reason = end.eviction.rank, end.eviction.reason
        cause = f"{_worker(state, rank)} evicted: {reason}"
        if below_min:  # also covers a non-elastic job, where no slot may ever be dropped
            refusal = (f"cannot evict {_worker(state, rank)}: {n - 1} worker(s) would remain, "
                       f"below --min-workers {policy.min_workers}")
        elif left <= 0:
            refusal = (f"cannot evict {_worker(state, rank)}: no restarts left "
                       f"(--max-restarts {policy.max_restarts})")
        else:
            return _restart(policy, state, cause, drop_ranks=(rank,),
                            drop_reason=f"evicted by the job: {reason}")
        plain = (f"{_worker(state, end.exited_rank)} exited with "
                 f"{describe_exit(end.code)}")
        if left > 0:
            restart = _restart(policy, state, plain)
            return dataclasses.replace(
                restart, messages=(f"{refusal}; restarting on the same {n} workers",)
                + restart.messages)
        return _finish(end.code, f"{refusal}; stopping the job")

    if isinstance(end, HostUnreachable):
        return _decide_host(policy, state, end)
    if isinstance(end, WorkerExited):
        rank, code = end.rank, end.code
        cause = f"{_worker(state, rank)} exited with {describe_exit(code)}"
        cannot_come_back = state.attempt >= 1 and not end.progressed
        why = (f"it exited with {describe_exit(code)} before restart {state.attempt} "
               "completed its first step")
    elif isinstance(end, NeverJoined):
        rank, code = end.rank, EXIT_NEVER_JOINED
        cause = (f"{_worker(state, rank)} did not join the cluster within "
                 f"{end.start_timeout:g} s")
        cannot_come_back = state.attempt >= 1
        why = (f"it did not join the cluster within {end.start_timeout:g} s of restart "
               f"{state.attempt}")
    else:
        raise TypeError(f"unknown attempt end {end!r}")

    if left <= 0:
        if policy.max_restarts == 0:
            return _finish(code)  # today's behaviour: the failure itself was already logged
        return _finish(code, f"restarts exhausted ({policy.max_restarts}/"
                             f"{policy.max_restarts}): {cause}")
    if policy.elastic and cannot_come_back:
        if below_min:
            return _finish(code, f"{_worker(state, rank)} cannot come back ({why}) and dropping "
                                 f"it would leave {n - 1} worker(s), below --min-workers "
                                 f"{policy.min_workers}; stopping the job")
        return _restart(policy, state, cause, drop_ranks=(rank,), drop_reason=why)
    return _restart(policy, state, cause)


def _decide_host(policy: Policy, state: JobState, end: HostUnreachable) -> Decision:
    """Like a worker that cannot come back, for every slot on the host at once."""
    slots = [state.slot_of(r) for r in end.ranks]
    cause = f"cannot reach host {end.host} (worker(s) {slots})"
    n, left = state.num_workers, state.restarts_left(policy)
    if left <= 0:
        if policy.max_restarts == 0:
            return _finish(end.code)  # the failure itself was already logged
        return _finish(end.code, f"restarts exhausted ({policy.max_restarts}/"
                                 f"{policy.max_restarts}): {cause}")
    if policy.elastic and state.attempt >= 1:
        why = f"host {end.host} could not be reached again after restart {state.attempt}"
        if n - len(slots) < policy.min_workers:
            return _finish(end.code, f"{why}, and dropping its worker(s) {slots} would leave "
                                     f"{n - len(slots)} worker(s), below --min-workers "
                                     f"{policy.min_workers}; stopping the job")
        return _restart(policy, state, cause, drop_ranks=end.ranks, drop_reason=why)
    return _restart(policy, state, cause)


def run_policy(policy: Policy, ends: Sequence[AttemptEnd]) -> list:
    """Feeds attempt ends in order; returns the decisions up to (and including) the final one.

    The ranks in each end refer to the attempt it ends. Handy for tests and for reasoning about
    a whole job as an event sequence.
    """
    state = policy.initial_state()
    decisions = []
    for end in ends:
        decision = decide(policy, state, end)
        decisions.append(decision)
        if not decision.restart:
            break
        state = decision.next_state
    return decisions
