"""Starting tfdp-run jobs and worker scripts from the tests (no TensorFlow is imported here).

One rule for every test that starts real processes:

* the command comes from :func:`tfdp_run_command` (the worker scripts live in tests/workers/:
  :func:`worker_script`);
* the environment from :func:`worker_env`: tests/ and the repository root on ``PYTHONPATH``,
  so a worker script imports tests/helpers.py and the other helper modules without touching
  ``sys.path`` (tfdp-run passes ``PYTHONPATH`` on to its workers, over ssh too), and no
  ``TF_CONFIG`` inherited from the shell that started pytest;
* every wait is bounded: :func:`run_job` and :func:`finish_job` by a timeout, after which
  the job's own process group is killed (every job runs in a session of its own, so that kill
  reaches nothing else); :func:`wait_for_file` by a deadline, and it fails at once, with the
  job's output, when the job ends before the file appears.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from procs import carrying, descendants

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
WORKERS = os.path.join(TESTS, "workers")


def worker_script(name):
    """The path of the worker script ``name`` in tests/workers/."""
    return os.path.join(WORKERS, name)


# Packages Keras imports at its own import when they are installed (the test extra installs
# them for the tools' plots and the examples) and no test uses through Keras: matplotlib,
# pandas and scikit-learn are hidden from Keras's import only (tests/hidden_imports, whose
# stand-ins give every other importer the real package). That saves about 1.5 s of CPU per
# process (`import tensorflow, keras`: 4.0 -> 2.5 s user on the 2-core host), and the suite
# starts a few hundred: a profile of the suite had imports at 29% of its CPU samples.
# tests/conftest.py calls hide_keras_optional(os.environ) once, so every process of the session
# inherits it (the xdist workers, the jobs, the tools and examples tests run, Slurm's and Ray's
# tasks). TFDP_TEST_SHOW_OPTIONAL=1 shows them.
HIDDEN_IMPORTS = os.path.join(TESTS, "hidden_imports")


def hide_keras_optional(environ):
    """Puts tests/hidden_imports first on ``environ``'s ``PYTHONPATH`` (once), unless
    ``TFDP_TEST_SHOW_OPTIONAL=1``."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if environ.get("TFDP_TEST_SHOW_OPTIONAL") == "1" or HIDDEN_IMPORTS in paths:
        return
    environ["PYTHONPATH"] = os.pathsep.join([HIDDEN_IMPORTS] + paths)


def worker_env(**extra):
    """This process's environment for a job: tests/, the repository root and tools/ on
    ``PYTHONPATH`` after tests/hidden_imports (see HIDDEN_IMPORTS), as pyproject.toml gives
    pytest, ``TF_CONFIG`` removed, ``TFDP_COMPILE_CACHE=off`` unless set (below), and
    ``extra`` added (values as strings)."""
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    paths = [TESTS, ROOT, os.path.join(ROOT, "tools")] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    hide_keras_optional(env)
    # tfdp-run's XLA compile cache defaults to one per user (~/.cache/tfdp/xla): jobs of the
    # suite would share compiled programs through it, and a test's outcome would depend on
    # what ran before it. Off unless a test chooses a directory (tests/test_compile_cache.py).
    env.setdefault("TFDP_COMPILE_CACHE", "off")
    env.update({name: str(value) for name, value in extra.items()})
    return env


def tfdp_run_command(script, *script_args, workers=2, cpu_replicas=None, flags=(),
                     python=sys.executable):
    """``python -m tfdp.run --workers N [--cpu-replicas R] FLAGS -- python SCRIPT ARGS``.

    Args:
      script: the worker program (a path; run by ``python``, or by itself with python=None).
      *script_args: the worker program's arguments.
      workers: ``--workers``.
      cpu_replicas: ``--cpu-replicas``, left out when None.
      flags: more tfdp-run flags, placed before ``--``.
      python: the interpreter that runs ``script``; None runs ``script`` itself.
    """
    launcher = [sys.executable, "-m", "tfdp.run", "--workers", str(workers)]
    if cpu_replicas is not None:
        launcher += ["--cpu-replicas", str(cpu_replicas)]
    worker = ([python] if python else []) + [str(script)]
    return [*launcher, *(str(f) for f in flags), "--", *worker, *(str(a) for a in script_args)]


