"""A pytest-xdist worker that dies or hangs mid-test says why, in the run's own output.

On its own, xdist reports only "worker 'gw1' crashed while running X" at the very end of the
run, and a worker's stderr (faulthandler's fatal-signal dump, pytest-timeout's stacks, the log
line tfdp's preemption backstop writes before ``os._exit``) reaches no log CI keeps. A CI run
that lost a worker that way, then ran out of its time limit before its summary, said nothing
about either. Rules (a pytest plugin, loaded by tests/conftest.py):

* **Record.** Every xdist worker appends to its own file in a directory the controller makes
  (``$TFDP_TEST_RECORDS/<worker>.log``): the test it starts and ends, faulthandler's dump on a
  fatal signal, tfdp's log records of WARNING and above, the watchdog's dump, and the
  processes it killed.
* **Tag.** Every worker puts ``TFDP_TEST_WORKER=<run>-<worker>`` in its environment; whatever
  a test starts inherits it, on this host or through ssh and Slurm, so the worker's processes
  can be found by tag even after the worker is gone (kill by pid, never by name).
* **Probe.** A test still running ``PROBE_EVERY_S`` after it started, and every
  ``PROBE_EVERY_S`` after that, has its main thread's innermost frames and the process's CPU
  seconds so far written to the record: where a test that is slow only in the suite waits.
  A probe that finds the process stalled (no CPU since the last probe and no child process)
  also writes every thread's stack and its kernel wait channel, and the host's pressure, and
  when a garbage collection is under way, every thread's native stack (py-spy): which
  finalizer it waits in. A collection that took 5 s or more is recorded when it ends.
* **Watchdog.** A test still running at 80% of its pytest-timeout limit has every thread's
  stack written to the record, then its worker's processes killed (its own process tree and
  every tagged process): what waited on them fails with its own error, and the worker lives
  on, where pytest-timeout would end the worker with ``os._exit``.
* **Starved.** A test whose worker wrote no probe for two probe intervals has a thread holding
  the GIL (no Python thread of it can run, the probe's included): the controller reads that
  worker from outside, once, while it is still stuck (CPU, each thread's kernel wait, every
  thread's native and Python stack, py-spy) and writes it to the record.
* **Stuck.** A test still running a minute past its limit means pytest-timeout's thread never
  ran (C code holding the GIL): the controller reads the worker from outside again, then
  SIGKILLs it, which xdist then reports and replaces as below.
* **Crash.** When a worker dies the controller prints, at once, the end of that worker's record
  (and puts it in the test's report), and SIGKILLs every process still carrying its tag:
  orphans of a dead worker would otherwise take CPU from the rest of the run.
* **Loud.** A test that took ``LOUD_AFTER_S`` or more is named by the controller as it ends,
  not only in the summary that a run stopped by a time limit never prints.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import pytest

from procs import carrying, descendants

TAG_ENV = "TFDP_TEST_WORKER"
RECORDS_ENV = "TFDP_TEST_RECORDS"
WATCHDOG_FRACTION = 0.8
STUCK_AFTER_LIMIT_S = float(os.environ.get("TFDP_TEST_STUCK_AFTER_S", "60"))
STUCK_POLL_S = float(os.environ.get("TFDP_TEST_STUCK_POLL_S", "15"))
PROBE_EVERY_S = float(os.environ.get("TFDP_TEST_PROBE_EVERY_S", "15"))
GC_SLOW_S = 5.0  # a garbage collection this long is recorded
STALLED_CPU_S = 0.3  # a probe interval with less CPU than this, and no child running: stalled
STARVED_AFTER_PROBES = 2  # no probe line after this many probe intervals: the GIL is held
LOUD_AFTER_S = float(os.environ.get("TFDP_TEST_LOUD_AFTER_S", "150"))
_RECORD_TAIL = 8000


def record_path(workerid: str) -> str:
    return os.path.join(os.environ[RECORDS_ENV], f"{workerid}.log")


# --- processes: a tree by /proc, and processes by tag ------------------------------------------

def tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``TFDP_TEST_WORKER=<tag>``."""
    return carrying(TAG_ENV, tag)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "(gone)"


