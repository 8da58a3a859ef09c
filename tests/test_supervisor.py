"""tfdp.launcher.policy: the restart and membership policy over event sequences (no processes)."""

import signal

import pytest
from hypothesis import given, settings, strategies as st

from tfdp.launcher import policy as sv
from tfdp.launcher.policy import (Completed, Decision, EvictionRequested, Eviction, HostUnreachable,
                             Interrupted, JobState, NeverJoined, Policy, TimedOut, WorkerExited,
                             decide, run_policy)


def messages(decisions):
    return [m for d in decisions for m in d.messages]


def test_describe_exit_names_signals_preemption_and_restart_requests():
    assert sv.describe_exit(137) == "137 (SIGKILL)"
    assert sv.describe_exit(143) == "143 (SIGTERM, preempted)"
    assert sv.describe_exit(134) == "134 (SIGABRT)"
    assert sv.describe_exit(75) == "75 (restart requested)"
    assert sv.describe_exit(3) == "3"
    assert sv.describe_exit(255) == "255"  # 128 + 127 is no signal
    assert sv.exit_code_of(-9) == 137 and sv.exit_code_of(3) == 3 and sv.exit_code_of(0) == 0


def test_policy_defaults_and_validation():
    p = Policy(3, max_restarts=2)
    assert p.min_workers == 3 and not p.elastic
    assert Policy(3, 2, 2).elastic
    assert Policy(**Policy(3, 2, 2).get_config()) == Policy(3, 2, 2)
    for bad in (dict(num_workers=3, min_workers=4), dict(num_workers=3, min_workers=0),
                dict(num_workers=0), dict(num_workers=2, max_restarts=-1)):
        with pytest.raises(ValueError):
            Policy(**bad)


def test_crash_then_recover():
    decisions = run_policy(Policy(2, max_restarts=2),
                           [WorkerExited(1, 137, progressed=True), Completed()])
    assert [d.exit_code for d in decisions] == [None, 0]
    assert decisions[0].messages == ("restart 1/2: worker 1 exited with 137 (SIGKILL)",)
    assert decisions[0].next_state == JobState(slots=(0, 1), attempt=1)


def test_no_restarts_is_todays_behaviour():
    decisions = run_policy(Policy(2), [WorkerExited(1, 3, progressed=True)])
    assert [d.exit_code for d in decisions] == [3] and messages(decisions) == []
    assert run_policy(Policy(2), [NeverJoined(1, 20.0)])[0].exit_code == sv.EXIT_NEVER_JOINED
    assert run_policy(Policy(2), [Completed()])[0].exit_code == 0


def test_restarts_exhausted_exit_with_the_failing_code():
    decisions = run_policy(Policy(2, max_restarts=2),
                           [WorkerExited(1, 137, True), WorkerExited(0, 1, True),
                            WorkerExited(1, 7, True), Completed()])
    assert [d.exit_code for d in decisions] == [None, None, 7]  # the Completed is never reached
    assert messages(decisions) == [
        "restart 1/2: worker 1 exited with 137 (SIGKILL)",
        "restart 2/2: worker 0 exited with 1",
        "restarts exhausted (2/2): worker 1 exited with 7"]


def test_preempted_worker_is_restarted_but_launcher_sigterm_is_not():
    d = run_policy(Policy(2, max_restarts=1), [WorkerExited(0, 143, True), Completed()])
    assert [x.exit_code for x in d] == [None, 0]
    assert d[0].messages == ("restart 1/1: worker 0 exited with 143 (SIGTERM, preempted)",)
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        d = run_policy(Policy(2, max_restarts=5), [Interrupted(signum), Completed()])
        assert [x.exit_code for x in d] == [code], signum
    d = run_policy(Policy(2, max_restarts=5), [WorkerExited(1, 137, True), TimedOut(10.0)])
    assert [x.exit_code for x in d] == [None, sv.EXIT_TIMEOUT]


def test_slot_failing_at_every_start_is_dropped_while_at_least_min_remain():
    policy = Policy(3, max_restarts=3, min_workers=2)
    decisions = run_policy(policy, [
        WorkerExited(2, 137, progressed=True),   # crashed mid-epoch: plain restart
        WorkerExited(2, 1, progressed=False),    # fails again before the first step: dropped
        Completed()])
    assert [d.exit_code for d in decisions] == [None, None, 0]
    assert decisions[0].dropped_slot is None and decisions[0].next_state.slots == (0, 1, 2)
    assert decisions[1].dropped_slot == 2 and decisions[1].next_state == JobState((0, 1), 2)
    assert decisions[1].messages == (
        "restart 2/3: worker 2 exited with 1",
        "worker 2 dropped: it exited with 1 before restart 1 completed its first step; "
        "continuing on 2 workers")


