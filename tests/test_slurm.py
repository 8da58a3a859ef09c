"""tfdp under a real Slurm: a controller and two emulated nodes (n1, n2) on 127.0.0.1.

The module fixture starts Debian's slurmctld and two slurmd (``-N n1``, ``-N n2``, Slurm's
multiple-slurmd mode) with a generated slurm.conf (auth/none, root, free ports, everything under
a temporary directory), and stops them by the pids in their pid files. Every srun/sbatch here
runs with SLURM_CONF pointing at that configuration, so only this test cluster is touched.
Skipped, with the reason, where the daemons are not installed or the user is not root.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import keras

from helpers import classification_data, initial_weights, mlp, train
from procs import process_alive

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "cluster_train.py")
NODES = ("n1", "n2")
START_TIMEOUT = 60
RUN_TIMEOUT = 240
ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "COMPLETING")  # a job not yet ended

_missing = [d for d in ("slurmctld", "slurmd", "srun", "sbatch", "sinfo") if shutil.which(d) is None
            and not os.path.exists(f"/usr/sbin/{d}")]
if _missing:
    pytestmark.append(pytest.mark.skip(
        reason=f"Slurm is not installed ({', '.join(_missing)} missing): apt-get install "
               "slurmctld slurmd slurm-client"))


def _daemon(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_hosts(names):
    """Adds '127.0.0.1 <name>' to /etc/hosts for names that do not resolve; idempotent."""
    with open("/etc/hosts") as f:
        known = {w for line in f if not line.lstrip().startswith("#") for w in line.split()[1:]}
    missing = [n for n in names if n not in known]
    if missing:
        with open("/etc/hosts", "a") as f:
            f.writelines(f"127.0.0.1 {n}\n" for n in missing)


def _write_conf(d):
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(
        f"NodeName={n} NodeHostName={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs=2 "
        "State=UNKNOWN" for n in NODES)
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=tfdptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
AuthType=auth/none
AuthInfo=cred_expire=5
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ReturnToService=2
MpiDefault=none
SchedulerParameters=sched_interval=1
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
    (d / "state").mkdir()
    return conf


class Slurm:
    """The running test cluster: runs clients with its SLURM_CONF."""

    def __init__(self, directory, conf):
        self.dir, self.conf = directory, conf
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("SLURM") and k not in ("TF_CONFIG", "CLUSTER_SPEC", "SM_HOSTS")}
        self.env.update(SLURM_CONF=str(conf), TF_CPP_MIN_LOG_LEVEL="2", TFDP_CPU_REPLICAS="1")

    def run(self, *cmd, timeout=RUN_TIMEOUT, **env):
        proc = subprocess.run(list(cmd), env=dict(self.env, **env), capture_output=True,
                              text=True, timeout=timeout, cwd=HERE)
        return proc.returncode, proc.stdout + proc.stderr

    def job_state(self, job_id):
        code, out = self.run("scontrol", "-o", "show", "job", str(job_id), timeout=30)
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        return fields.get("JobState"), fields

    def wait(self, condition, what, timeout=START_TIMEOUT):
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.2)  # polling a condition with a deadline, not synchronising by time

    def signal_when_held_and_finish(self, job, held, *scancel_args):
        """Waits for ``held()`` (rank 0 holding mid-training), signals the job with ``scancel
        *scancel_args``, waits until it (requeued or not) has finished and returns its
        ``(state, fields)``; cancels it if the test fails on the way."""
        try:
            self.wait(held, "rank 0 to hold before the signal", timeout=RUN_TIMEOUT)
            code, out = self.run("scancel", *scancel_args, str(job), timeout=30)
            assert code == 0, out
            self.wait(lambda: self.job_state(job)[0] not in ACTIVE, "the requeued job to finish",
                      timeout=RUN_TIMEOUT)
        finally:
            if self.job_state(job)[0] in ACTIVE:
                self.run("scancel", str(job), timeout=30)
        return self.job_state(job)

    def pids(self):
        files = [self.dir / "slurmctld.pid"] + [self.dir / f"slurmd-{n}.pid" for n in NODES]
        return [int(f.read_text()) for f in files if f.exists() and f.read_text().strip()]




@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: the test slurmd runs as root (SlurmUser=root, auth/none) and "
                    "the node names n1, n2 must be added to /etc/hosts")
    _ensure_hosts(NODES)
    directory = tmp_path_factory.mktemp("slurm")
    cluster = Slurm(directory, _write_conf(directory))
    try:
        code, out = cluster.run(_daemon("slurmctld"), "-i", "-f", str(cluster.conf), timeout=30)
        assert code == 0, out
        for node in NODES:
            code, out = cluster.run(_daemon("slurmd"), "-f", str(cluster.conf), "-N", node,
                                    timeout=30)
            assert code == 0, out

        def idle():
            _, out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=30)
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            return all(states.get(n) == "idle" for n in NODES)

        cluster.wait(idle, "both nodes idle in sinfo")
        yield cluster
    finally:
        _stop(cluster)


def _stop(cluster):
    """Cancels this cluster's jobs, then stops its daemons by their pid files."""
    try:
        cluster.run("scancel", "--full", "--user", "root", timeout=30)
        cluster.wait(lambda: not cluster.run("squeue", "-h", timeout=30)[1].strip(),
                     "the test jobs to end", timeout=60)
    except Exception as e:  # noqa: BLE001  still stop the daemons below
        print(f"slurm teardown: {e}")
    pids = cluster.pids()
    for pid in pids:
        if process_alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting for our own daemons to exit, bounded
    for pid in pids:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