def kill_all(pids, spare=()) -> list[str]:
    """SIGKILLs ``pids`` but ``spare``; returns a line per process killed."""
    lines = []
    for pid in pids:
        if pid in spare:
            continue
        name = _cmdline(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        lines.append(f"  killed {pid}: {name}")
    return lines


def _threads(pid: int | str = "self") -> list[tuple[str, str, str, str]]:
    """(tid, name, state R/S/D, kernel wait channel) of each thread of ``pid``."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return []
    threads = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            continue
        threads.append((tid, stat[stat.index("(") + 1:stat.rindex(")")],
                        stat[stat.rindex(")") + 2], wchan))
    return threads


def _kernel_waits() -> str:
    """Each thread of this process: its name, state (R, S, D) and kernel wait channel, then the
    host's CPU, I/O and memory pressure (a process that stalls on the disk or on memory waits in
    the kernel; on a lock of its own, in a futex)."""
    lines = [f"  {tid} {name!r} {state} {wchan}" for tid, name, state, wchan in _threads()]
    for kind in ("cpu", "io", "memory"):
        try:
            with open(f"/proc/pressure/{kind}") as f:
                lines.append(f"  pressure {kind}: " + " | ".join(f.read().split("\n")[:2]))
        except OSError:
            pass
    return "\n".join(lines)


def _native_stacks(pid: int | None = None) -> str:
    """The threads of ``pid`` (this process by default) with their native frames (py-spy, a
    test dependency; it reads the process from outside, so it needs no GIL there)."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return "  (py-spy is not installed)"
    try:
        dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid or os.getpid())],
                              capture_output=True, text=True, timeout=60)
        return dump.stdout or dump.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"  (py-spy failed: {e})"


def _thread_stack(dump: str, name: str) -> str:
    """The stack of the thread called ``name`` in a py-spy dump ("" when it has none)."""
    lines, keep = [], False
    for line in dump.splitlines():
        if line.startswith("Thread "):
            keep = line.endswith(f'"{name}"')
        if keep:
            lines.append(line)
    return "\n".join(lines)


def _cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def outside_dump(pid: int) -> str:
    """What a process that cannot report on itself (a thread holds the GIL, so none of its
    Python threads runs) is doing, read from outside: whether it burns CPU, each thread's
    kernel state, and every thread's native and Python stack; its main thread's stack again
    last, where the tail of a record shows it."""
    before = _cpu_ticks(pid)
    time.sleep(1.0)  # a CPU sample over a second: spinning, or blocked
    after = _cpu_ticks(pid)
    busy = "?" if None in (before, after) else f"{(after - before) / os.sysconf('SC_CLK_TCK'):.2f}"
    states = [f"{state}:{wchan}" for _, _, state, wchan in _threads(pid)]
    counts = {s: states.count(s) for s in dict.fromkeys(states)}
    dump = _native_stacks(pid)
    return (f"  CPU seconds in the last second: {busy}; its {len(states)} threads by state and "
            f"kernel wait: {counts}\n{dump}\n  its main thread again:\n"
            f"{_thread_stack(dump, 'MainThread')}")


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# --- the worker's side --------------------------------------------------------------------------