def test_dropping_the_chief_slot_renumbers_ranks():
    policy = Policy(3, max_restarts=3, min_workers=2)
    decisions = run_policy(policy, [WorkerExited(0, 137, True), WorkerExited(0, 1, False),
                                    WorkerExited(0, 9, True)])
    state = decisions[1].next_state
    assert state.slots == (1, 2) and state.slot_of(0) == 1  # rank 0 (chief) = lowest slot left
    # Rank 0 of attempt 2 is slot 1: the log names the slot and, as it differs, the rank.
    assert decisions[2].messages == ("restart 3/3: worker 1 (rank 0) exited with 9",)


def test_slot_is_not_dropped_below_min_workers():
    policy = Policy(3, max_restarts=5, min_workers=2)
    decisions = run_policy(policy, [WorkerExited(2, 137, True), WorkerExited(2, 1, False),
                                    WorkerExited(1, 4, False), Completed()])
    assert [d.exit_code for d in decisions] == [None, None, 4]
    assert decisions[2].messages == (
        "worker 1 cannot come back (it exited with 4 before restart 2 completed its first step) "
        "and dropping it would leave 1 worker(s), below --min-workers 2; stopping the job",)


def test_without_elasticity_no_slot_is_judged():
    # min_workers == workers: the same early failure is a plain restart until restarts run out.
    decisions = run_policy(Policy(3, max_restarts=2),
                           [WorkerExited(2, 137, True), WorkerExited(2, 1, False),
                            WorkerExited(2, 1, False)])
    assert [d.dropped_slot for d in decisions] == [None, None, None]
    assert decisions[-1].exit_code == 1


def test_failures_after_progress_or_on_the_first_launch_do_not_drop():
    policy = Policy(3, max_restarts=3, min_workers=1)
    d = run_policy(policy, [WorkerExited(1, 1, progressed=False)])  # attempt 0: a first launch
    assert d[0].dropped_slot is None
    d = run_policy(policy, [WorkerExited(1, 137, True), WorkerExited(1, 137, progressed=True)])
    assert d[1].dropped_slot is None  # the restarted job had got going: the slot came back


def test_never_joined_restarts_then_drops_then_gives_125():
    policy = Policy(3, max_restarts=3, min_workers=2)
    d = run_policy(policy, [NeverJoined(1, 5.0), NeverJoined(1, 5.0), Completed()])
    assert d[0].messages == ("restart 1/3: worker 1 did not join the cluster within 5 s",)
    assert d[1].dropped_slot == 1 and d[1].next_state.slots == (0, 2)
    assert d[1].messages[1] == ("worker 1 dropped: it did not join the cluster within 5 s of "
                                "restart 1; continuing on 2 workers")
    d = run_policy(Policy(2, max_restarts=1), [NeverJoined(1, 5.0), NeverJoined(0, 5.0)])
    assert d[-1].exit_code == sv.EXIT_NEVER_JOINED
    assert d[-1].messages == ("restarts exhausted (1/1): worker 0 did not join the cluster "
                              "within 5 s",)


def test_unreachable_host_restarts_then_drops_all_its_slots():
    # Hosts a (slots 0, 1) and b (slots 2, 3); b cannot be reached at launch and again after
    # the restart: its two slots go together, and the job continues on a's.
    policy = Policy(4, max_restarts=3, min_workers=2)
    d = run_policy(policy, [HostUnreachable("b", (2, 3)), HostUnreachable("b", (2, 3)),
                            Completed()])
    assert d[0].messages == ("restart 1/3: cannot reach host b (worker(s) [2, 3])",)
    assert d[0].dropped_slots == () and d[0].next_state.slots == (0, 1, 2, 3)
    assert d[1].dropped_slots == (2, 3) and d[1].dropped_slot == 2
    assert d[1].next_state == JobState((0, 1), 2)
    assert d[1].messages[1] == ("workers [2, 3] dropped: host b could not be reached again "
                                "after restart 1; continuing on 2 workers")
    assert d[2].exit_code == 0


def test_unreachable_host_ends_the_job_with_255_when_it_may_not_be_dropped():
    d = run_policy(Policy(4, max_restarts=3, min_workers=3),
                   [HostUnreachable("b", (2, 3)), HostUnreachable("b", (2, 3))])
    assert d[-1].exit_code == 255 and d[-1].messages == (
        "host b could not be reached again after restart 1, and dropping its worker(s) [2, 3] "
        "would leave 2 worker(s), below --min-workers 3; stopping the job",)
    # Not elastic, no restarts: the launcher already said which host; the job ends with 255.
    assert decide(Policy(2), JobState((0, 1)), HostUnreachable("b", (1,))) == Decision(255)
    # After a drop, ranks are renumbered: the slots named are the host's.
    state = JobState((1, 2, 3), 1)
    assert decide(Policy(4, 3, 1), state, HostUnreachable("c", (1, 2))).dropped_slots == (2, 3)


