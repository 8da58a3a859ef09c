"""horovodrun's environment under tfdp-run (issue 42, item 2): every worker gets
``HOROVOD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``/``CROSS_RANK``/``CROSS_SIZE`` and Open
MPI's ``OMPI_COMM_WORLD_*``, from the rule ``hvd.local_rank()`` etc. answer with
(tfdp.cluster.placement). Pure: the variables of every rank of a few layouts. Real
``tfdp-run -np 2`` jobs, on this machine and on two loopback ssh "hosts": a script reads them
before importing tfdp and they equal what ``hvd.init()`` then reports."""

import json
import sys

import pytest

from launching import run_job, worker_env, worker_script
from tfdp.cluster.placement import horovod_environment, placement_of, shared_host_environment
from tfdp.launcher import processes
from loopback_sshd import launch_over_ssh

LAUNCH_TIMEOUT = 180


def env_of(addresses, rank):
    return horovod_environment(placement_of(addresses, rank))


def test_variables_follow_horovods_definitions():
    hosts = ["a:1", "a:2", "b:1", "b:2"]
    got = [env_of(hosts, r) for r in range(4)]
    assert [e["HOROVOD_RANK"] for e in got] == ["0", "1", "2", "3"]
    assert {e["HOROVOD_SIZE"] for e in got} == {"4"}
    assert [e["HOROVOD_LOCAL_RANK"] for e in got] == ["0", "1", "0", "1"]
    assert {e["HOROVOD_LOCAL_SIZE"] for e in got} == {"2"}
    assert [e["HOROVOD_CROSS_RANK"] for e in got] == ["0", "0", "1", "1"]
    assert {e["HOROVOD_CROSS_SIZE"] for e in got} == {"2"}
    for e in got:
        assert e["OMPI_COMM_WORLD_RANK"] == e["HOROVOD_RANK"]
        assert e["OMPI_COMM_WORLD_SIZE"] == e["HOROVOD_SIZE"]
        assert e["OMPI_COMM_WORLD_LOCAL_RANK"] == e["HOROVOD_LOCAL_RANK"]
        assert e["OMPI_COMM_WORLD_LOCAL_SIZE"] == e["HOROVOD_LOCAL_SIZE"]
    uneven = [env_of(["a:1", "a:2", "a:3", "b:1"], r) for r in range(4)]
    assert [(e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"], e["HOROVOD_CROSS_RANK"],
             e["HOROVOD_CROSS_SIZE"]) for e in uneven] == [
        ("0", "3", "0", "2"), ("1", "3", "0", "1"), ("2", "3", "0", "1"), ("0", "1", "1", "2")]
    with pytest.raises(ValueError):
        placement_of(hosts, 4)


def test_every_worker_of_an_attempt_gets_them_and_remote_ones_too(tmp_path):
    addresses = ["127.0.0.1:1000", "127.0.0.1:1001", "10.0.0.2:1000"]
    attempt = processes.Attempt(["true"], [0, 1, 2], 0, {"HOROVOD_RANK": "stale"}, tmp_path,
                                addresses, [None] * 3)
    for rank, env in enumerate(attempt.envs):
        assert {k: env[k] for k in env_of(addresses, rank)} == env_of(addresses, rank)
        remote = processes.remote_environment(env)
        assert {k: remote[k] for k in env_of(addresses, rank)} == env_of(addresses, rank)
    assert attempt.envs[2]["HOROVOD_LOCAL_RANK"] == "0"
    assert attempt.envs[2]["HOROVOD_CROSS_RANK"] == "1"
    # Placement's GPU rule: the two workers of 127.0.0.1 take GPU memory as needed (else the
    # first one to use a shared GPU reserves it all); the worker alone on its host does not.
    assert [e.get("TF_FORCE_GPU_ALLOW_GROWTH") for e in attempt.envs] == ["true", "true", None]
    assert processes.remote_environment(attempt.envs[0])["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_a_job_that_sets_gpu_memory_growth_itself_keeps_its_value(tmp_path):
    attempt = processes.Attempt(["true"], [0, 1], 0, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"},
                                tmp_path, ["127.0.0.1:1000", "127.0.0.1:1001"], [None] * 2)
    assert [e["TF_FORCE_GPU_ALLOW_GROWTH"] for e in attempt.envs] == ["false", "false"]
    alone = placement_of(["127.0.0.1:1000"], 0)
    assert shared_host_environment(alone, {}) == {}
    shared = placement_of(["127.0.0.1:1000", "127.0.0.1:1001"], 1)
    assert shared_host_environment(shared, {}) == {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}


@pytest.mark.parametrize("where", ["local", "ssh"])
@pytest.mark.slow
@pytest.mark.multiworker
def test_a_script_reads_them_before_importing_tfdp(tmp_path, where, request):
    if where == "ssh":  # two loopback "hosts" (tests/test_hosts.py's sshd), one process each
        launch_over_ssh(tmp_path, request.getfixturevalue("sshd"), "hvd_env.py")
    else:
        environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2)
        cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "--output", "all", "--",
               sys.executable, worker_script("hvd_env.py")]
        code, out = run_job(cmd, environ, LAUNCH_TIMEOUT)
        assert code == 0, out[-4000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"env-{rank}.json").read_text())
        env, hvd = seen["env"], seen["hvd"]
        for name in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"):
            assert env[f"HOROVOD_{name.upper()}"] == str(hvd[name]), (name, seen)
        assert env["OMPI_COMM_WORLD_LOCAL_RANK"] == str(hvd["local_rank"])
        expected = (rank, 2, rank, 2, 0, 1) if where == "local" else (rank, 2, 0, 1, rank, 2)
        # Two workers on one host share its GPUs; one per host does not (placement's rule).
        assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == ("true" if where == "local" else None)
        assert (hvd["rank"], hvd["size"], hvd["local_rank"], hvd["local_size"],
                hvd["cross_rank"], hvd["cross_size"]) == expected
