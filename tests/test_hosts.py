"""tfdp-run on many hosts: the pure host rules, then real ssh to loopback "hosts".

The process tests start a real sshd on 127.0.0.2 and 127.0.0.3 (one port; a client key and host
key made for the test) and reach it through an ssh_config whose aliases tfdp-a, tfdp-b name
those addresses and tfdp-down names 127.0.0.4, where nothing listens (a host whose sshd is
down). They are skipped, with the reason, where OpenSSH's server is not installed (CI installs
it). Workers are tests/workers/fake_worker.py (TensorFlow-free) except for the training
equivalence.
Every wait is bounded; only processes the tests started are signalled, by pid.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from launching import fake_worker_starts, wait_until, worker_env, worker_script
from loopback_sshd import ADDRESSES
from procs import process_alive
from tfdp.launcher import hosts as hosts_lib
from tfdp.launcher import processes as launch
from tfdp.cluster import ClusterConfig
from tfdp.launcher.hosts import Host, HostsError

FAKE_WORKER = worker_script("fake_worker.py")
TIMEOUT = 90


# --- the pure rules -----------------------------------------------------------------------

def test_hosts_and_hostfile_parse_to_the_same_hosts():
    assert hosts_lib.parse_hosts("a:2, b:2,c") == [Host("a", 2), Host("b", 2), Host("c", 1)]
    hostfile = "# cluster\nworker-1 slots=4\n\nworker-2 slots=2   # the small one\nworker-3\n"
    assert hosts_lib.parse_hostfile(hostfile) == [Host("worker-1", 4), Host("worker-2", 2),
                                                  Host("worker-3", 1)]
    placed = hosts_lib.slot_hosts([Host("a", 2), Host("b", 1)])
    assert [h.name for h in placed] == ["a", "a", "b"]
    assert dict(hosts_lib.ranks_by_host(placed)) == {Host("a", 2): [0, 1], Host("b", 1): [2]}


@pytest.mark.parametrize("parse,text,problem", [
    (hosts_lib.parse_hosts, "a:x", "'a:x' must be HOST or HOST:SLOTS"),
    (hosts_lib.parse_hosts, "a:0", "host a has 0 slots"),
    (hosts_lib.parse_hosts, "a:1,a:2", "host a is listed twice"),
    (hosts_lib.parse_hosts, ",", "no host given"),
    (hosts_lib.parse_hostfile, "a slots=2\nb cpus=3\n", "hostfile:2: 'b cpus=3': expected"),
])
def test_bad_hosts_are_errors_naming_the_entry(parse, text, problem):
    with pytest.raises(HostsError) as e:
        parse(text)
    assert problem in str(e.value)


def test_addresses_and_interfaces():
    hosts = [Host("u@a", 2), Host("b", 2)]
    placed = hosts_lib.with_addresses(hosts, ["b=10.0.0.2"], ["eth1"])
    assert [(h.address, h.interface) for h in placed] == [(None, "eth1"), ("10.0.0.2", None)]
    assert [h.default_address for h in placed] == ["a", "10.0.0.2"]  # user@ is not an address
    placed = hosts_lib.with_addresses(hosts, [], ["b=ib0"])
    assert [h.interface for h in placed] == [None, "ib0"]
    with pytest.raises(HostsError, match="c is not one of the hosts"):
        hosts_lib.with_addresses(hosts, ["c=10.0.0.3"])
    # This machine among other hosts: its peers cannot dial "localhost".
    with pytest.raises(HostsError, match="--address localhost=<this machine's address>"):
        hosts_lib.with_addresses([Host("localhost", 1), Host("b", 1)])
    assert hosts_lib.with_addresses([Host("localhost", 2)])[0].is_local


def test_remote_environment_and_ssh_command_line():
    env = {"TF_CONFIG": "{}", "TFDP_RANK": "1", "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": "/x",
           "HOME": "/root", "PATH": "/bin", "MY_DATA": "/data", "NCCL_DEBUG": "WARN"}
    assert launch.remote_environment(env, ["MY_DATA"]) == {
        k: env[k] for k in ("TF_CONFIG", "TFDP_RANK", "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
                            "MY_DATA", "NCCL_DEBUG")}
    ssh = launch.SshConfig(port=2222, config_file="/c", options=("ConnectTimeout=3",))
    argv = ssh.argv(Host("a"), "CMD")
    # The user's options come first: ssh keeps the first value given for an option.
    assert argv[:9] == ["ssh", "-T", "-x", "-F", "/c", "-p", "2222", "-o", "ConnectTimeout=3"]
    assert argv[-2:] == ["a", "CMD"] and "BatchMode=yes" in argv


def test_parse_args_hosts(tmp_path):
    from tfdp.launcher import cli as run
    args = run.parse_args(["--hosts", "a:2,b:1", "--address", "a=10.0.0.1", "-x", "PATH",
                           "--env", "K=V", "--", "python", "t.py"])
    assert args.workers == 3 and [h.address for h in args.host_list] == ["10.0.0.1", None]
    assert args.env_names == ["PATH", "K"] and args.env_values == {"K": "V"}
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\n")
    assert run.parse_args(["--hostfile", str(hostfile), "--", "x"]).workers == 2


@pytest.mark.parametrize("flags,problem", [
    (["--hosts", "a:2", "--workers", "3"], "--workers 3 but the hosts have 2 slots"),
    (["--hosts", "a:2", "--hostfile", "f"], "not allowed with argument"),
    (["--hostfile", "/no/such/file"], "--hostfile /no/such/file: No such file"),
    (["--workers", "2", "--address", "a=1.2.3.4"], "--address/--network-interface need --hosts"),
    (["--hosts", "a:2", "--env", "TFDP_SURELY_UNSET_VARIABLE"], "is not set here"),
    ([], "give --workers N (this machine), or --hosts/--hostfile"),
])
def test_parse_args_rejects_bad_host_flags(flags, problem, capsys):
    from tfdp.launcher import cli as run
    with pytest.raises(SystemExit):
        run.parse_args([*flags, "--", "x"])
    assert problem in capsys.readouterr().err


# --- a real sshd on loopback: tests/loopback_sshd.py ------------------------------------------



def _command(ssh_config, hosts, *flags, worker=(sys.executable, FAKE_WORKER),
             addresses=ADDRESSES):
    """tfdp-run over ssh; the aliases are not resolvable names, so peers get --address."""
    return [sys.executable, "-m", "tfdp.run", "--hosts", hosts, "--ssh-config", ssh_config,
            *addresses, *flags, "--", *worker]


def _env(tmp_path, plan):
    env = dict(os.environ, FAKE_OUT=str(tmp_path), FAKE_PLAN=json.dumps(plan),
               FAKE_EXTRA="passed", TMPDIR=str(tmp_path))
    env.pop("TF_CONFIG", None)
    return env


FAKE_FLAGS = ("-x", "FAKE_OUT", "-x", "FAKE_PLAN", "-x", "FAKE_EXTRA")


class Job:
    """tfdp-run in the background (own session), to signal it and its ssh processes."""

    def __init__(self, command, env):
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def children(self):
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(p) for p in f.read().split()]

    def finish(self):
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode, out


@pytest.mark.slow
@pytest.mark.multiworker
def test_killed_remote_worker_is_restarted_over_ssh(sshd, tmp_path):
    plan = {"*@0": "block"}  # attempt 1: every worker finishes
    job = Job(_command(sshd, "tfdp-a:2,tfdp-b:2", "--max-restarts", "1", *FAKE_FLAGS),
              _env(tmp_path, plan))
    wait_until(lambda: all((tmp_path / f"stepped-s{s}-a0").exists() for s in range(4))
               or job.proc.poll() is not None, "4 workers to train", TIMEOUT)
    os.kill(fake_worker_starts(tmp_path)[(3, 0)]["pid"], signal.SIGKILL)  # worker 3, on host tfdp-b
    code, out = job.finish()
    assert code == 0, out
    assert "[tfdp-run] restart 1/1: worker 3 exited with 137 (SIGKILL)\n" in out
    assert "worker 3 failed (rank 3, slot 3, host tfdp-b)" in out
    # The survivors, on both hosts, got tfdp-run's SIGTERM through ssh.
    assert all((tmp_path / f"SIGTERM-s{s}-a0").exists() for s in (0, 1, 2)), out
    seen = fake_worker_starts(tmp_path)
    assert sorted(seen) == [(s, a) for s in range(4) for a in (0, 1)]
    for (slot, attempt), r in seen.items():
        config = ClusterConfig.from_dict(r["tf_config"])
        assert config.rank == slot and config.workers[slot].startswith(
            "127.0.0.2:" if slot < 2 else "127.0.0.3:")
        assert r["cwd"] == os.getcwd() and r["env"] == {"TF_CPP_MIN_LOG_LEVEL": "2",
                                                        "FAKE_EXTRA": "passed"}
        assert not r["control_dir"].startswith(str(tmp_path))  # private to the remote worker
    # Fresh ports for the restart.
    assert not set(seen[(0, 0)]["tf_config"]["cluster"]["worker"]) & set(
        seen[(0, 1)]["tf_config"]["cluster"]["worker"])


@pytest.mark.slow
@pytest.mark.multiworker
def test_sigterm_reaches_remote_workers_and_no_worker_outlives_its_ssh(sshd, tmp_path):
    os.makedirs(tmp_path / "term")
    job = Job(_command(sshd, "tfdp-a:1,tfdp-b:1", "--network-interface", "tfdp-b=lo",
                       *FAKE_FLAGS, addresses=ADDRESSES[:2]),
              _env(tmp_path / "term", {"*@*": "block"}))
    wait_until(lambda: all((tmp_path / "term" / f"stepped-s{s}-a0").exists() for s in (0, 1))
               or job.proc.poll() is not None, "2 workers to train", TIMEOUT)
    job.proc.send_signal(signal.SIGTERM)
    code, out = job.finish()
    assert code == 143, out
    assert all((tmp_path / "term" / f"SIGTERM-s{s}-a0").exists() for s in (0, 1)), out
    # --network-interface: tfdp-b's address was looked up on tfdp-b (its "lo" is 127.0.0.1).
    assert "host tfdp-b: worker(s) [1] at 127.0.0.1" in out
    term = fake_worker_starts(tmp_path / "term")
    assert term[(0, 0)]["tf_config"]["cluster"]["worker"][1].startswith("127.0.0.1:")

    # SIGKILL one ssh client: the remote side kills its worker (no SIGTERM: it never heard of
    # one), tfdp-run stops the others; SIGKILL tfdp-run itself: no remote worker survives.
    for case in ("ssh", "tfdp-run"):
        out_dir = tmp_path / case
        os.makedirs(out_dir)
        job = Job(_command(sshd, "tfdp-a:2,tfdp-b:2", *FAKE_FLAGS),
                  _env(out_dir, {"*@*": "block"}))
        wait_until(lambda: all((out_dir / f"stepped-s{s}-a0").exists() for s in range(4))
                   or job.proc.poll() is not None, "4 workers to train", TIMEOUT)
        pids = [r["pid"] for r in fake_worker_starts(out_dir).values()]
        assert len(pids) == 4 and all(process_alive(p) for p in pids)
        if case == "ssh":
            os.kill(job.children()[0], signal.SIGKILL)
            code, out = job.finish()
            assert code == 137, out
            assert len(list(out_dir.glob("SIGTERM-*"))) == 3, out
        else:
            job.proc.kill()
            job.proc.wait()
        wait_until(lambda: not any(process_alive(p) for p in pids),
                   f"workers {pids} to end ({case})", TIMEOUT)


@pytest.mark.slow
@pytest.mark.multiworker
def test_host_whose_sshd_is_down_is_dropped_under_min_workers(sshd, tmp_path):
    job = Job(_command(sshd, "tfdp-a:2,tfdp-down:2", "--max-restarts", "2", "--min-workers",
                       "2", *FAKE_FLAGS, addresses=ADDRESSES[:2]), _env(tmp_path, {}))
    code, out = job.finish()
    assert code == 0, out
    assert "[tfdp-run] cannot reach host tfdp-down: ssh exited 255: " in out
    assert "restart 1/2: cannot reach host tfdp-down (worker(s) [2, 3])" in out
    assert ("workers [2, 3] dropped: host tfdp-down could not be reached again after restart 1; "
            "continuing on 2 workers") in out
    seen = fake_worker_starts(tmp_path)
    assert sorted(seen) == [(0, 2), (1, 2)]
    assert [len(r["tf_config"]["cluster"]["worker"]) for r in seen.values()] == [2, 2]


@pytest.mark.slow
@pytest.mark.multiworker
def test_host_whose_sshd_is_down_fails_the_job_naming_it(sshd, tmp_path):
    job = Job(_command(sshd, "tfdp-a:1,tfdp-down:1", "--start-timeout", "60", *FAKE_FLAGS,
                       addresses=ADDRESSES[:2]), _env(tmp_path, {}))
    code, out = job.finish()
    assert code == 255, out
    assert ("[tfdp-run] cannot reach host tfdp-down: ssh exited 255: ssh: connect to host "
            "127.0.0.4 port ") in out and "Connection refused" in out
    assert "did not join" not in out  # ssh's own error, not the start watchdog
    assert fake_worker_starts(tmp_path) == {}  # no worker was started


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_hosts_two_workers_each_train_like_one_device(sshd, tmp_path):
    from helpers import classification_data, initial_weights, mlp, train
    import keras

    global_batch = 32
    # worker_env's PYTHONPATH (tests/helpers.py) reaches the remote workers: tfdp-run passes it.
    env = worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_GLOBAL_BATCH=global_batch, TMPDIR=tmp_path)
    proc = subprocess.run(
        _command(sshd, "tfdp-a:2,tfdp-b:2", "--cpu-replicas", "1",
                 worker=(sys.executable, worker_script("mw_worker.py"))),
        env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[w0] rank 0: 4 replicas, chief=True" in out
    x, y = classification_data(n=256)
    model, _ = train(None, mlp, lambda: keras.optimizers.SGD(0.05, momentum=0.9), x, y,
                     global_batch, epochs=2, weights=initial_weights(mlp))
    for rank in range(4):
        saved = np.load(tmp_path / f"weights-{rank}.npz")
        for i, want in enumerate(model.get_weights()):
            np.testing.assert_allclose(saved[f"arr_{i}"], want, rtol=1e-5, atol=1e-5)
