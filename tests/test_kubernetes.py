"""Kubernetes without TFJob: a pod of an indexed Job or a JobSet finds its cluster from
JOB_COMPLETION_INDEX, HOSTNAME and the manifest's variables (tfdp.cluster.kubernetes).

Pure parser tests first (no TensorFlow); then real runs that emulate the pods as processes on
127.0.0.1, each with exactly a pod's environment and no TF_CONFIG, training
tests/workers/pod_train.py like one device on the same global batch.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from launching import worker_env, worker_script
from tfdp.cluster import ClusterConfig, ClusterConfigError, kubernetes

# --- the pods' environments ----------------------------------------------------------------


def indexed_pod(index, count=3, job="train", subdomain="train", **extra):
    """What a pod of the docs' indexed Job sees: Kubernetes' index and hostname, the
    manifest's TFDP_NUM_WORKERS and TFDP_SUBDOMAIN."""
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{job}-{index}",
           "TFDP_NUM_WORKERS": str(count), "TFDP_SUBDOMAIN": subdomain}
    env.update(extra)
    return env


def jobset_pod(job_index, pod_index, replicas=2, per_job=2, jobset="train", rjob="worker",
               **extra):
    """What a pod of the docs' JobSet sees (the annotations through the downward API)."""
    env = {"JOB_COMPLETION_INDEX": str(pod_index), "JOB_INDEX": str(job_index),
           "HOSTNAME": f"{jobset}-{rjob}-{job_index}-{pod_index}",
           "JOBSET_NAME": jobset, "REPLICATED_JOB_NAME": rjob,
           "REPLICATED_JOB_REPLICAS": str(replicas), "TFDP_NUM_WORKERS": str(replicas * per_job)}
    env.update(extra)
    return env


# --- indexed Job -----------------------------------------------------------------------------

def test_indexed_job_of_three_pods():
    hosts = [f"train-{i}.train:20000" for i in range(3)]
    for index in range(3):
        c = ClusterConfig.from_env(indexed_pod(index))
        assert c.source == "Kubernetes indexed Job"
        assert c.workers == hosts and c.cluster_spec == {"worker": tuple(hosts)}
        assert c.rank == index and c.task_type == "worker" and c.task_index == index
        assert c.is_chief == (index == 0)
        assert c.notes == (f"Job train, pod {index} of 3",)
    assert "rank 2 of 3 worker(s) (worker 2 at train-2.train:20000)" in \
        ClusterConfig.from_env(indexed_pod(2)).describe()


def test_job_name_comes_from_the_hostname_and_may_hold_dashes_and_digits():
    c = ClusterConfig.from_env(indexed_pod(1, count=12, job="resnet-50-run-7", subdomain="svc"))
    assert c.workers[0] == "resnet-50-run-7-0.svc:20000"
    assert c.workers[11] == "resnet-50-run-7-11.svc:20000" and c.rank == 1


def test_port_base_and_address_template():
    c = ClusterConfig.from_env(indexed_pod(0, TFDP_PORT_BASE="2222"))
    assert c.workers == [f"train-{i}.train:2222" for i in range(3)]
    fqdn = "{hostname}.{subdomain}.team-a.svc.cluster.local:{port}"
    c = ClusterConfig.from_env(indexed_pod(0, TFDP_ADDRESS_TEMPLATE=fqdn))
    assert c.workers[2] == "train-2.train.team-a.svc.cluster.local:20000"
    c = ClusterConfig.from_env(indexed_pod(1, TFDP_ADDRESS_TEMPLATE="127.0.0.1:{rank_port}",
                                           TFDP_PORT_BASE="30000"))
    assert c.workers == ["127.0.0.1:30000", "127.0.0.1:30001", "127.0.0.1:30002"]
    c = ClusterConfig.from_env(indexed_pod(1, TFDP_ADDRESS_TEMPLATE="w{rank}.local:{port}"))
    assert c.workers == ["w0.local:20000", "w1.local:20000", "w2.local:20000"]


# --- JobSet ----------------------------------------------------------------------------------