def test_eviction_request_drops_the_named_rank_and_uses_a_restart():
    policy = Policy(3, max_restarts=1, min_workers=2)
    evict = EvictionRequested(exited_rank=0, eviction=Eviction(rank=1, reason="slow"))
    d = run_policy(policy, [evict, Completed()])
    assert [x.exit_code for x in d] == [None, 0]
    assert d[0].dropped_slot == 1 and d[0].next_state == JobState((0, 2), 1)
    assert d[0].messages == ("restart 1/1: worker 1 evicted: slow",
                             "worker 1 dropped: evicted by the job: slow; continuing on 2 workers")
    # The restart is used: the next failure ends the job.
    d = run_policy(policy, [evict, WorkerExited(1, 137, True)])
    assert d[-1].exit_code == 137


def test_eviction_names_a_rank_of_the_current_numbering():
    policy = Policy(4, max_restarts=3, min_workers=2)
    d = run_policy(policy, [WorkerExited(0, 137, True), WorkerExited(0, 1, False),
                            EvictionRequested(0, Eviction(rank=1, reason="slow")), Completed()])
    assert d[1].next_state.slots == (1, 2, 3)
    assert d[2].dropped_slot == 2 and d[2].next_state.slots == (1, 3)


def test_eviction_that_cannot_be_granted_is_a_plain_failure():
    evict = EvictionRequested(exited_rank=1, eviction=Eviction(rank=1, reason="slow"))
    # Below --min-workers, restarts left: restart on the same workers, saying why.
    d = run_policy(Policy(2, max_restarts=1), [evict, Completed()])
    assert [x.exit_code for x in d] == [None, 0] and d[0].dropped_slot is None
    assert d[0].next_state == JobState((0, 1), 1)
    assert d[0].messages == (
        "cannot evict worker 1: 1 worker(s) would remain, below --min-workers 2; restarting on "
        "the same 2 workers",
        "restart 1/1: worker 1 exited with 75 (restart requested)")
    # No restarts left: the job ends with 75.
    d = run_policy(Policy(3, max_restarts=1, min_workers=2),
                   [WorkerExited(0, 137, True), evict])
    assert d[-1].exit_code == 75
    assert d[-1].messages == ("cannot evict worker 1: no restarts left (--max-restarts 1); "
                              "stopping the job",)


def test_parse_eviction():
    assert sv.parse_eviction('{"rank": 2, "reason": "slow"}', 3) == Eviction(2, "slow")
    assert sv.parse_eviction('{"rank": 2}', 3) == Eviction(2, "no reason given")
    for text, problem in (("{", "not valid JSON"), ("[2]", "must be an object"),
                          ('{"rank": true}', "not an integer"), ('{"rank": "1"}', "not an integer"),
                          ('{"rank": 3}', "not a rank of this attempt (0..2)")):
        result = sv.parse_eviction(text, 3)
        assert isinstance(result, str) and problem in result, (text, result)


_END = st.one_of(
    st.builds(Completed),
    st.builds(WorkerExited, rank=st.integers(0, 5), code=st.sampled_from([1, 3, 137, 143, 75]),
              progressed=st.booleans()),
    st.builds(NeverJoined, rank=st.integers(0, 5), start_timeout=st.just(5.0)),
    st.builds(EvictionRequested, exited_rank=st.integers(0, 5),
              eviction=st.builds(Eviction, rank=st.integers(0, 5), reason=st.just("slow"))))


@settings(max_examples=300, deadline=None)
@given(workers=st.integers(1, 6), restarts=st.integers(0, 6), min_frac=st.floats(0, 1),
       ends=st.lists(_END, min_size=1, max_size=12))
def test_invariants_over_random_event_sequences(workers, restarts, min_frac, ends):
    policy = Policy(workers, restarts, max(1, round(min_frac * workers)))
    state = policy.initial_state()
    restarts_made = 0
    for end in ends:
        if hasattr(end, "rank") and end.rank >= state.num_workers:
            continue  # ranks are of the current attempt
        if isinstance(end, EvictionRequested) and (end.exited_rank >= state.num_workers
                                                   or end.eviction.rank >= state.num_workers):
            continue
        decision = decide(policy, state, end)
        if not decision.restart:
            assert decision.exit_code is not None
            if isinstance(end, Completed):
                assert decision.exit_code == 0
            else:
                assert decision.exit_code != 0
            return
        restarts_made += 1
        new = decision.next_state
        assert restarts_made <= restarts and new.attempt == restarts_made
        assert list(new.slots) == sorted(set(new.slots)) and set(new.slots) <= set(state.slots)
        assert len(new.slots) >= policy.min_workers
        assert len(state.slots) - len(new.slots) == (decision.dropped_slot is not None)
        if decision.dropped_slot is not None:
            assert policy.elastic and decision.dropped_slot in state.slots
        state = new
