"""Multi-worker training for real: worker processes on 127.0.0.1 started by tfdp-run.

Every launch is bounded by a subprocess timeout, and tfdp-run stops only the workers it
started."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
import keras

from helpers import classification_data, initial_weights, mlp, train
from launching import run_job, start_job, tfdp_run_command, worker_env, worker_script
from tfdp.launcher.cli import NEVER_JOINED_GRACE_SECONDS

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]
LAUNCH_TIMEOUT = 240


def launch(tmp_path, workers=2, cpu_replicas=1, script="mw_worker.py", extra_args=(), **env):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, **env)
    cmd = tfdp_run_command(worker_script(script), workers=workers, cpu_replicas=cpu_replicas,
                           flags=extra_args)
    return run_job(cmd, environ, LAUNCH_TIMEOUT)


def load(tmp_path, rank):
    return dict(np.load(tmp_path / f"weights-{rank}.npz"))


def weights_of(saved):
    return [saved[f"arr_{i}"] for i in range(sum(k.startswith("arr_") for k in saved))]


@functools.cache
def reference(opt_name, global_batch, epochs=2):
    """One device's weights and history (each run is deterministic: once per module)."""
    x, y = classification_data(n=256)
    opt = {"sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
           "adam": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5)}[opt_name]
    model, hist = train(None, mlp, opt, x, y, global_batch, epochs=epochs,
                        weights=initial_weights(mlp))
    return model.get_weights(), hist


# The optimizers each job trains, one model after the other (tests/workers/mw_worker.py): one
# job start-up per replica count instead of one per optimizer.
TWO_WORKER_OPTS = {1: ["sgd"], 2: ["adam", "sharded_adam"]}
TWO_WORKER_GLOBAL_BATCH = 32


@pytest.fixture(scope="module")
def two_worker_jobs(tmp_path_factory):
    """{cpu_replicas: (exit code, output, out dir)} of one 2-worker job per replica count,
    started when a test first asks for it."""
    jobs = {}

    def job(cpu_replicas):
        if cpu_replicas not in jobs:
            out_dir = tmp_path_factory.mktemp(f"two-workers-{cpu_replicas}")
            opts = ",".join(TWO_WORKER_OPTS[cpu_replicas])
            code, out = launch(out_dir, cpu_replicas=cpu_replicas, TFDP_TEST_OPT=opts,
                               TFDP_TEST_GLOBAL_BATCH=TWO_WORKER_GLOBAL_BATCH)
            jobs[cpu_replicas] = code, out, out_dir
        return jobs[cpu_replicas]
    return job


@pytest.mark.parametrize("cpu_replicas,opt_name", [(1, "sgd"), (2, "adam"), (2, "sharded_adam")])
def test_two_workers_train_like_one_device(two_worker_jobs, cpu_replicas, opt_name):
    global_batch = TWO_WORKER_GLOBAL_BATCH
    code, out, out_dir = two_worker_jobs(cpu_replicas)
    assert code == 0, out
    assert f"rank 0: {2 * cpu_replicas} replicas, chief=True" in out
    several = len(TWO_WORKER_OPTS[cpu_replicas]) > 1
    assert f"rank 0: {opt_name + ' ' if several else ''}done" in out, out
    saved = [dict(np.load(out_dir / (f"weights-{opt_name}-{r}.npz" if several
                                     else f"weights-{r}.npz"))) for r in range(2)]
    ref_weights, ref_hist = reference(opt_name.replace("sharded_", ""), global_batch)
    for s in saved:
        for got, want in zip(weights_of(s), ref_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # Metrics are global: both workers report the single-device history.
        np.testing.assert_allclose(s["loss"], ref_hist["loss"], rtol=1e-5)
        np.testing.assert_allclose(s["accuracy"], ref_hist["accuracy"], rtol=1e-5)
    # Every replica on every worker holds identical weights (checked, not assumed).
    replica_keys = [k for k in saved[0] if "_replica" in k]
    assert len(replica_keys) == len(ref_weights) * cpu_replicas
    for k in replica_keys:
        base = k.split("_replica")[0] + "_replica0"
        for s in saved:
            np.testing.assert_array_equal(s[k], saved[0][base])


def test_worker_exiting_nonzero_stops_the_job(tmp_path):
    code, out = launch(tmp_path, TFDP_TEST_FAIL="1:0:2:exit", TFDP_TEST_EPOCHS=50)
    assert code == 3, out
    assert "worker 1 exited with code 3" in out


def test_killed_worker_fails_the_survivors(tmp_path):
    code, out = launch(tmp_path, TFDP_TEST_FAIL="1:0:2:kill", TFDP_TEST_EPOCHS=50)
    assert code == 128 + signal.SIGKILL, out
    assert "worker 1 exited with code 137" in out


def test_a_survivor_whose_step_starts_after_a_peer_died_ends_it_on_tfdp_runs_word(tmp_path):
    # Worker 1 is SIGKILLed after batch 2; worker 0 starts batch 3 only once tfdp-run has
    # announced that (PEER_EXITED_FILE), so its step's collectives start after the peer died:
    # no RPC of it was in flight to be reset, and without the announcement it waited for
    # TensorFlow's heartbeat timeout (10-12 s a restart, docs/benchmarks/bench_restart.md).
    # BackupAndRestore takes tfdp-run's SIGTERM as a preemption (it stops after the step), as
    # in a real job; without it SIGTERM would kill the waiting worker first. The chief's
    # output (the terminal's) says it ended on the announcement.
    code, out = launch(tmp_path, TFDP_TEST_FAIL="1:0:2:kill", TFDP_TEST_LATE="0:0:2",
                       TFDP_TEST_EPOCHS=50, TFDP_TEST_BACKUP=tmp_path / "backup")
    assert code == 128 + signal.SIGKILL, out
    assert "rank 0: going on after the peer's exit (True)" in out, out
    assert "worker 1 (rank 1) exited with code 137 (SIGKILL)" in out, out
    assert "tfdp-run announced the exit" in out, out


def test_hung_worker_gives_an_error_within_the_timeout(tmp_path):
    # Worker 1 freezes (SIGSTOP); worker 0's next collective must fail, not hang.
    code, out = launch(tmp_path, TFDP_TEST_FAIL="1:0:2:stop", TFDP_TEST_EPOCHS=50,
                       TFDP_TEST_TIMEOUT=5)
    assert code not in (0, None), out
    assert "worker 0 exited with code" in out
    assert any(s in out for s in ("DeadlineExceeded", "Unavailable", "unhealthy", "Aborted",
                                  "heartbeat")), out


def test_a_live_worker_that_never_joins_the_step_fails_it_at_the_deadline(tmp_path):
    # Worker 1 blocks in a callback: alive, its heartbeats arrive, so only tfdp's step
    # deadline (tfdp.strategy.deadline) can end worker 0's wait in the next step's all-reduce.
    code, out = launch(tmp_path, TFDP_TEST_FAIL="1:0:2:block", TFDP_TEST_EPOCHS=50,
                       TFDP_TEST_TIMEOUT=4)
    assert code not in (0, None), out
    assert "worker 0 exited with code" in out
    assert "DeadlineExceeded" in out, out
    assert "a training step on worker 0 of 2 did not finish within 4 s" in out, out


def test_worker_that_never_joins_ends_the_job(tmp_path):
    # 15 s: worker 0 must have joined by then (its import takes 3-8 s on a loaded 2-core host).
    code, out = launch(tmp_path, TFDP_TEST_FAIL="1:0:0:hang-before-strategy",
                       extra_args=("--start-timeout", "15"))
    assert code == 125, out
    assert "worker(s) [1] did not join the cluster within 15 s" in out
    # Worker 0 waits inside the strategy constructor, where SIGTERM does not end it: nobody
    # trained, so it gets the short grace before SIGKILL, not the full grace period.
    assert f"still running after the grace period ({NEVER_JOINED_GRACE_SECONDS:g} s)" in out, out


def test_ctrl_c_is_forwarded_and_stops_everything(tmp_path):
    proc = start_job(tfdp_run_command(worker_script("mw_worker.py"), flags=("--output", "all")),
                     worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_EPOCHS=100000))
    lines = []
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        for line in proc.stdout:  # wait until both workers have joined and train
            lines.append(line)
            if sum("replicas, chief=" in s for s in lines) == 2 or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "received SIGINT; forwarding to all workers" in out