def test_jobset_of_two_jobs_of_two_pods_ranks_job_major():
    hosts = [f"train-worker-{j}-{p}.train:20000" for j in range(2) for p in range(2)]
    for job_index in range(2):
        for pod_index in range(2):
            c = ClusterConfig.from_env(jobset_pod(job_index, pod_index))
            assert c.source == "JobSet" and c.workers == hosts
            assert c.rank == job_index * 2 + pod_index
            assert c.workers[c.rank] == f"train-worker-{job_index}-{pod_index}.train:20000"
            assert c.notes == (f"JobSet train, replicated job worker: Job {job_index} of 2, "
                               f"pod {pod_index} of 2",)


def test_jobset_subdomain_defaults_to_its_name_and_can_be_set():
    assert ClusterConfig.from_env(jobset_pod(1, 0, per_job=1)).workers == \
        ["train-worker-0-0.train:20000", "train-worker-1-0.train:20000"]
    c = ClusterConfig.from_env(jobset_pod(0, 0, per_job=1, TFDP_SUBDOMAIN="net"))
    assert c.workers == ["train-worker-0-0.net:20000", "train-worker-1-0.net:20000"]


# --- when the source applies, and which source wins -------------------------------------------

def test_a_one_pod_job_and_a_pod_without_a_count_are_one_worker():
    assert ClusterConfig.from_env(indexed_pod(0, count=1)).source == "single"
    assert ClusterConfig.from_env(indexed_pod(0, count=1)).notes == ()
    assert ClusterConfig.from_env(jobset_pod(0, 0, replicas=1, per_job=1)).source == "single"
    alone = ClusterConfig.from_env({"JOB_COMPLETION_INDEX": "4", "HOSTNAME": "sweep-4"})
    assert alone.source == "single" and alone.num_workers == 1
    assert "JOB_COMPLETION_INDEX=4" in alone.notes[0] and "TFDP_NUM_WORKERS" in alone.notes[0]
    assert ClusterConfig.from_env({"TFDP_NUM_WORKERS": "1"}).source == "single"


def test_tf_config_and_the_earlier_sources_still_win():
    tf_config = '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}'
    c = ClusterConfig.from_env(indexed_pod(0, TF_CONFIG=tf_config))
    assert c.source == "TF_CONFIG" and c.workers == ["a:1", "b:1"] and c.rank == 1
    assert ClusterConfig.from_env(jobset_pod(0, 0, TF_CONFIG=tf_config)).source == "TF_CONFIG"
    sm = {"SM_HOSTS": '["x", "y"]', "SM_CURRENT_HOST": "y"}
    assert ClusterConfig.from_env(indexed_pod(0, **sm)).source == "SM_HOSTS"
    # ...and a malformed pod environment does not matter when TF_CONFIG is there.
    assert ClusterConfig.from_env(indexed_pod(7, TF_CONFIG=tf_config)).source == "TF_CONFIG"


# --- errors: every malformed or missing variable, named, with its value and the fix ----------

