"""tfdp.strategy.deadline's one arrivals helper and one message builder (issue 60, item 3).

Every place the workers meet outside a step goes through ``Arrivals`` and words its error with
``stall_message``. Here the coordination service is a dict and the workers are one process,
so each piece is checked without launching workers; the real two-worker cases are in
tests/test_outside_step.py (calls outside a step), tests/test_rebuild.py (the initial-value
broadcast) and tests/test_multiworker.py (steps).
"""

import functools
import queue

import pytest
import tensorflow as tf

import tfdp
from tfdp import _tf_private
from tfdp.strategy import deadline
from helpers import cpu_devices


class FakeCluster:
    def __init__(self, rank=0, num_workers=3):
        self.rank, self.num_workers = rank, num_workers
        self.is_multi_worker = num_workers > 1


class FakeStrategy:
    def __init__(self, rank=0, num_workers=3, key=7_000_000, timeout_seconds=2.0):
        self.cluster = FakeCluster(rank, num_workers)
        self.timeout_seconds = timeout_seconds
        if key is not None:
            self.key_base = key


class FakeService:
    """The coordination service's key-value store, as deadline.py reaches it."""

    def __init__(self, monkeypatch, configured=True):
        self.keys, self.reads = {}, []
        monkeypatch.setattr(_tf_private, "coordination_service_configured", lambda: configured)
        monkeypatch.setattr(_tf_private, "publish_to_coordination_service", self.keys.__setitem__)
        monkeypatch.setattr(_tf_private, "delete_from_coordination_service",
                            lambda key: self.keys.pop(key, None))
        monkeypatch.setattr(_tf_private, "read_from_coordination_service", self._read)

    def _read(self, key, timeout_seconds):
        self.reads.append((key, timeout_seconds))
        return self.keys[key]  # KeyError stands for the service's "not there"


@pytest.fixture
def service(monkeypatch):
    # Numbers start again for each test: a real process numbers from its first call.
    monkeypatch.setattr(deadline, "_outside_counts", {})
    return FakeService(monkeypatch)


@pytest.fixture
def fired(monkeypatch):
    """A watchdog of the test's own: what it would abort the collectives with comes here."""
    messages = queue.Queue()
    dog = deadline.Watchdog(messages.put)
    monkeypatch.setattr(deadline, "_watchdog", dog)
    yield messages
    dog.close()


# --- the message builder ------------------------------------------------------------------------

def _stall(missing, cause=""):
    return deadline.stall_message("a call", 2.5, 1, 3, missing, named="never came. ",
                                  everyone="All came. ", unknown="Nobody knows. ",
                                  context="Why all take part. ", fix="The fix.", cause=cause)


def test_the_builder_says_what_stalled_where_within_which_deadline_who_and_the_fix():
    assert _stall([0, 2]) == (
        "tfdp: a call on worker 1 of 3 did not finish within 2.5 s (DataParallelStrategy's "
        "timeout_seconds), so tfdp aborted its collectives. Why all take part. "
        "Worker(s) 0, 2 never came. The fix.")


def test_the_builder_tells_everyone_arrived_from_unknown():
    assert "All came. The fix." in _stall([]) and "Nobody knows" not in _stall([])
    assert "Nobody knows. The fix." in _stall(None) and "All came" not in _stall(None)


def test_the_builder_names_the_cause_instead_of_the_deadline():
    message = _stall([2], cause="UnavailableError: peer gone")
    assert message.startswith("tfdp: a call on worker 1 of 3 failed (UnavailableError: peer "
                              "gone). Why all take part. Worker(s) 2 never came.")
    assert "within" not in message


@pytest.mark.parametrize("message", [
    lambda m: deadline.overdue_message("a step", 2.5, 1, 3, m),
    lambda m: deadline.broadcast_overdue_message("kernel", 2.5, 1, 3, m),
    lambda m: deadline.outside_step_message("a call", 2.5, 1, 3, m, "Fix."),
])
def test_every_public_message_is_the_builders(message):
    named = message([0, 2])
    assert "on worker 1 of 3 did not finish within 2.5 s (DataParallelStrategy's " in named
    assert "Worker(s) 0, 2 never " in named and "timeout_seconds" in named
    assert "Worker(s)" not in message(None)


