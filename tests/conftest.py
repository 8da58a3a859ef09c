"""Test set-up: one process with 4 logical CPU replicas (the machine has no GPU), and the
fixtures several test modules share."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from launching import hide_keras_optional

# Every process of the session (the xdist workers start after this runs in the controller)
# imports Keras without the optional packages it would load and no test uses through it.
hide_keras_optional(os.environ)

import tfdp  # noqa: E402  (after hide_keras_optional: Keras loads with it)

NUM_CPU_REPLICAS = 4
tfdp.configure_cpu_replicas(NUM_CPU_REPLICAS)

from helpers import cpu_devices  # noqa: E402  (after the devices are configured)

# A worker that dies or hangs mid-test says why, in the run's own output (tests/crash_records.py).
# The module fixtures ``sshd`` (a loopback sshd, two "hosts") and ``slurm`` (a real Slurm
# controller, nodes n1 and n2) are requested by name, not imported into each test module.
pytest_plugins = ["crash_records", "loopback_sshd", "slurm_cluster"]


@pytest.fixture(scope="module")
def strategy4():
    """A DataParallelStrategy over the 4 logical CPU devices, one per test module."""
    return tfdp.DataParallelStrategy(devices=cpu_devices(NUM_CPU_REPLICAS))


_SIGNALS_TESTS_SEND = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


@pytest.fixture(autouse=True)
def _one_pass_graph_optimization_as_tfdps_steps():
    """Every function a test calls is optimised by Grappler in one pass without TFG, as tfdp's
    own fit/evaluate steps are (tfdp/strategy/xla.py): the one-device references too, so the
    two sides of an equivalence are optimised alike, and the suite spends less of its time in
    Grappler. A test that changes TensorFlow's config drops it for the rest of that test."""
    from tfdp import _tf_private

    with _tf_private.one_pass_graph_optimization():
        yield


@pytest.fixture(autouse=True)
def _no_signal_state_outlives_a_test():
    """Every test leaves the process's signal handlers as it found them and no preemption
    backstop armed. A backstop left armed ends this xdist worker with ``os._exit`` a grace
    period later, in some other test ("node down: Not properly terminated"); a handler left
    behind changes what the next test's signal does. Found ones are put right and the test
    that left them fails, named."""
    import signal
    import threading

    signals = [getattr(signal, name) for name in _SIGNALS_TESTS_SEND]
    before = {s: signal.getsignal(s) for s in signals}
    yield
    armed = [t for t in threading.enumerate() if isinstance(t, threading.Timer)
             and getattr(t.function, "__name__", "") == "_backstop" and not t.finished.is_set()]
    for timer in armed:
        timer.cancel()
    changed = [s.name for s in signals
               if signal.getsignal(s) is not before[s] and before[s] is not None]
    for s in signals:
        if before[s] is not None:
            signal.signal(s, before[s])
    assert not armed, f"the test left {len(armed)} preemption backstop(s) armed"
    assert not changed, f"the test left its own handler(s) for {changed}"


@pytest.fixture(autouse=True)
def _alone_when_marked_exclusive(request):
    """A test marked ``exclusive`` judges timing (a healthy run must name no straggler), so it
    runs with no test beside it on the other xdist processes: a neighbour's load on this
    2-core host slows whichever worker the scheduler picks, which is a straggler by the very
    rule under test (seen: the chief named in the healthy phase while the other process ran
    4-replica tests). Every test holds a shared lock; an exclusive one takes it alone. The
    turnstile stops new shared holders while an exclusive test waits, so it is not starved.
    Without xdist there is nothing beside it and no lock."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    import fcntl
    import tempfile

    exclusive = request.node.get_closest_marker("exclusive") is not None
    base = os.path.join(tempfile.gettempdir(), f"tfdp-tests-{run}")
    with open(base + ".turnstile", "a+") as turnstile, open(base + ".lock", "a+") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- where a slow test's time went: its own CPU, its children's, or neither -----------------

# A test still running after this many seconds has every thread's Python stack written once
# (faulthandler, from its own C thread: it works while the main thread waits in TensorFlow);
# the summary prints where the main thread was for each test over SLOW_SUMMARY_S, so a slow test in CI
# says what it waited on (issue 44: a 10 s test took 65-77 s in the suite on 16 s of CPU).
STACKS_AFTER_S = float(os.environ.get("TFDP_TEST_STACKS_AFTER_S", "45"))
SLOW_SUMMARY_S = float(os.environ.get("TFDP_TEST_SLOW_SUMMARY_S", "60"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Records the call's CPU seconds (this process: every thread; its reaped children) beside
    its wall time, for the summary below. A test far slower than alone with little CPU of its
    own waited (for the CPU, a lock, a peer); one with CPU close to its wall time computed.
    A test running past ``STACKS_AFTER_S`` also records its main thread's stack then."""
    import faulthandler
    import tempfile

    before = os.times()
    with tempfile.TemporaryFile("w+") as stacks:
        faulthandler.dump_traceback_later(STACKS_AFTER_S, file=stacks)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
        stacks.seek(0)
        dumped = stacks.read()
    after = os.times()
    item.user_properties.append(("cpu_s", (after.user + after.system)
                                 - (before.user + before.system)))
    item.user_properties.append(("children_cpu_s", (after.children_user + after.children_system)
                                 - (before.children_user + before.children_system)))
    if dumped:
        item.user_properties.append(("main_stack", main_thread_stack(dumped)))


def main_thread_stack(dump: str, frames: int = 12) -> str:
    """The innermost ``frames`` frames of the test's own thread in a faulthandler dump (the
    thread whose stack runs through pytest), most recent first, then its outer frames in
    tfdp and the tests (which test line, which tfdp call)."""
    for block in dump.split("\n\n"):
        if "_pytest" in block or "pluggy" in block:
            lines = [line for line in block.splitlines() if line.strip().startswith("File")]
            outer = [line for line in lines[frames:] if "/tfdp/" in line or "/tests/" in line]
            return "\n".join(lines[:frames] + (["  ..."] if outer else []) + outer[:8])
    return dump[:2000]


def pytest_terminal_summary(terminalreporter):
    rows = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call" or report.duration < SLOW_SUMMARY_S:
                continue
            props = dict(report.user_properties)
            rows.append((report.duration, props.get("cpu_s", 0.0),
                         props.get("children_cpu_s", 0.0), report.nodeid,
                         props.get("main_stack", "")))
    if rows:
        terminalreporter.section(f"tests over {SLOW_SUMMARY_S:.0f} s: wall, own CPU, "
                                 "children's CPU (s)")
        for wall, cpu, children, nodeid, _ in sorted(rows, reverse=True):
            terminalreporter.write_line(f"{wall:7.1f} {cpu:7.1f} {children:7.1f}  {nodeid}")
        for wall, _, _, nodeid, stack in sorted(rows, reverse=True):
            if stack:
                terminalreporter.write_line(f"-- {nodeid}: its thread {STACKS_AFTER_S:.0f} s "
                                            "in, most recent call first:")
                terminalreporter.write_line(stack)