# --- where tasks land: tfdp's layout against Slurm's own placement (no TensorFlow) ----------

PROBE = ("import json, os; from tfdp.cluster import ClusterConfig; c = ClusterConfig.from_env(); "
         "print('PROBE ' + json.dumps({'rank': c.rank, 'workers': c.workers, 'source': c.source, "
         "'notes': c.notes, 'procid': os.environ.get('SLURM_PROCID'), "
         "'node': os.environ.get('SLURMD_NODENAME')}))")


def _probes(out):
    return [json.loads(line.split("PROBE ", 1)[1]) for line in out.splitlines() if "PROBE " in line]


@pytest.mark.parametrize("args", [
    ("-N2", "-n2"),
    ("-N2", "-n4"),
    ("-N2", "-n3", "-m", "cyclic"),
    ("-N2", "-n5", "-O", "-m", "cyclic"),
    ("-N2", "-n5", "-O", "-m", "plane=2"),
], ids=lambda a: " ".join(a))
def test_every_task_computes_the_same_cluster_slurm_placed(slurm, args):
    code, out = slurm.run("srun", *args, sys.executable, "-c", PROBE, timeout=60)
    assert code == 0, out  # from_env raises if its layout disagrees with SLURM_NODEID/LOCALID
    probes = sorted(_probes(out), key=lambda p: p["rank"])
    n = int(args[args.index("-N2") + 1][2:])
    assert [p["rank"] for p in probes] == list(range(n))
    workers = probes[0]["workers"]
    assert all(p["workers"] == workers and p["source"] == "Slurm" for p in probes)
    for p in probes:
        assert p["rank"] == int(p["procid"])
        assert workers[p["rank"]].split(":")[0] == p["node"]  # the host Slurm ran it on
    assert len({w.split(":")[1] for w in workers}) == n  # emulated nodes share one host


def test_one_task_step_and_batch_script_stay_single_worker(slurm, tmp_path):
    code, out = slurm.run("srun", "-N1", "-n1", sys.executable, "-c", PROBE, timeout=60)
    assert code == 0, out
    (probe,) = _probes(out)
    assert probe["source"] == "single" and probe["workers"] == []
    log = tmp_path / "batch.log"
    code, out = slurm.run("sbatch", "--parsable", "--wait", "-N2", "-n2", "-o", str(log),
                          "--wrap", f"{sys.executable} -c \"{PROBE}\"", timeout=60)
    assert code == 0, out
    (probe,) = _probes(log.read_text())
    assert probe["source"] == "single"
    assert "not an srun task" in probe["notes"][0] and "srun python" in probe["notes"][0]


