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

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
WORKERS = os.path.join(TESTS, "workers")


def worker_script(name):
    """The path of the worker script ``name`` in tests/workers/."""
    return os.path.join(WORKERS, name)


def worker_env(**extra):
    """This process's environment for a job: tests/ and the repository root first on
    ``PYTHONPATH``, ``TF_CONFIG`` removed, and ``extra`` added (values as strings)."""
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    paths = [TESTS, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
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


def run_job(cmd, env, timeout, cwd=None):
    """Runs ``cmd`` to its end; returns (exit code, stdout + stderr). Past ``timeout`` seconds
    the job's process group is killed and subprocess.TimeoutExpired raised."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _kill_group(proc)
    return proc.returncode, out + err


def start_job(cmd, env):
    """Starts ``cmd`` in a session of its own (to be signalled, and killed as a group), its
    stderr merged into its stdout pipe; finish it with finish_job."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish_job(proc, timeout):
    """Waits for a job from start_job; returns (exit code, output). Past ``timeout`` seconds
    its process group is killed and subprocess.TimeoutExpired raised."""
    try:
        out, _ = proc.communicate(timeout=timeout)
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