@pytest.mark.parametrize("shuffle", ["", "1"], ids=["in-order", "shuffled"])
def test_kill_and_resume_ends_like_an_uninterrupted_run(tmp_path, shuffle):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    common = dict(TFDP_TEST_EPOCHS=4, TFDP_TEST_OPT="adam", TFDP_TEST_SHUFFLE=shuffle)
    code, out = launch(tmp_path / "a", TFDP_TEST_BACKUP=tmp_path / "backup-a", **common)
    assert code == 0, out
    code, out = launch(tmp_path / "b", TFDP_TEST_BACKUP=tmp_path / "backup-b",
                       TFDP_TEST_FAIL="1:2:3:kill", **common)  # mid-epoch 3
    assert code == 137, out
    assert (tmp_path / "backup-b").exists()
    code, out = launch(tmp_path / "b", TFDP_TEST_BACKUP=tmp_path / "backup-b", **common)
    assert code == 0, out
    for rank in range(2):
        resumed, full = load(tmp_path / "b", rank), load(tmp_path / "a", rank)
        assert len(resumed["loss"]) == 2  # epochs 3 and 4 only
        for got, want in zip(weights_of(resumed), weights_of(full)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not (tmp_path / "backup-b").exists()  # deleted by the chief at the end


def test_bad_tf_config_is_a_clear_error():
    env = dict(os.environ, TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:x"]}, '
                                     '"task": {"type": "worker", "index": 0}}')
    proc = subprocess.run([sys.executable, "-c", "import tfdp; tfdp.DataParallelStrategy()"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ClusterConfigError" in proc.stderr
    assert "TF_CONFIG cluster.worker[0]='127.0.0.1:x'" in proc.stderr


def test_exactly_once_across_two_workers(tmp_path):
    from tfdp import data as tdata
    source = tf.data.Dataset.range(90).map(lambda i: (i, tf.cast(i, tf.float32)))
    bounds = np.cumsum([10, 40, 25, 15])  # uneven file sizes
    tdata.write_tfrecord_shards(source, tmp_path / "files", 4,
                                assign=lambda i: int(np.searchsorted(bounds, i, side="right")))
    code, out = launch(tmp_path, cpu_replicas=2, script="mw_data.py",
                       TFDP_TEST_FILES=tmp_path / "files" / "*.tfrecord")
    assert code == 0, out
    results = [json.loads((tmp_path / f"data-{r}.json").read_text()) for r in range(2)]
    for key, n in [("dataset/auto", 101), ("dataset/data", 101), ("files/auto", 90),
                   ("files/data", 90), ("files/file", 90)]:
        union = sorted(results[0][key]["ids"] + results[1][key]["ids"])
        assert union == list(range(n)), key  # every element once, none twice
        assert results[0][key]["steps"] == results[1][key]["steps"] == results[0][key]["cardinality"]
    for key, n in [("dataset/off", 101), ("files/off", 90)]:
        for r in range(2):  # no sharding: every worker sees everything once
            assert sorted(results[r][key]["ids"]) == list(range(n)), key