# --- training ------------------------------------------------------------------------------

def _reference(epochs):
    x, y = classification_data(n=256)
    model, _ = train(None, mlp, lambda: keras.optimizers.Adam(0.01), x, y, 32, epochs=epochs,
                     weights=initial_weights(mlp))
    return model.get_weights()


def _weights(out, rank):
    saved = np.load(os.path.join(out, f"weights-{rank}.npz"))
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _steps(out, rank):
    with open(os.path.join(out, f"steps-rank{rank}.txt")) as f:
        return [tuple(int(v) for v in line.split()) for line in f if line.strip()]


def _assert_close(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def _addresses(out):
    lines = [l for l in out.splitlines() if l.startswith("rank ") and "address=" in l]
    return {int(l.split()[1].rstrip(":")): l.split("address=")[1].split()[0] for l in lines}


@pytest.mark.parametrize("layout,workers", [(("-n2",), 2), (("--ntasks-per-node=2",), 4)],
                         ids=["2 nodes x 1 task", "2 nodes x 2 tasks"])
def test_srun_trains_one_job_like_one_device(slurm, tmp_path, layout, workers):
    code, out = slurm.run("srun", "-N2", *layout, "--kill-on-bad-exit=1", sys.executable, WORKER,
                          TFDP_TEST_OUT=str(tmp_path))
    assert code == 0, out
    assert out.count("source=Slurm") == workers and f"workers={workers} " in out, out
    addresses = _addresses(out)
    per_node = workers // 2
    assert [addresses[r].split(":")[0] for r in range(workers)] == \
        [NODES[r // per_node] for r in range(workers)]  # node-list order, block layout
    reference = _reference(epochs=2)
    for rank in range(workers):
        _assert_close(_weights(tmp_path, rank), reference)


def held_at_13(slurm, job, out, log):
    """Whether rank 0 holds before step 13 (the worker's TFDP_TEST_HOLD); the job must still
    be active meanwhile."""
    def held():
        state, _ = slurm.job_state(job)
        assert state in ACTIVE, (state, log.read_text() if log.exists() else "")
        return (out / "held-0").exists()
    return held


REQUEUE_SCRIPT = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append --signal=TERM@90
srun --kill-on-bad-exit=1 {python} {worker}
code=$?
if [ "$code" -eq 143 ] || [ "$code" -eq 137 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit $code
"""


def test_requeued_job_resumes_at_the_next_step(slurm, tmp_path):
    """SIGTERM to the step (what --signal=TERM@90 sends before the time limit), the batch
    script requeues the job, Slurm starts it again, and it resumes step-exactly."""
    script = tmp_path / "job.sh"
    script.write_text(REQUEUE_SCRIPT.format(python=sys.executable, worker=WORKER))
    log = tmp_path / "job.log"
    code, out = slurm.run("sbatch", "--parsable", "-o", str(log), str(script), timeout=30,
                          TFDP_TEST_OUT=str(tmp_path), TFDP_TEST_BACKUP=str(tmp_path / "backup"),
                          TFDP_TEST_EPOCHS="3", TFDP_TEST_HOLD="0:13")
    assert code == 0, out
    job = int(out.strip().split(";")[0])
    state, fields = slurm.signal_when_held_and_finish(job, held_at_13(slurm, job, tmp_path, log),
                                                      "--signal=TERM")  # the step only
    text = log.read_text()
    assert state == "COMPLETED" and fields.get("Restarts") == "1", (fields, text)
    assert "Exited with exit code 143" in text, text  # srun reports the first run's tasks
    for rank in range(2):
        steps = _steps(tmp_path, rank)
        assert [it for launch, it in steps if launch == 0] == list(range(1, 14))
        assert [it for launch, it in steps if launch == 1] == list(range(14, 25))  # none twice
        _assert_close(_weights(tmp_path, rank), _reference(epochs=3))