@pytest.mark.parametrize("env,variable,says", [
    (indexed_pod(3, count=2), "JOB_COMPLETION_INDEX='3'", "not below TFDP_NUM_WORKERS=2"),
    (indexed_pod(1, count=1), "JOB_COMPLETION_INDEX='1'", "not below TFDP_NUM_WORKERS=1"),
    (indexed_pod(0, JOB_COMPLETION_INDEX="-1"), "JOB_COMPLETION_INDEX='-1'", "integer"),
    (indexed_pod(0, JOB_COMPLETION_INDEX="one"), "JOB_COMPLETION_INDEX='one'", "integer"),
    ({"TFDP_NUM_WORKERS": "3"}, "JOB_COMPLETION_INDEX=None", "not a pod of an indexed Job"),
    (indexed_pod(0, TFDP_NUM_WORKERS="three"), "TFDP_NUM_WORKERS='three'", "integer >= 1"),
    (indexed_pod(0, TFDP_NUM_WORKERS="0"), "TFDP_NUM_WORKERS='0'", "integer >= 1"),
    (indexed_pod(0, TFDP_SUBDOMAIN=""), "TFDP_SUBDOMAIN=''", "headless Service"),
    (indexed_pod(0, TFDP_SUBDOMAIN="My_Service"), "TFDP_SUBDOMAIN='My_Service'", "DNS label"),
    (indexed_pod(1, HOSTNAME="train-x"), "HOSTNAME='train-x'", "hostNetwork"),
    (indexed_pod(1, HOSTNAME="-1"), "HOSTNAME='-1'", "<job-name>-1"),
    (indexed_pod(1, HOSTNAME=""), "HOSTNAME=''", "unset"),
    (indexed_pod(0, TFDP_PORT_BASE="80"), "TFDP_PORT_BASE='80'", "1024"),
    (indexed_pod(0, TFDP_ADDRESS_TEMPLATE="{host}:{port}"), "TFDP_ADDRESS_TEMPLATE", "KeyError"),
    (indexed_pod(0, TFDP_ADDRESS_TEMPLATE="{hostname}"), "TFDP_ADDRESS_TEMPLATE", "host:port"),
    (indexed_pod(0, TFDP_ADDRESS_TEMPLATE="{0}:{port}"), "TFDP_ADDRESS_TEMPLATE", "IndexError"),
    (indexed_pod(0, TFDP_ADDRESS_TEMPLATE="10.0.0.1:{port}"), "TFDP_ADDRESS_TEMPLATE",
     "several workers one address"),
    (jobset_pod(0, 0, REPLICATED_JOB_NAME=""), "REPLICATED_JOB_NAME=''", "replicatedjob-name"),
    (jobset_pod(0, 0, JOB_INDEX=""), "JOB_INDEX=''", "jobset.sigs.k8s.io/job-index"),
    (jobset_pod(0, 0, JOB_INDEX="x"), "JOB_INDEX='x'", "integer >= 0"),
    (jobset_pod(2, 0), "JOB_INDEX='2'", "not below REPLICATED_JOB_REPLICAS=2"),
    (jobset_pod(0, 0, REPLICATED_JOB_REPLICAS=""), "REPLICATED_JOB_REPLICAS=''",
     "replicatedjob-replicas"),
    (jobset_pod(0, 0, REPLICATED_JOB_REPLICAS="0"), "REPLICATED_JOB_REPLICAS='0'", "integer >= 1"),
    (jobset_pod(0, 0, TFDP_NUM_WORKERS="5"), "TFDP_NUM_WORKERS='5'", "not a multiple"),
    (jobset_pod(0, 2), "JOB_COMPLETION_INDEX='2'", "2 pod(s) per Job"),
    (jobset_pod(1, 1, HOSTNAME="train-worker-0-1"), "HOSTNAME='train-worker-0-1'",
     "differs from 'train-worker-1-1'"),
    (jobset_pod(0, 0, JOBSET_NAME="Train"), "HOSTNAME='train-worker-0-0'", "differs"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_pod_environment_names_variable_value_and_fix(env, variable, says):
    with pytest.raises(ClusterConfigError) as info:
        ClusterConfig.from_env(env)
    message = str(info.value)
    assert variable in message and says in message and "Fix:" in message, message


_VALUES = st.sampled_from(["", "0", "1", "2", "3", "-1", "x", " 2 ", "train", "train-1",
                           "train-worker-0-1", "{hostname}:{rank_port}", "{x}", "80", "30000"])
_NAMES = ["JOB_COMPLETION_INDEX", "HOSTNAME", "TFDP_NUM_WORKERS", "TFDP_SUBDOMAIN",
          "TFDP_ADDRESS_TEMPLATE", "TFDP_PORT_BASE", "JOBSET_NAME", "REPLICATED_JOB_NAME",
          "JOB_INDEX", "REPLICATED_JOB_REPLICAS"]


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional={name: _VALUES for name in _NAMES}))
def test_fuzz_any_pod_environment_is_a_cluster_or_a_clear_error(env):
    try:
        c = ClusterConfig.from_env(env)
    except ClusterConfigError as e:
        assert "Fix:" in str(e)
        return
    assert 0 <= c.rank < c.num_workers and len(set(c.workers)) == len(c.workers)
    if c.source in (kubernetes.INDEXED_JOB, kubernetes.JOBSET):
        assert c.num_workers == int(env["TFDP_NUM_WORKERS"]) > 1
        assert env["HOSTNAME"].strip() in c.workers[c.rank] or "TFDP_ADDRESS_TEMPLATE" in env


# --- real runs: the pods as processes on 127.0.0.1 --------------------------------------------

WORKER = worker_script("pod_train.py")
ROWS, GLOBAL_BATCH = 240, 48  # whole steps of equal rows on 2 and on 3 workers
RUN_TIMEOUT = 300
# Variables of other sources and of a pod, never inherited from the shell that runs pytest.
_FOREIGN = ("TF_CONFIG", "CLUSTER_SPEC", "SM_HOSTS", "SM_CURRENT_HOST", "TFDP_PORT_BASE",
            *_NAMES)


def consecutive_free_ports(n):
    """The first of ``n`` consecutive ports free on 127.0.0.1 (the pods share one IP here, so
    ``{rank_port}`` gives each its own)."""
    for _ in range(100):
        socks = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            for i in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue  # a neighbour was taken: another base
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports on 127.0.0.1")


def run_pods(tmp_path, pods, **common):
    """One process per pod environment in ``pods`` (plus ``common``), started together;
    returns their outputs. Past RUN_TIMEOUT every process group this started is killed."""
    procs, logs = [], []
    try:
        for i, pod in enumerate(pods):
            env = {k: v for k, v in worker_env().items()
                   if k not in _FOREIGN and not k.startswith("SLURM")}
            env.update(pod, **common, TFDP_TEST_OUT=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2",
                       TFDP_CPU_REPLICAS="1")
            log = open(tmp_path / f"pod-{i}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, WORKER], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break  # one pod failed (its peers would wait for it) or out of time
            time.sleep(0.2)  # polling our own processes, bounded by the deadline
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the session this test started for it
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(pods), f"exit codes {codes}\n" + "\n----\n".join(outputs)
    return outputs


def assert_trained_like_one_device(tmp_path, ranks):
    import keras
    from helpers import assert_weights_close, classification_data, initial_weights, mlp, train
    x, y = classification_data(n=ROWS)
    model, _ = train(None, mlp, lambda: keras.optimizers.Adam(0.01), x, y, GLOBAL_BATCH,
                     epochs=1, weights=initial_weights(mlp))
    for rank in ranks:
        saved = np.load(tmp_path / f"weights-{rank}.npz")
        assert_weights_close([saved[f"arr_{i}"] for i in range(len(saved.files))],
                             model.get_weights())


@pytest.mark.slow
@pytest.mark.multiworker
def test_three_pod_indexed_job_trains_like_one_device(tmp_path):
    base = consecutive_free_ports(3)
    outputs = run_pods(tmp_path, [indexed_pod(i) for i in range(3)],
                       TFDP_ADDRESS_TEMPLATE="127.0.0.1:{rank_port}", TFDP_PORT_BASE=str(base),
                       TFDP_TEST_ROWS=str(ROWS), TFDP_TEST_GLOBAL_BATCH=str(GLOBAL_BATCH))
    for rank, out in enumerate(outputs):
        assert (f"rank {rank}: source=Kubernetes indexed Job workers=3 replicas=3 "
                f"address=127.0.0.1:{base + rank}") in out, out
    assert_trained_like_one_device(tmp_path, ranks=(0, 1, 2))


@pytest.mark.slow
@pytest.mark.multiworker
def test_jobset_of_two_jobs_of_one_pod_trains_like_one_device(tmp_path):
    base = consecutive_free_ports(2)
    outputs = run_pods(tmp_path, [jobset_pod(j, 0, per_job=1) for j in range(2)],
                       TFDP_ADDRESS_TEMPLATE="127.0.0.1:{rank_port}", TFDP_PORT_BASE=str(base),
                       TFDP_TEST_ROWS=str(ROWS), TFDP_TEST_GLOBAL_BATCH=str(GLOBAL_BATCH))
    for rank, out in enumerate(outputs):
        assert (f"rank {rank}: source=JobSet workers=2 replicas=2 "
                f"address=127.0.0.1:{base + rank}") in out, out
    assert_trained_like_one_device(tmp_path, ranks=(0, 1))
