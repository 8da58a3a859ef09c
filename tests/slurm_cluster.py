"""A real Slurm for tests: a controller and two emulated nodes (n1, n2) on 127.0.0.1 (the
``slurm`` module fixture), and what the Slurm test modules check jobs with. Test modules import
it from here, never from one another.

The fixture starts Debian's slurmctld and two slurmd (``-N n1``, ``-N n2``, Slurm's
multiple-slurmd mode) with a generated slurm.conf (auth/none, root, free ports, everything under
a temporary directory), and stops them by the pids in their pid files. Every srun/sbatch runs
with SLURM_CONF pointing at that configuration, so only this test cluster is touched.
``MISSING`` names the daemons that are not installed (the modules skip, with the reason).
"""

import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import keras

from helpers import classification_data, initial_weights, mlp, train
from procs import process_alive

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "cluster_train.py")
NODES = ("n1", "n2")
START_TIMEOUT = 60
RUN_TIMEOUT = 240
ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "COMPLETING")  # a job not yet ended

MISSING = [d for d in ("slurmctld", "slurmd", "srun", "sbatch", "sinfo") if shutil.which(d) is None
           and not os.path.exists(f"/usr/sbin/{d}")]
SKIP_REASON = (f"Slurm is not installed ({', '.join(MISSING)} missing): apt-get install "
               "slurmctld slurmd slurm-client")


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
    except Exception as e:  # still stop the daemons below
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



# --- checking a training job ---------------------------------------------------------------

def reference_weights(epochs):
    x, y = classification_data(n=256)
    model, _ = train(None, mlp, lambda: keras.optimizers.Adam(0.01), x, y, 32, epochs=epochs,
                     weights=initial_weights(mlp))
    return model.get_weights()


def saved_weights(out, rank):
    saved = np.load(os.path.join(out, f"weights-{rank}.npz"))
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def steps_of(out, rank):
    with open(os.path.join(out, f"steps-rank{rank}.txt")) as f:
        return [tuple(int(v) for v in line.split()) for line in f if line.strip()]


def assert_close(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def held_at_13(slurm, job, out, log):
    """Whether rank 0 holds before step 13 (the worker's TFDP_TEST_HOLD); the job must still
    be active meanwhile."""
    def held():
        state, _ = slurm.job_state(job)
        assert state in ACTIVE, (state, log.read_text() if log.exists() else "")
        return (out / "held-0").exists()
    return held