def test_a_step_message_gives_each_case_its_own_fix():
    assert "If a worker legitimately arrives" in deadline.overdue_message("s", 1, 0, 2, [1])
    assert "If a step legitimately takes" in deadline.overdue_message("s", 1, 0, 2, [])
    one = deadline.overdue_message("s", 1, 0, 1)
    assert "One of this process's replicas" in one and "If a step legitimately" in one


# --- the strategy's key ----------------------------------------------------------------------

def test_a_strategy_key_is_per_strategy_and_none_for_others():
    first = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    second = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    assert isinstance(deadline.strategy_key(first), int)
    assert deadline.strategy_key(first) != deadline.strategy_key(second)
    assert deadline.strategy_key(tf.distribute.get_strategy()) is None
    assert deadline.strategy_key(object()) is None


# --- Arrivals --------------------------------------------------------------------------------

def test_an_arrival_is_posted_under_the_strategy_and_the_meeting(service):
    meeting = deadline.Arrivals(FakeStrategy(rank=1), "first-variable")
    meeting.arrive()
    assert service.keys == {"tfdp/first-variable/7000000/1": "1"}
    assert meeting.key == "tfdp/first-variable/7000000" and meeting.number is None


def test_numbered_arrivals_count_per_name_and_prune_two_back(service):
    strategy = FakeStrategy(rank=2)
    numbers = []
    for name in ("save", "save", "read", "save"):
        meeting = deadline.Arrivals(strategy, "outside", name, numbered=True, prune=True)
        meeting.arrive()
        numbers.append(meeting.number)
    assert numbers == [0, 1, 0, 2]
    # The fourth call dropped its arrival at "save" 0 (a peer is at most one call behind).
    assert sorted(service.keys) == ["tfdp/outside/7000000/read/0/2",
                                    "tfdp/outside/7000000/save/1/2",
                                    "tfdp/outside/7000000/save/2/2"]


def test_unpruned_arrivals_stay(service):
    for _ in range(3):
        deadline.Arrivals(FakeStrategy(), "first-step", "a step", numbered=True).arrive()
    assert len(service.keys) == 3


def test_missing_names_the_workers_whose_arrival_is_not_posted(service):
    meeting = deadline.Arrivals(FakeStrategy(rank=0, num_workers=4), "first-variable")
    meeting.arrive()
    service.keys[f"{meeting.key}/2"] = "1"
    assert meeting.missing() == [1, 3]
    assert {timeout for _, timeout in service.reads} == {deadline.Arrivals.READ_SECONDS}


def test_missing_reads_within_its_budget(service):
    meeting = deadline.Arrivals(FakeStrategy(num_workers=5), "first-variable")
    meeting.arrive()
    meeting.READ_BUDGET_SECONDS = 0.0  # spent before the first read: nobody is named
    assert meeting.missing() == []


@pytest.mark.parametrize("strategy, configured", [
    (FakeStrategy(num_workers=1), True),   # one worker: nobody to wait for
    (FakeStrategy(key=None), True),        # a strategy without tfdp's key
    (FakeStrategy(), False),               # no coordination service
])
def test_missing_is_unknown_where_nothing_was_posted(monkeypatch, strategy, configured):
    monkeypatch.setattr(deadline, "_outside_counts", {})
    service = FakeService(monkeypatch, configured=configured)
    meeting = deadline.Arrivals(strategy, "outside", "x", numbered=True)
    meeting.arrive()
    assert meeting.number == 0  # numbered all the same: the first call's longer deadline
    assert service.keys == {} and meeting.missing() is None and service.reads == []


def test_missing_is_unknown_before_arriving(service):
    assert deadline.Arrivals(FakeStrategy(), "first-variable").missing() is None