def _kill_group(proc):
    """SIGKILLs the job's process group (its own session: see start_job) if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


class JobTimeout(subprocess.TimeoutExpired):
    """A job ran past its timeout: the message carries every one of its processes' Python
    stacks (taken before the kill) and the end of its output, so that a hang in CI names
    where each process waited."""

    def __init__(self, cmd, timeout, stacks, output):
        super().__init__(cmd, timeout, output=output)
        self.stacks = stacks

    def __str__(self):
        return (f"{super().__str__()}\n--- stacks of the job's processes at the timeout ---\n"
                f"{self.stacks}\n--- the job's output (end) ---\n{(self.output or '')[-6000:]}")


def _job_processes(root, env):
    """``root`` and its descendants, and (workers started over ssh are sshd's children) every
    process whose environment has this job's ``TFDP_TEST_OUT``."""
    found = [root] + descendants(root)
    marker = env.get("TFDP_TEST_OUT") if env else None
    if marker and os.path.isdir("/proc"):
        found += [pid for pid in carrying("TFDP_TEST_OUT", marker) if pid not in found]
    return found


def stacks_of(root, env=None):
    """The Python stacks (py-spy, when installed) of ``root`` and its job's processes."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return "(py-spy is not installed: no stacks)"
    parts = []
    for pid in _job_processes(root, env):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                name = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        if "python" not in name:
            continue
        try:
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=30)
            text = dump.stdout or dump.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"(py-spy failed: {e})"
        parts.append(f"=== pid {pid}: {name}\n{text}")
    return "\n".join(parts) or "(no processes left)"


def _communicate(proc, timeout, env):
    """proc.communicate(timeout); past it, the stacks, then the kill, then JobTimeout."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stacks_of(proc.pid, env)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise JobTimeout(proc.args, timeout, stacks, (out or "") + (err or "")) from None


def run_job(cmd, env, timeout, cwd=None):
    """Runs ``cmd`` to its end; returns (exit code, stdout + stderr). Past ``timeout`` seconds
    the job's process group is killed and JobTimeout (a subprocess.TimeoutExpired naming
    where every process waited) raised."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = _communicate(proc, timeout, env)
    finally:
        _kill_group(proc)
    return proc.returncode, out + err


def start_job(cmd, env):
    """Starts ``cmd`` in a session of its own (to be signalled, and killed as a group), its
    stderr merged into its stdout pipe; finish it with finish_job."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    proc._tfdp_env = env  # finish_job's stacks at a timeout find ssh-started workers by it
    return proc


def finish_job(proc, timeout):
    """Waits for a job from start_job; returns (exit code, output). Past ``timeout`` seconds
    its process group is killed and subprocess.TimeoutExpired raised."""
    try:
        out, _ = _communicate(proc, timeout, getattr(proc, "_tfdp_env", None))
    finally:
        _kill_group(proc)
    return proc.returncode, out


def wait_for_file(path, proc, timeout):
    """Polls for a file the job writes; fails early, with the job's output, if the job ends
    first, and after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"job ended ({proc.returncode}) before {path}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising by time


def wait_until(predicate, what, timeout):
    """Polls ``predicate()`` until it is true; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # polling files and processes; the deadline bounds it


def fake_worker_starts(out):
    """{(slot, attempt): the record tests/workers/fake_worker.py wrote at its start} in ``out``
    (its pid, rank, TF_CONFIG, the launcher's settings it saw)."""
    found = {}
    for name in os.listdir(out):
        if name.startswith("start-") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                record = json.load(f)
            found[(record["slot"], record["attempt"])] = record
    return found
