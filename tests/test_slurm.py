"""tfdp under a real Slurm: a controller and two emulated nodes (n1, n2) on 127.0.0.1.

The cluster is the ``slurm`` module fixture of tests/slurm_cluster.py. Skipped, with the
reason, where the daemons are not installed or the user is not root.
"""

import json
import sys

import pytest

from slurm_cluster import (MISSING, NODES, SKIP_REASON, WORKER, assert_close, held_at_13,
                           reference_weights, saved_weights, steps_of)

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]
if MISSING:
    pytestmark.append(pytest.mark.skip(reason=SKIP_REASON))


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

def _addresses(out):
    lines = [line for line in out.splitlines() if line.startswith("rank ") and "address=" in line]
    return {int(line.split()[1].rstrip(":")): line.split("address=")[1].split()[0]
            for line in lines}


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
    reference = reference_weights(epochs=2)
    for rank in range(workers):
        assert_close(saved_weights(tmp_path, rank), reference)


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
        steps = steps_of(tmp_path, rank)
        assert [it for launch, it in steps if launch == 0] == list(range(1, 14))
        assert [it for launch, it in steps if launch == 1] == list(range(14, 25))  # none twice
        assert_close(saved_weights(tmp_path, rank), reference_weights(epochs=3))