class _Appender:
    """A record file written with one ``os.write`` per call: no lock of Python's buffered I/O,
    which a thread stuck mid-write (say, in a garbage collection its allocation started) would
    hold against the probe and the watchdog."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str) -> int:
        return os.write(self.fd, text.encode(errors="replace"))

    def flush(self):
        pass

    def fileno(self) -> int:
        return self.fd

    def close(self):
        os.close(self.fd)


class _WorkerRecord:
    def __init__(self, config):
        run, worker = config.workerinput["testrunuid"], config.workerinput["workerid"]
        self.tag = f"{run}-{worker}"
        os.environ[TAG_ENV] = self.tag
        self.file = _Appender(record_path(worker))
        self.write(f"worker {worker}, pid {os.getpid()}, started {_start_time(os.getpid())}")
        # A fatal signal (SIGSEGV, SIGABRT, ...) dumps every thread here, not to a lost stderr.
        faulthandler.enable(file=self.file, all_threads=True)
        self.log_handler = logging.StreamHandler(self.file)
        self.log_handler.setLevel(logging.WARNING)
        self.log_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s "
                                                        "%(message)s"))
        logging.getLogger("tfdp").addHandler(self.log_handler)
        self.timer = None
        self.probe = None
        self.current = None  # the running test's node id
        self.gc_started = None  # (monotonic time, thread) of a collection in progress
        gc.callbacks.append(self._time_gc)

    def write(self, text: str):
        self.file.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")
        self.file.flush()

    def start(self, item):
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0]) if marker and marker.args else float(
            item.config.getini("timeout") or 0)
        self.write(f"start {item.nodeid} (limit {limit:.0f} s, at {time.time():.0f})")
        self.current = item.nodeid
        if PROBE_EVERY_S > 0:
            self._probe_later(item.nodeid, threading.main_thread().ident, time.monotonic(),
                              _cpu_seconds())
        if limit > 0:
            after = WATCHDOG_FRACTION * limit
            self.timer = threading.Timer(after, self._watchdog, args=(item.nodeid, after))
            self.timer.daemon = True
            self.timer.start()

    def end(self, item):
        self.write(f"end {item.nodeid}")
        self.current = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.probe is not None:
            self.probe.cancel()
            self.probe = None

    def _probe_later(self, nodeid, ident, began, cpu_began, cpu_last=None):
        self.probe = threading.Timer(PROBE_EVERY_S, self._probe,
                                     args=(nodeid, ident, began, cpu_began,
                                           cpu_began if cpu_last is None else cpu_last))
        self.probe.daemon = True
        self.probe.start()

    def _probe(self, nodeid, ident, began, cpu_began, cpu_last):
        if self.current != nodeid:  # ended meanwhile
            return
        frame = sys._current_frames().get(ident)
        stack = traceback.format_stack(frame)[-12:] if frame is not None else []
        cpu_now = _cpu_seconds()
        self.write(f"probe: {nodeid} {time.monotonic() - began:.0f} s in, this process's CPU "
                   f"{cpu_now - cpu_began:.1f} s; its main thread, innermost last:\n"
                   + "".join(stack).rstrip())
        if cpu_now - cpu_last < STALLED_CPU_S and not descendants(os.getpid()):
            # No CPU and no child to wait for: the process is stalled. What every thread
            # waits on, in Python and in the kernel, says on what.
            self.write("stalled: every thread's Python stack, then each thread's kernel state:")
            faulthandler.dump_traceback(file=self.file, all_threads=True)
            self.file.flush()
            self.write(_kernel_waits())
            collecting = self.gc_started
            if collecting is not None:
                self.write(f"a garbage collection started {time.monotonic() - collecting[0]:.0f}"
                           f" s ago in thread {collecting[1]:#x} is still running; its native "
                           "stack names the finalizer it waits in:\n" + _native_stacks())
        if self.current == nodeid:
            self._probe_later(nodeid, ident, began, cpu_began, cpu_now)

    def _time_gc(self, phase, info):
        """gc.callbacks: a collection that takes GC_SLOW_S or more is recorded (a finalizer
        that waits holds the collection, and whatever triggered it, that long)."""
        if phase == "start":
            self.gc_started = (time.monotonic(), threading.get_ident())
            return
        if self.gc_started is None:
            return
        began, thread = self.gc_started
        self.gc_started = None
        took = time.monotonic() - began
        if took >= GC_SLOW_S:
            self.write(f"gc: a collection of generation {info.get('generation')} in thread "
                       f"{thread:#x} took {took:.1f} s ({self.current})")

    def _watchdog(self, nodeid, after):
        self.write(f"watchdog: {nodeid} still running after {after:.0f} s; every thread's stack:")
        faulthandler.dump_traceback(file=self.file, all_threads=True)
        self.file.flush()
        lines = self._kill_processes()
        self.write("watchdog: killed the test's processes:\n" + "\n".join(lines or ["  (none)"]))

    def _kill_processes(self) -> list[str]:
        """SIGKILLs this worker's processes: its descendants and everything carrying its tag."""
        pids = descendants(os.getpid()) + tagged(self.tag)
        return kill_all(dict.fromkeys(pids), spare=(os.getpid(),))

    def close(self):
        if self._time_gc in gc.callbacks:
            gc.callbacks.remove(self._time_gc)
        # Whatever a test started and left running outlives the run otherwise.
        lines = self._kill_processes()
        if lines:
            self.write("leftover processes at the end of the run:\n" + "\n".join(lines))
        logging.getLogger("tfdp").removeHandler(self.log_handler)


_record: _WorkerRecord | None = None
_watch = None


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler set-up, which it replaces
def pytest_configure(config):
    global _record, _watch
    if not os.path.isdir("/proc"):
        return
    if hasattr(config, "workerinput"):
        if os.environ.get(RECORDS_ENV):
            _record = _WorkerRecord(config)
    elif getattr(config.option, "numprocesses", None):
        # The controller, before it starts its workers (they inherit the environment).
        os.environ[RECORDS_ENV] = tempfile.mkdtemp(prefix="tfdp-tests-records-")
        _watch = _StuckWatch(config)


