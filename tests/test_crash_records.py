"""tests/crash_records.py: a pytest-xdist worker that dies mid-test is named with the end of its
record, at once, and the processes its test left are killed; a test hung on a child is released
by the watchdog before pytest-timeout's limit. Each case runs a small pytest session of its own
(no TensorFlow) in a subprocess."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from procs import process_alive

TESTS = os.path.dirname(os.path.abspath(__file__))

DYING = textwrap.dedent("""
    import logging, os, subprocess, sys, time
    import pytest

    def test_dies_like_a_preemption_backstop(tmp_path):
        child = subprocess.Popen(["sleep", "300"])
        (tmp_path.parent.parent / "child.pid").write_text(str(child.pid))
        logging.getLogger("tfdp").error("no agreed stop within the grace period (a stand-in)")
        os._exit(143)

    @pytest.mark.timeout(10)
    def test_hangs_on_a_child():
        child = subprocess.Popen(["sleep", "300"])
        assert child.wait() == -9  # released by the watchdog's SIGKILL at 8 s
""")

# C code that holds the GIL (ctypes.PyDLL keeps it): neither pytest-timeout's thread nor the
# watchdog's can run.
STUCK = textwrap.dedent("""
    import ctypes
    import pytest

    @pytest.mark.timeout(3)
    def test_stuck_in_c_holding_the_gil():
        ctypes.PyDLL(None).sleep(300)
""")


def _session(tmp_path, plugin=True, tests=DYING, select=None):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_dying.py").write_text(tests)
    (tmp_path / "t" / "pytest.ini").write_text("[pytest]\ntimeout = 60\ntimeout_method = thread\n")
    env = dict(os.environ, PYTHONPATH=TESTS, TMPDIR=str(tmp_path), TFDP_TEST_STUCK_AFTER_S="2",
               TFDP_TEST_STUCK_POLL_S="1", TFDP_TEST_PROBE_EVERY_S="1")
    env.pop("TFDP_TEST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider",
           "--basetemp", str(tmp_path / "base"), str(tmp_path / "t")]
    if plugin:
        cmd[3:3] = ["-p", "crash_records"]
    if select:
        cmd += ["-k", select]
    proc = subprocess.run(cmd, cwd=tmp_path / "t", env=env, capture_output=True, text=True,
                          timeout=180)
    child = tmp_path / "base" / "child.pid"
    return proc.stdout + proc.stderr, int(child.read_text()) if child.exists() else None


@pytest.mark.slow
def test_a_dead_worker_is_named_with_its_record_and_its_processes_killed(tmp_path):
    out, child = _session(tmp_path)
    assert "crashed while running 'test_dying.py::test_dies_like_a_preemption_backstop'" in out
    assert "no agreed stop within the grace period (a stand-in)" in out, out[-4000:]
    assert f"killed {child}: sleep 300" in out, out[-4000:]
    assert not process_alive(child)
    # The hung test passed: the watchdog killed its child, and wrote why, before the timeout.
    assert "test_hangs_on_a_child PASSED" in out or "1 failed, 1 passed" in out, out[-4000:]
    record = "".join(open(p).read() for p in glob.glob(str(tmp_path / "tfdp-tests-*" / "*.log")))
    assert "watchdog: test_dying.py::test_hangs_on_a_child still running after 8 s" in record
    assert "killed" in record and "sleep 300" in record


@pytest.mark.slow
def test_guard_without_the_plugin_the_crash_says_nothing_and_the_child_lives(tmp_path):
    # Only the dying test: without the plugin's watchdog the hung one would wait for
    # pytest-timeout's 10 s, and this guard asserts nothing about it.
    out, child = _session(tmp_path, plugin=False, select="test_dies_like_a_preemption_backstop")
    try:
        assert "crashed while running" in out
        assert "no agreed stop within the grace period" not in out
        assert process_alive(child)
    finally:
        if process_alive(child):
            os.kill(child, 9)


@pytest.mark.slow
def test_a_worker_stuck_in_c_past_its_limit_is_killed_by_the_controller(tmp_path):
    out, _ = _session(tmp_path, tests=STUCK)
    assert "crashed while running 'test_dying.py::test_stuck_in_c_holding_the_gil'" in out, out
    assert "past its limit of 3 s with no timeout" in out, out[-4000:]
    # Read from outside while stuck (no probe for two intervals), and again before the kill:
    # the main thread's native stack names the C call and the test that made it.
    record = "".join(open(p).read() for p in glob.glob(str(tmp_path / "tfdp-tests-*" / "*.log")))
    assert "controller: no probe from the worker" in record, record[-4000:]
    assert record.count("its main thread again:") == 2, record[-4000:]
    main = record.rsplit("its main thread again:", 1)[1]
    assert "sleep (libc" in main and "test_stuck_in_c_holding_the_gil" in main, main
