"""tfdp-run: argument handling, and the launcher with tiny TensorFlow-free workers.

The process tests start tests/workers/fake_worker.py (no TensorFlow), which speaks the launcher
protocol (ready, progress and evict files) and acts per slot and attempt as FAKE_PLAN says.
They wait for files with a bounded deadline, never for a fixed time, and stop only what they
started (the launcher's process group; the launcher stops its workers)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from launching import (fake_worker_starts, finish_job, run_job, start_job, tfdp_run_command,
                       wait_until, worker_env, worker_script)
from procs import process_alive
from tfdp.launcher import cli as run
from tfdp.cluster import ClusterConfig

FAKE_WORKER = worker_script("fake_worker.py")
LAUNCH_TIMEOUT = 60


def test_free_ports_are_distinct():
    ports = run.free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


def test_tf_configs_parse_back():
    configs = run.tf_configs(3, [1001, 1002, 1003])
    parsed = [ClusterConfig.from_json(c) for c in configs]
    assert [p.rank for p in parsed] == [0, 1, 2]
    assert parsed[0].workers == ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"]
    assert json.loads(configs[1])["task"] == {"type": "worker", "index": 1}


def test_parse_args():
    args = run.parse_args(["--workers", "2", "--cpu-replicas", "4", "--", "python", "t.py", "--x"])
    assert (args.workers, args.cpu_replicas, args.command) == (2, 4, ["python", "t.py", "--x"])
    assert (args.max_restarts, args.min_workers, args.grace_period) == (0, 2, 30.0)
    args = run.parse_args(["--workers", "3", "--max-restarts", "2", "--min-workers", "2",
                           "--grace-period", "5", "--", "x"])
    assert (args.max_restarts, args.min_workers, args.grace_period) == (2, 2, 5.0)
    for bad in (["--workers", "0", "--", "x"], ["--workers", "2"], ["--workers", "2", "--cpu-replicas", "0", "--", "x"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


@pytest.mark.parametrize("flags,problem", [
    (["--max-restarts", "1", "--min-workers", "3"], "--min-workers 3: must be between 1 and --workers 2"),
    (["--max-restarts", "1", "--min-workers", "0"], "--min-workers 0: must be between 1 and --workers 2"),
    (["--min-workers", "1"], "--min-workers 1 needs --max-restarts"),
    (["--max-restarts", "-1"], "--max-restarts -1: must be 0 or more"),
    (["--grace-period", "-1"], "--grace-period -1: must be 0 or more seconds"),
])
def test_parse_args_rejects_bad_restart_flags(flags, problem, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--workers", "2", *flags, "--", "x"])
    assert problem in capsys.readouterr().err


def test_log_dir_that_cannot_be_created_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        run.parse_args(["--workers", "1", "--log-dir", str(tmp_path / "file" / "logs"), "--", "x"])
    assert f"--log-dir {tmp_path}/file/logs: cannot create it (Not a directory)" in \
        capsys.readouterr().err


def test_launcher_does_not_import_tensorflow():
    code = ("import sys, tfdp.run, tfdp.cluster, tfdp.launcher.processes, tfdp.launcher.hosts, "
            "tfdp.launcher.policy, tfdp.launcher.remote, tfdp.protocol, tfdp.resilience; "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr


# Worker 1 fails (exit 7) only once worker 0 has printed its line (a file next to the script
# says so), so that tfdp-run's stop of worker 0 cannot cut that line on a loaded host.
HELLO = ("import os, sys, time; r = int(os.environ['TFDP_RANK']); print('hello', r, flush=True);"
         "done = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'printed-0');"
         "r == 0 and open(done, 'w').close();"
         "end = time.monotonic() + 30\n"
         "while r == 1 and not os.path.exists(done) and time.monotonic() < end: time.sleep(0.01)\n"
         "open(os.environ['TFDP_READY_FILE'], 'w').close(); sys.exit(7 if r == 1 else 0)")


def test_terminal_shows_the_chief_and_the_failed_workers_tail(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(HELLO)
    logs = tmp_path / "logs"
    proc = subprocess.run(tfdp_run_command(script, flags=("--log-dir", logs)),
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert proc.returncode == 7, out
    assert f"[tfdp-run] each worker's output: {logs}/attempt-0/worker-<slot>.log; the terminal " \
           "shows worker 0's (the chief) (--output all: every worker)\n" in out
    assert "[w0] hello 0\n" in out
    # Worker 1's line is not on the terminal as it runs: only in the failure report, once.
    report = (f"[tfdp-run] worker 1 failed (rank 1, slot 1, host {socket.gethostname()}); last 1 "
              f"lines of {logs}/attempt-0/worker-1.log:\n[w1] hello 1\n")
    assert report in out and out.count("hello 1") == 1, out
    assert (logs / "attempt-0" / "worker-0.log").read_text() == "hello 0\n"
    assert (logs / "attempt-0" / "worker-1.log").read_text() == "hello 1\n"


def test_output_all_shows_every_worker_prefixed(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(HELLO)
    proc = subprocess.run(tfdp_run_command(script, flags=("--output", "all", "--log-dir",
                                                          tmp_path / "logs")),
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout
    assert proc.returncode == 7, out
    assert "[w1] hello 1\n" in out and "[w0] hello 0\n" in out and out.count("hello 1") == 1
    assert "the terminal shows every worker" in out
    assert (f"worker 1 failed (rank 1, slot 1, host {socket.gethostname()}); its output is above; "
            f"full log: {tmp_path}/logs/attempt-0/worker-1.log") in out
    ok = tmp_path / "ok.py"
    ok.write_text("import os; print(os.environ['TF_CONFIG'])")
    proc = subprocess.run(tfdp_run_command(ok, workers=3, flags=("--output", "all")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.count('"worker": ["127.0.0.1:') == 3


@pytest.mark.parametrize("flags,env,expected", [
    ((), {}, "2"),                                    # quiet by default
    ((), {"TF_CPP_MIN_LOG_LEVEL": "0"}, "0"),         # the user's setting wins
    (("--tf-cpp-logs",), {}, "None"),                 # asked for TensorFlow's C++ lines
])
def test_workers_do_not_print_tensorflow_cpp_info_lines_by_default(tmp_path, flags, env,
                                                                   expected):
    script = tmp_path / "w.py"
    script.write_text("import os; print('level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))")
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run(tfdp_run_command(script, workers=1, flags=(*flags, "--log-dir", tmp_path)),
                          capture_output=True, text=True, timeout=60, env={**environ, **env})
    assert proc.returncode == 0 and f"[w0] level {expected}\n" in proc.stdout, proc.stdout


def test_failure_report_is_the_last_40_lines(tmp_path):
    code, out = launch_fake(tmp_path, {"1@0": "chatty:100:3", "0@0": "block"}, "--log-dir",
                            str(tmp_path / "logs"))
    assert code == 3, out
    lines = [line for line in out.splitlines() if line.startswith("[w1] ")]
    assert lines == [f"[w1] line {i}" for i in range(60, 100)], out
    assert "worker 1 failed (rank 1, slot 1, host " in out and "; last 40 lines of " in out
    log = (tmp_path / "logs" / "attempt-0" / "worker-1.log").read_text().splitlines()
    assert log[1:] == [f"line {i}" for i in range(100)]  # the whole output is in the log


def test_job_timeout(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text("import time\nwhile True: time.sleep(0.1)")
    proc = subprocess.run(tfdp_run_command(script, flags=("--timeout", "2", "--start-timeout", "0")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == run.EXIT_TIMEOUT
    assert "exceeded --timeout 2 s" in proc.stdout


# --- restarts, membership and signals, with TensorFlow-free workers ----------------------------

def _fake_env(tmp_path, plan):
    # TMPDIR: tfdp-run's default log directory lands in the test's own directory.
    return worker_env(FAKE_OUT=tmp_path, FAKE_PLAN=json.dumps(plan), TMPDIR=tmp_path)


def _command(*flags, workers=2):
    return tfdp_run_command(FAKE_WORKER, workers=workers, flags=flags)


def launch_fake(tmp_path, plan, *flags, workers=2):
    """Runs tfdp-run over fake workers to the end; returns (exit code, output)."""
    return run_job(_command(*flags, workers=workers), _fake_env(tmp_path, plan), LAUNCH_TIMEOUT)


class Running:
    """tfdp-run over fake workers in the background, for sending it signals."""

    def __init__(self, tmp_path, plan, *flags, workers=2):
        self.tmp_path = tmp_path
        self.proc = start_job(_command(*flags, workers=workers), _fake_env(tmp_path, plan))

    def wait_for_files(self, *names):
        wait_until(lambda: all((self.tmp_path / n).exists() for n in names) or
                   self.proc.poll() is not None, f"files {names}", LAUNCH_TIMEOUT)
        assert self.proc.poll() is None, self.proc.communicate()[0]

    def finish(self):
        return finish_job(self.proc, LAUNCH_TIMEOUT)


def test_restart_after_a_killed_worker(tmp_path):
    code, out = launch_fake(tmp_path, {"1@0": "kill", "0@0": "block"}, "--max-restarts", "2")
    assert code == 0, out
    assert "[tfdp-run] restart 1/2: worker 1 exited with 137 (SIGKILL)\n" in out
    assert (tmp_path / "SIGTERM-s0-a0").exists()  # the survivor was stopped, not left running
    seen = fake_worker_starts(tmp_path)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [seen[(s, 0)]["restarts_left"] for s in (0, 1)] == ["2", "2"]
    assert [seen[(s, 1)]["restarts_left"] for s in (0, 1)] == ["1", "1"]
    assert {r["min_workers"] for r in seen.values()} == {"2"}
    assert {r["grace"] for r in seen.values()} == {"30"}
    # Every attempt has its own control directory, shared by its workers.
    assert seen[(0, 0)]["control_dir"] == seen[(1, 0)]["control_dir"]
    assert seen[(0, 1)]["control_dir"] == seen[(1, 1)]["control_dir"]
    assert seen[(0, 0)]["control_dir"] != seen[(0, 1)]["control_dir"]
    for (slot, attempt), r in seen.items():
        config = ClusterConfig.from_dict(r["tf_config"])
        assert (config.rank, config.num_workers, r["rank"]) == (slot, 2, slot)


def test_without_max_restarts_a_failure_ends_the_job(tmp_path):
    code, out = launch_fake(tmp_path, {"1@0": "kill", "0@0": "block"})
    assert code == 137, out
    assert "worker 1 exited with code 137 (SIGKILL); stopping the other workers" in out
    assert "restart 1/" not in out and sorted(fake_worker_starts(tmp_path)) == [(0, 0), (1, 0)]


def test_restarts_exhausted_exit_with_the_workers_code(tmp_path):
    code, out = launch_fake(tmp_path, {"1@*": "exit:7", "0@*": "block"}, "--max-restarts", "1")
    assert code == 7, out
    assert "[tfdp-run] restart 1/1: worker 1 exited with 7\n" in out
    assert "[tfdp-run] restarts exhausted (1/1): worker 1 exited with 7\n" in out
    assert sorted(fake_worker_starts(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_preempted_workers_restart_and_are_not_interrupted(tmp_path):
    # Every worker exits 143 by itself (as after tfdp's agreed backup): the launcher lets them
    # finish instead of signalling the later ones in the middle of their backup.
    code, out = launch_fake(tmp_path, {"*@0": "exit:143"}, "--max-restarts", "1")
    assert code == 0, out
    assert "exited with 143 (SIGTERM, preempted)\n" in out and "restart 1/1: worker" in out
    assert not list(tmp_path.glob("SIGTERM-*"))


def test_worker_that_does_not_exit_with_a_preempted_peer_gets_sigterm(tmp_path):
    # Guard for the test above: a peer that does not follow a 143 within the grace period is
    # SIGTERMed, so "no SIGTERM file" there is a real observation.
    code, out = launch_fake(tmp_path, {"1@0": "exit:143", "0@0": "block"}, "--max-restarts", "1",
                            "--grace-period", "0.3")
    assert code == 0, out
    assert (tmp_path / "SIGTERM-s0-a0").exists() and "restart 1/1: worker 1 exited with 143" in out


def test_slot_failing_at_every_start_is_dropped(tmp_path):
    # Slot 0 (the chief) dies mid-training, then fails at every start: the job finishes on
    # slots 1 and 2, renumbered as ranks 0 and 1 (slot 1 is the new chief).
    plan = {"0@0": "kill", "*@0": "block", "0@*": "crash:4"}
    code, out = launch_fake(tmp_path, plan, "--max-restarts", "3", "--min-workers", "2",
                            workers=3)
    assert code == 0, out
    assert "[tfdp-run] restart 1/3: worker 0 exited with 137 (SIGKILL)\n" in out
    assert "[tfdp-run] restart 2/3: worker 0 exited with 4\n" in out
    assert ("[tfdp-run] worker 0 dropped: it exited with 4 before restart 1 completed its first "
            "step; continuing on 2 workers\n") in out
    seen = fake_worker_starts(tmp_path)
    assert sorted(k for k in seen if k[1] == 2) == [(1, 2), (2, 2)]
    survivors = [ClusterConfig.from_dict(seen[(slot, 2)]["tf_config"]) for slot in (1, 2)]
    assert [c.rank for c in survivors] == [0, 1] and survivors[0].is_chief
    assert survivors[0].workers == survivors[1].workers and len(survivors[0].workers) == 2
    assert [seen[(slot, 2)]["rank"] for slot in (1, 2)] == [0, 1]
    assert "[w0] fake worker slot 1 rank 0 attempt 2: ok" in out


def test_slot_is_not_dropped_below_min_workers(tmp_path):
    plan = {"2@0": "kill", "*@0": "block", "2@*": "crash:4", "1@2": "crash:5"}
    code, out = launch_fake(tmp_path, plan, "--max-restarts", "5", "--min-workers", "2",
                            workers=3)
    assert code == 5, out
    assert "worker 2 dropped:" in out
    assert ("worker 1 cannot come back (it exited with 5 before restart 2 completed its first "
            "step) and dropping it would leave 1 worker(s), below --min-workers 2; stopping the "
            "job") in out
    assert not any(attempt == 3 for _, attempt in fake_worker_starts(tmp_path))


def test_eviction_drops_the_named_rank(tmp_path):
    code, out = launch_fake(tmp_path, {"*@0": "evict:1"}, "--max-restarts", "1",
                            "--min-workers", "2", workers=3)
    assert code == 0, out
    assert "[tfdp-run] restart 1/1: worker 1 evicted: fake straggler\n" in out
    assert ("[tfdp-run] worker 1 dropped: evicted by the job: fake straggler; continuing on 2 "
            "workers\n") in out
    seen = fake_worker_starts(tmp_path)
    assert sorted(k for k in seen if k[1] == 1) == [(0, 1), (2, 1)]
    assert seen[(2, 1)]["rank"] == 1 and seen[(2, 1)]["restarts_left"] == "0"
    assert not list(tmp_path.glob("SIGTERM-*"))  # they exited together; nobody was signalled


def test_eviction_with_another_exit_code(tmp_path, monkeypatch):
    # TFDP_EVICT_EXIT_CODE (for schedulers that retry only codes >= 128): tfdp-run reads the
    # same variable as the workers.
    monkeypatch.setenv("TFDP_EVICT_EXIT_CODE", "200")
    code, out = launch_fake(tmp_path, {"*@0": "evict:1"}, "--max-restarts", "1",
                            "--min-workers", "2", workers=3)
    assert code == 0, out
    assert "[tfdp-run] restart 1/1: worker 1 evicted: fake straggler\n" in out
    assert "exited with code 200;" in out and not list(tmp_path.glob("SIGTERM-*"))
    monkeypatch.setenv("TFDP_EVICT_EXIT_CODE", "x")
    code, out = launch_fake(tmp_path, {}, workers=1)
    assert code == 2 and "TFDP_EVICT_EXIT_CODE='x' is not an exit code from 1 to 255" in out


def test_eviction_below_min_workers_is_a_plain_restart(tmp_path):
    code, out = launch_fake(tmp_path, {"*@0": "evict:1"}, "--max-restarts", "1")
    assert code == 0, out
    assert ("cannot evict worker 1: 1 worker(s) would remain, below --min-workers 2; restarting "
            "on the same 2 workers") in out
    assert sorted(fake_worker_starts(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_worker_that_never_joins_is_restarted(tmp_path):
    code, out = launch_fake(tmp_path, {"1@0": "never-join"}, "--max-restarts", "1",
                            "--start-timeout", "0.5")
    assert code == 0, out
    assert "[tfdp-run] restart 1/1: worker 1 did not join the cluster within 0.5 s\n" in out
    # The worker that never joined is named with its output.
    assert "[w1] fake worker slot 1 rank 1 attempt 0: never-join\n" in out, out


def test_a_failed_start_gives_peers_waiting_to_join_the_short_grace(tmp_path):
    # Worker 1 fails before joining; worker 0 waits for it in the strategy constructor, where
    # SIGTERM does not end it. Nobody has trained, so the full grace period (600 s here)
    # would only be lost: worker 0 is SIGKILLed after NEVER_JOINED_GRACE_SECONDS.
    code, out = launch_fake(tmp_path, {"1@0": "crash-when-waited:3", "0@0": "wait-for-peers"},
                            "--grace-period", "600")
    assert code == 3, out
    assert ("worker(s) [0] still running after the grace period "
            f"({run.NEVER_JOINED_GRACE_SECONDS:g} s); sending SIGKILL") in out, out
    assert (tmp_path / "SIGTERM-s0-a0").exists()  # it got SIGTERM first, and ignored it


def test_guard_a_peer_that_joined_gets_the_whole_grace_period(tmp_path):
    # The same failure after worker 0 has joined and trained: it may be backing up, so it
    # gets all of --grace-period (longer than the short grace, to tell them apart).
    grace = run.NEVER_JOINED_GRACE_SECONDS + 1
    job = Running(tmp_path, {"1@0": "exit:3", "0@0": "ignore-term"}, "--grace-period",
                  f"{grace:g}")
    job.wait_for_files("stepped-s0-a0")
    code, out = job.finish()
    assert code == 3, out
    assert f"worker(s) [0] still running after the grace period ({grace:g} s)" in out, out


def test_sigterm_to_the_launcher_is_forwarded_and_not_restarted(tmp_path):
    job = Running(tmp_path, {"*@*": "block"}, "--max-restarts", "2")
    job.wait_for_files("stepped-s0-a0", "stepped-s1-a0")
    job.proc.send_signal(signal.SIGTERM)
    code, out = job.finish()
    assert code == 143, out
    assert (tmp_path / "SIGTERM-s0-a0").exists() and (tmp_path / "SIGTERM-s1-a0").exists()
    assert "received SIGTERM; forwarding to all workers" in out
    assert "restart 1/" not in out and sorted(fake_worker_starts(tmp_path)) == [(0, 0), (1, 0)]


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    job = Running(tmp_path, {"*@*": "block", "1@*": "ignore-term"}, "--max-restarts", "2",
                  "--grace-period", "0.5")
    job.wait_for_files("stepped-s0-a0", "stepped-s1-a0")
    job.proc.send_signal(signal.SIGTERM)
    code, out = job.finish()
    assert code == 143, out
    assert (tmp_path / "SIGTERM-s1-a0").exists()  # it got SIGTERM, and did not obey it
    assert "worker(s) [1] still running after the grace period (0.5 s); sending SIGKILL" in out
    pid = fake_worker_starts(tmp_path)[(1, 0)]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "restart 1/" not in out


def test_second_signal_kills_at_once(tmp_path):
    # A grace period far beyond the test's own timeout: only the second SIGTERM can end it.
    job = Running(tmp_path, {"*@*": "ignore-term"}, "--grace-period", "600")
    job.wait_for_files("stepped-s0-a0", "stepped-s1-a0")
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for_files("SIGTERM-s0-a0", "SIGTERM-s1-a0")
    job.proc.send_signal(signal.SIGTERM)
    code, out = job.finish()
    assert code == 143, out
    assert "received SIGTERM again; killing all workers" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    # The workers run in sessions of their own, out of reach of a kill aimed at the launcher's
    # group: only the kernel's parent-death signal ends them (without it they block on until
    # the fake worker's own 60 s alarm, far past this test's bound).
    job = Running(tmp_path, {"*@*": "block"})
    job.wait_for_files("stepped-s0-a0", "stepped-s1-a0")
    pids = [fake_worker_starts(tmp_path)[(slot, 0)]["pid"] for slot in (0, 1)]
    assert all(process_alive(pid) for pid in pids)
    os.kill(job.proc.pid, signal.SIGKILL)  # the launcher alone
    try:
        wait_until(lambda: not any(process_alive(pid) for pid in pids),
                   "the workers to die with their launcher", 10)
    finally:
        job.finish()
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not list(tmp_path.glob("SIGTERM-*"))  # killed, not asked


def test_sigterm_while_stopping_after_a_failure_prevents_the_restart(tmp_path):
    # Slot 1 dies; the launcher asks slot 0 to stop (it ignores SIGTERM); tfdp-run is
    # SIGTERMed meanwhile: no restart, exit 143.
    job = Running(tmp_path, {"1@0": "kill", "0@0": "ignore-term"}, "--max-restarts", "2",
                  "--grace-period", "600")
    job.wait_for_files("SIGTERM-s0-a0")
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for_files("SIGTERM-s0-a0-2")  # the launcher passed its SIGTERM on
    job.proc.send_signal(signal.SIGTERM)
    code, out = job.finish()
    assert code == 143, out
    assert "received SIGTERM; forwarding to all workers" in out
    assert "received SIGTERM again; killing all workers" in out
    assert "restart 1/" not in out and sorted(fake_worker_starts(tmp_path)) == [(0, 0), (1, 0)]


def test_ctrl_c_is_forwarded_and_not_restarted(tmp_path):
    job = Running(tmp_path, {"*@*": "block"}, "--max-restarts", "2")
    job.wait_for_files("stepped-s0-a0", "stepped-s1-a0")
    job.proc.send_signal(signal.SIGINT)
    code, out = job.finish()
    assert code == 130, out
    assert (tmp_path / "SIGINT-s0-a0").exists() and (tmp_path / "SIGINT-s1-a0").exists()
    assert "received SIGINT; forwarding to all workers" in out
    assert "restart 1/" not in out


def test_timeout_bounds_the_job_across_restarts(tmp_path):
    # Each attempt fails after 0.3 s and 100 restarts are allowed: a per-attempt timeout would
    # never fire (the job would end with the workers' 3 after the restarts); a job-wide one does.
    code, out = launch_fake(tmp_path, {"*@*": "sleep-exit:0.3:3"}, "--max-restarts", "100",
                            "--timeout", "1.5", "--start-timeout", "0")
    assert code == run.EXIT_TIMEOUT, out
    assert "[tfdp-run] restart 1/100: worker" in out
    assert "exceeded --timeout 1.5 s" in out


def test_command_that_cannot_start(tmp_path):
    proc = subprocess.run(tfdp_run_command(tmp_path / "no-such-program", python=None),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 127
    assert "cannot start the worker command" in proc.stdout


@pytest.mark.parametrize("waitid", [True, False], ids=["waitid", "polling"])
def test_launcher_in_process(tmp_path, monkeypatch, waitid):
    # The Launcher API directly, with and without os.waitid (macOS before Python 3.13 has none:
    # the launcher then polls).
    import io

    from tfdp.launcher import processes as launch
    from tfdp.launcher import policy as supervisor

    monkeypatch.setattr(launch, "_HAVE_WAITID", waitid and launch._HAVE_WAITID)
    out = io.StringIO()
    launcher = run.Launcher([sys.executable, FAKE_WORKER], supervisor.Policy(3, 3, 2),
                            env=_fake_env(tmp_path, {"1@0": "kill", "*@0": "block",
                                                     "1@*": "crash:4"}),
                            grace_seconds=5, out=out, log_dir=str(tmp_path / "logs"))
    assert launcher.run(start_timeout=30) == 0, out.getvalue()
    assert "restart 1/3: worker 1 exited with 137 (SIGKILL)\n" in out.getvalue()
    assert "worker 1 dropped:" in out.getvalue()
    assert sorted(k for k in fake_worker_starts(tmp_path) if k[1] == 2) == [(0, 2), (2, 2)]


def test_without_tensorflow_the_launcher_works_and_tfdp_says_what_to_install():
    # TensorFlow is an extra of the package; tfdp-run and tfdp.cluster must not need it, and a
    # TensorFlow-side name must say how to install it instead of a bare ModuleNotFoundError.
    code = ("import sys; sys.modules['tensorflow'] = None\n"  # makes `import tensorflow` fail
            "import tfdp, tfdp.run, tfdp.cluster\n"
            "try:\n"
            "    tfdp.DataParallelStrategy\n"
            "except ImportError as e:\n"
            "    print('ERROR', e)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "ERROR tfdp needs TensorFlow" in out.stdout and "tfdp[cpu]" in out.stdout, out.stdout


def test_free_ports_avoid_the_previous_attempts():
    # A restart must get ports no worker of the previous attempt used; the kernel alone may
    # hand the same free port out again (seen: a restart over ssh reused 127.0.0.3:43099).
    from tfdp.launcher.remote import free_ports

    first = free_ports(4)
    again = free_ports(4, avoid=first)
    assert len(set(again)) == 4 and not set(first) & set(again)
    with pytest.raises(OSError, match="no 1 free ports"):
        free_ports(1, host="127.0.0.1", avoid=range(0, 65536))


def test_free_ports_come_from_below_the_ephemeral_range(monkeypatch):
    # A port in the kernel's ephemeral range can become some outbound connection's local port
    # before the worker binds it (a CI run: "Could not start gRPC server" on such a port).
    from tfdp.launcher import remote

    low, _ = remote._ephemeral_ports()
    ports = remote.free_ports(16, host="127.0.0.1")
    assert len(set(ports)) == 16 and all(remote._LOWEST_PORT <= p < low for p in ports)
    # Guard: where the range leaves no room below it, the kernel chooses (in its range).
    monkeypatch.setattr(remote, "_ephemeral_ports", lambda: (remote._LOWEST_PORT + 10, 60999))
    assert all(p >= remote._LOWEST_PORT + 10 for p in remote.free_ports(4, host="127.0.0.1"))


@pytest.mark.slow
def test_a_test_job_past_its_timeout_reports_where_each_process_waited(tmp_path):
    # The suite's own diagnosis of a hang (tests/launching.py): a job that never ends is
    # killed at its timeout, and the error carries its processes' Python stacks (a child's
    # too), which is what names the wait of a job that hangs only in CI.
    script = tmp_path / "hangs.py"
    script.write_text("import subprocess, sys, time\n"
                      "def parent_waits_here():\n"
                      "    subprocess.run([sys.executable, '-c', 'import time\\n"
                      "def child_waits_here():\\n    time.sleep(120)\\nchild_waits_here()'])\n"
                      "print('started', flush=True)\n"
                      "parent_waits_here()\n")
    env = dict(os.environ, TFDP_TEST_OUT=str(tmp_path))
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_job([sys.executable, str(script)], env, timeout=10)
    report = str(raised.value)
    assert "parent_waits_here" in report and "child_waits_here" in report, report
    assert "started" in report, report


def test_the_remote_side_writes_a_control_file_tfdp_run_sends_into_the_workers_directory(tmp_path):
    # tfdp.launcher.remote, run here as it runs on a host reached over ssh: a
    # {"file": ..., "text": ...} line on its stdin becomes a file in the worker's private
    # control directory (how a peer's exit reaches workers on other hosts); the worker below
    # waits for it (bounded) and prints it. A name with a directory in it is not written.
    from tfdp.launcher import remote
    from tfdp.protocol import CONTROL_DIR_ENV, PEER_EXITED_FILE

    worker = ("import os, sys, time\n"
              f"d = os.environ[{CONTROL_DIR_ENV!r}]\n"
              f"p = os.path.join(d, {PEER_EXITED_FILE!r})\n"
              "end = time.monotonic() + 60\n"
              "while not os.path.exists(p) and time.monotonic() < end:\n"
              "    time.sleep(0.02)\n"
              "escaped = os.path.exists(os.path.join(os.path.dirname(d), 'escape.json'))\n"
              "print('GOT', open(p).read(), sorted(os.listdir(d)), escaped, flush=True)\n")
    job = {"mode": "run", "command": [sys.executable, "-c", worker], "cwd": str(tmp_path),
           "env": {}, "host": "here", "private_env": {CONTROL_DIR_ENV: ""}, "watch": []}
    proc = subprocess.Popen([sys.executable, remote.__file__], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        lines = [job, {"file": "../escape.json", "text": "no"},
                 {"file": PEER_EXITED_FILE, "text": '{"slot": 1}'}]
        proc.stdin.write("".join(json.dumps(m) + "\n" for m in lines).encode())
        proc.stdin.flush()  # stdin stays open: its end would kill the worker
        out = proc.stdout.readline().decode()  # the worker's line (bounded by its 60 s)
        proc.stdin.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.strip() == f'GOT {{"slot": 1}} [\'{PEER_EXITED_FILE}\'] False', out