def pytest_unconfigure(config):
    global _record, _watch
    if _record is not None:
        _record.close()
        _record = None
    if _watch is not None:
        _watch.stop()
        _watch = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _record is not None:
        _record.start(item)
    try:
        yield
    finally:
        if _record is not None:
            _record.end(item)


# --- the controller's side ----------------------------------------------------------------------

def _start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` (clock ticks since boot): with the pid, it names one
    process, where a pid alone may be reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


class _StuckWatch:
    """The controller's thread that SIGKILLs a worker stuck past its test's limit."""

    def __init__(self, config, every_s: float = STUCK_POLL_S):
        self.config, self.every_s = config, every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tfdp-stuck-watch", daemon=True)
        self.thread.start()

    def stop(self):
        self.stopped.set()

    def _run(self):
        while not self.stopped.wait(self.every_s):
            try:
                names = os.listdir(os.environ[RECORDS_ENV])
            except (OSError, KeyError):
                continue
            for name in names:
                self._check(os.path.join(os.environ[RECORDS_ENV], name))

    def _check(self, path):
        try:
            lines = [line for line in open(path, errors="replace").read().splitlines()
                     if line.startswith("[")]
            first = lines[0].split("] worker ", 1)[1]  # "gw1, pid 123, started 456"
            pid, started = int(first.split(", pid ")[1].split(",")[0]), first.rsplit(" ", 1)[1]
            starts = [line for line in lines if "] start " in line or "] end " in line]
        except (OSError, IndexError, ValueError):
            return
        if not starts or "] start " not in starts[-1] or _start_time(pid) != started:
            return
        limit, began = starts[-1].rsplit("(limit ", 1)[1].rstrip(")").split(" s, at ")
        limit, began = float(limit), float(began)
        ran = time.time() - began
        since = lines[lines.index(starts[-1]) + 1:]
        if any("] controller: the test ran " in line for line in since):
            return  # killed already: a zombie keeps its pid and start time until it is reaped
        if (PROBE_EVERY_S > 0 and ran > STARVED_AFTER_PROBES * PROBE_EVERY_S + self.every_s
                and not any("] probe: " in line or "] controller: " in line for line in since)):
            # The worker's probe thread, due every PROBE_EVERY_S, has not run: something holds
            # the GIL. Read the worker from outside while it is still stuck.
            with open(path, "a") as f:
                f.write(f"[{time.strftime('%H:%M:%S')}] controller: no probe from the worker "
                        f"{ran:.0f} s into its test (one is due every {PROBE_EVERY_S:.0f} s): "
                        f"a thread holds the GIL; the worker, pid {pid}, from outside:\n"
                        f"{outside_dump(pid)}\n")
        if limit > 0 and ran > limit + STUCK_AFTER_LIMIT_S:
            with open(path, "a") as f:
                f.write(f"[{time.strftime('%H:%M:%S')}] controller: the test ran "
                        f"{ran:.0f} s, past its limit of {limit:.0f} s with no "
                        f"timeout (its thread never ran: C code holding the GIL?); the worker, "
                        f"pid {pid}, from outside:\n{outside_dump(pid)}\n"
                        f"SIGKILL to the worker, pid {pid}\n")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError as e:
        return f"(no record: {e})"
    return text[-_RECORD_TAIL:]


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    node = report.node
    if not os.environ.get(RECORDS_ENV):
        return
    run, worker = node.workerinput["testrunuid"], node.workerinput["workerid"]
    lines = kill_all(tagged(f"{run}-{worker}"), spare=(os.getpid(),))
    text = (f"worker {worker!r} crashed while running {crashitem!r}; the end of its record "
            f"({record_path(worker)}):\n{_tail(record_path(worker))}\n"
            f"its processes left running, killed: {len(lines)}\n" + "\n".join(lines))
    report.longrepr = text
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(text)


def pytest_runtest_logreport(report):
    if (LOUD_AFTER_S and report.when == "call" and report.duration >= LOUD_AFTER_S
            and getattr(report, "node", None) is not None):
        reporter = report.node.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(f"slow: {report.nodeid} took {report.duration:.0f} s "
                                f"({report.outcome})")