def test_watch_aborts_naming_the_missing_when_due(service, fired):
    meeting = deadline.Arrivals(FakeStrategy(rank=0, num_workers=2), "outside", "x",
                                numbered=True)
    meeting.arrive()
    with meeting.watch(0.05, lambda *args: repr(args)):
        message = fired.get(timeout=10)
    assert message == repr((0.05, 0, 2, [1]))


def test_watch_disarms_when_the_meeting_ends_in_time(service, fired):
    meeting = deadline.Arrivals(FakeStrategy(), "first-variable")
    with meeting.watch(0.2, lambda *args: "late"):
        pass
    deadline._watchdog.arm(0.4, "the next one")  # due after the watched one would have been
    assert fired.get(timeout=10) == "the next one"
    assert fired.empty()


def test_message_passes_its_extra_words_to_the_builder(service, fired):
    meeting = deadline.Arrivals(FakeStrategy(rank=1, num_workers=2), "first-variable")
    meeting.arrive()
    describe = functools.partial(deadline.outside_step_message, "a call", fix="Fix.")
    with meeting.watch(60.0, describe):
        message = meeting.message(cause="AbortedError: gone")
    assert message == deadline.outside_step_message("a call", 60.0, 1, 2, [0], "Fix.",
                                                    "AbortedError: gone")


# --- the three users -------------------------------------------------------------------------

def test_a_step_posts_its_arrival_only_at_its_first_run(service, fired):
    strategy = FakeStrategy(rank=1, timeout_seconds=60)
    with deadline.watching(strategy, "a training step"):
        pass
    assert service.keys == {}
    with deadline.watching(strategy, "a training step", first=True):
        pass
    assert service.keys == {"tfdp/first-step/7000000/a training step/0/1": "1"}


def test_only_the_first_variable_posts_an_arrival(service, fired):
    strategy = FakeStrategy(rank=2, timeout_seconds=60)
    with deadline.variable_broadcast(strategy, "bias", first=False):
        pass
    assert service.keys == {}
    with deadline.variable_broadcast(strategy, "kernel", first=True):
        pass
    assert service.keys == {"tfdp/first-variable/7000000/2": "1"}


def test_the_first_call_of_a_kind_gets_the_longer_deadline(service, monkeypatch):
    armed = []
    monkeypatch.setattr(deadline._watchdog, "arm", lambda seconds, _: armed.append(seconds))
    monkeypatch.setattr(deadline._watchdog, "disarm", lambda token: None)
    strategy = FakeStrategy(timeout_seconds=2)
    for kind, first in (("read", None), ("read", None), ("save", None), ("save", True)):
        with deadline.collective_outside_step(strategy, "a call", "Fix.", kind=kind, first=first):
            pass
    assert armed == [2.0 * deadline.FIRST_STEP_FACTOR, 2.0, 2.0 * deadline.FIRST_STEP_FACTOR,
                     2.0 * deadline.FIRST_STEP_FACTOR]


def test_a_failed_call_outside_a_step_names_who_never_arrived_and_the_fix(service, fired):
    strategy = FakeStrategy(rank=0, num_workers=2, timeout_seconds=60)
    with pytest.raises(tf.errors.UnavailableError) as raised:
        with deadline.collective_outside_step(strategy, "a whole read", "Read on every worker."):
            raise tf.errors.UnavailableError(None, None, "peer gone")
    assert str(raised.value.message) == deadline.outside_step_message(
        "a whole read", 60.0 * deadline.FIRST_STEP_FACTOR, 0, 2, [1], "Read on every worker.",
        "UnavailableError: peer gone")
    # The deadline's own error passes as it is.
    with pytest.raises(tf.errors.DeadlineExceededError, match="^tfdp: own words$"):
        with deadline.collective_outside_step(strategy, "a whole read", "Fix."):
            raise tf.errors.DeadlineExceededError(None, None, "tfdp: own words")
