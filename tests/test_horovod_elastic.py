"""``hvd.elastic`` on tfdp's restart-based elasticity (issue 42, item 1).

Real jobs (slow, bounded): an elastic Keras script of Horovod's shape
(tests/workers/hvd_elastic.py, only the import changed) under ``tfdp-run -np 2 --min-np 1
--reset-limit R``; rank 1 SIGKILLs itself mid-epoch in attempt 0. The relaunched attempt
resumes from rank 0's last commit on every rank (reset callbacks run, the LR rescaled to the new
``hvd.size()``), trains exactly the batches after the commit (none lost, none repeated), and
ends with the optimizer's iteration count of an uninterrupted run (and equal weights on every
rank). Twice: the killed slot comes back (2 processes again: the weights equal, to 1e-6, an
uninterrupted job's), or it fails at its restart and is dropped (the job finishes on 1
process), and over ssh (two loopback hosts, ``TFDP_ELASTIC_DIR`` shared)."""

import json
import os
import sys

import numpy as np
import pytest

from launching import run_job, worker_env, worker_script

LAUNCH_TIMEOUT = 400
EPOCHS, STEPS = 3, 6


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("case", ["slot-returns", "slot-dropped", "ssh"])
def test_a_killed_worker_resumes_from_the_last_commit(tmp_path, case, request):
    comes_back = case != "slot-dropped"
    extra = {} if comes_back else {"FAIL_AT_START": "1"}
    hosts = []
    if case == "ssh":  # two loopback "hosts" (tests/test_hosts.py's sshd); a shared commit dir
        from loopback_sshd import ADDRESSES
        hosts = ["-H", "tfdp-a:1,tfdp-b:1", "--ssh-config", request.getfixturevalue("sshd"),
                 *ADDRESSES, "-x", "KILL_AT"]
        extra.update(TFDP_ELASTIC_DIR=tmp_path / "elastic", TMPDIR=tmp_path)
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, KILL_AT="[1, 3]",
                         **extra)
    resets = "1" if comes_back else "2"
    cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "--min-np", "1", "--reset-limit",
           resets, *hosts, "--output", "all", "--", sys.executable,
           worker_script("hvd_elastic.py")]
    code, out = run_job(cmd, environ, LAUNCH_TIMEOUT)
    assert code == 0, out[-6000:]
    last_attempt, size = (1, 2) if comes_back else (2, 1)
    seen = events(tmp_path / "events.jsonl")
    first = [e for e in seen if e["attempt"] == 0 and e["event"] == "batch"]
    last = [e for e in seen if e["attempt"] == last_attempt]
    assert first and last, out[-4000:]
    assert [e for e in seen if e["event"] in ("reset", "end")] == \
        [e for e in last if e["event"] in ("reset", "end")]
    assert all(e["size"] == size for e in last)
    trained_before = [(e["epoch"], e["batch"]) for e in first]
    # rank 1 died at its end of epoch 1's third batch: rank 0 got no further than one more
    assert (1, 2) <= trained_before[-1] <= (1, 4), trained_before
    resets = [e for e in last if e["event"] == "reset"]
    assert sorted(e["rank"] for e in resets) == list(range(size)), last
    reset = resets[0]
    # the commit is consistent: the optimizer's step count is the position it recorded
    assert reset["iterations"] == reset["epoch"] * STEPS + reset["batch"], reset
    assert reset["lr"] == pytest.approx(0.01 * size)  # the reset callback: LR x hvd.size()
    assert all((r["iterations"], r["epoch"], r["batch"]) ==
               (reset["iterations"], reset["epoch"], reset["batch"]) for r in resets)
    committed = (reset["epoch"], reset["batch"])
    # CommitStateCallback runs before the worker's Recorder: rank 0 can be stopped after it
    # commits a batch and before it records it (a CI run: committed (1, 3), recorded (1, 2)).
    last_epoch, last_batch = trained_before[-1]
    assert committed in [*trained_before[-3:], (last_epoch, last_batch + 1)], \
        (committed, trained_before)
    # the last attempt trains exactly the batches after the commit, each once, then ends
    after = [(e["epoch"], e["batch"], e["iterations"]) for e in last if e["event"] == "batch"]
    expected, (ep, b), it = [], committed, reset["iterations"]
    while (ep, b) != (EPOCHS - 1, STEPS):
        if b == STEPS:
            ep, b = ep + 1, 0
        b, it = b + 1, it + 1
        expected.append((ep, b, it))
    assert after == expected, (after, expected)
    ends = [e for e in last if e["event"] == "end"]
    assert len(ends) == size
    for e in ends:
        assert (e["epoch"], e["batch"], e["iterations"]) == (EPOCHS, 0, EPOCHS * STEPS), e
    assert all(e["weights"] == pytest.approx(ends[0]["weights"], rel=1e-6) for e in ends)
    if case == "ssh":
        assert [p.name for p in (tmp_path / "elastic").iterdir()] == ["state-0.pkl"]
    if case == "slot-returns":  # the same computation as an uninterrupted run: 1e-6
        plain = tmp_path / "uninterrupted"
        plain.mkdir()
        code, out = run_job(cmd, worker_env(TFDP_TEST_OUT=plain, TF_CPP_MIN_LOG_LEVEL=2),
                            LAUNCH_TIMEOUT)
        assert code == 0, out[-6000:]
        assert {e["attempt"] for e in events(plain / "events.jsonl")} == {0}
        got, want = np.load(tmp_path / "weights.npz"), np.load(plain / "weights.npz")
        assert len(got.files) == len(want.files) == 4
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


# --- one process (quick) ----------------------------------------------------------------------

@pytest.fixture
def private_tmp(tmp_path_factory):
    """The temporary directory of a test that uses ``elastic``: pytest's, not the system's."""
    return tmp_path_factory.mktemp("tempdir")


@pytest.fixture
def elastic(monkeypatch, private_tmp):
    """``tfdp.horovod.elastic`` with its process state (the private commit directory, the
    states' key counter) the test's own, put back as it was afterwards; a private directory
    it makes lies in ``private_tmp``, not in the system's temporary directory."""
    import tempfile

    from tfdp.horovod import elastic
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    monkeypatch.setattr(elastic, "_private_dir", None)
    monkeypatch.setattr(elastic, "_counter", [0])
    return elastic


def test_commit_dir_is_the_variable_else_the_jobs_directory_else_private(tmp_path, elastic,
                                                                         private_tmp):
    assert elastic.commit_dir({"TFDP_ELASTIC_DIR": str(tmp_path / "e")}) == str(tmp_path / "e")
    job = tmp_path / "tfdp-run-abc"
    control = job / "attempt-1-xyz"
    control.mkdir(parents=True)
    assert elastic.commit_dir({"TFDP_CONTROL_DIR": str(control)}) == str(job / "elastic")
    private = elastic.commit_dir({"TFDP_CONTROL_DIR": "/tmp/attempt-0-private"})
    assert "tfdp-elastic-" in private and private == elastic.commit_dir({})
    assert os.path.dirname(private) == str(private_tmp)  # pytest's, not the system's


def test_a_commit_is_durable_and_resumes_variables_and_attributes(tmp_path, monkeypatch,
                                                                  elastic):
    import keras
    monkeypatch.setenv("TFDP_ELASTIC_DIR", str(tmp_path))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    state = elastic.KerasState(model, epoch=4, batch=2)
    extra = elastic.ObjectState(step=7)
    state.commit()
    extra.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{state._key}.pkl",
                                                          f"{extra._key}.pkl"]
    weights = [w.copy() for w in model.get_weights()]
    model.optimizer.iterations.assign(5)
    state.epoch = 9
    state.restore()  # the in-memory commit
    assert state.epoch == 4 and int(model.optimizer.iterations.numpy()) == 0
    # a relaunch: a fresh model (unbuilt optimizer) and state with the same key
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    fresh.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    again = elastic.KerasState(fresh, epoch=0, batch=0)
    again._key = state._key
    assert again.resume_from_commit()
    assert (again.epoch, again.batch) == (4, 2) and fresh.optimizer.built
    for a, b in zip(fresh.get_weights(), weights):
        assert (a == b).all()
    other = elastic.ObjectState(step=0)
    other._key = extra._key
    assert other.resume_from_commit() and other.step == 7
    with pytest.raises(ValueError, match="same model"):
        bigger = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
        wrong = elastic.TensorFlowState(bigger.variables[:1], epoch=0)
        wrong._key = state._key
        wrong.resume_from_commit()
    assert issubclass(elastic.HostsUpdatedInterrupt, RuntimeError)
    assert elastic.HostsUpdatedInterrupt(skip_sync=True).skip_sync


def test_run_resumes_a_partial_epoch_with_only_its_remaining_batches(tmp_path, monkeypatch,
                                                                     elastic):
    """One process, Horovod's Keras callbacks: a commit at epoch 1, batch 4 of 6; a relaunch
    (a fresh state with the commit's key) trains 2 batches, then epoch 2 whole, committing as
    it goes; the reset callback ran once; the function was re-entered once."""
    import keras
    import numpy as np
    import tensorflow as tf
    monkeypatch.setenv("TFDP_ELASTIC_DIR", str(tmp_path))

    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 3), "float32"),
                                               np.ones((8, 1), "float32"))).repeat().batch(4)
    before = build()
    before.optimizer.build(before.trainable_variables)
    before.optimizer.iterations.assign(10)
    first = elastic.KerasState(before, epoch=1, batch=4)
    first.commit()

    model = build()
    state = elastic.KerasState(model, epoch=0, batch=0)
    state._key = first._key
    resets, calls, seen = [], [], []
    state.register_reset_callbacks([lambda: resets.append((state.epoch, state.batch))])

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((state.epoch, state.batch))

    callbacks = [elastic.UpdateEpochStateCallback(state), elastic.UpdateBatchStateCallback(state),
                 elastic.CommitStateCallback(state), Seen()]

    @elastic.run
    def train(state):
        calls.append(state.epoch)
        state.model.fit(data, steps_per_epoch=6, epochs=3 - state.epoch, callbacks=callbacks,
                        verbose=0)

    import tfdp.horovod as hvd
    hvd.init()
    try:
        train(state)
    finally:
        hvd.shutdown()
    assert resets == [(1, 4)] and calls == [1, 2]
    assert seen == [(1, 5), (1, 6)] + [(2, b) for b in range(1, 7)]
    assert (state.epoch, state.batch) == (3, 0)
    assert int(model.optimizer.iterations.numpy()) == 18
    import pickle
    with open(tmp_path / f"{state._key}.pkl", "rb") as f:
        last = pickle.load(f)
    assert last["attrs"] == {"epoch": 3, "batch": 0}  # committed at the end of the fit


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_elastic_synthetic_benchmark_runs_under_tfdp_run():
    """examples/horovod_elastic_synthetic_benchmark.py (Horovod's elastic benchmark with its
    import changed: TensorFlowKerasState, commits in a custom loop) to its final img/s line."""
    import re

    from launching import ROOT
    cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "--min-np", "1", "--reset-limit", "1",
           "--", sys.executable,
           os.path.join(ROOT, "examples", "horovod_elastic_synthetic_benchmark.py"),
           "--num_iters", "2", "--num_batches_per_iter", "2"]
    code, out = run_job(cmd, worker_env(TF_CPP_MIN_LOG_LEVEL=2), LAUNCH_TIMEOUT)
    assert code == 0, out[-4000:]
    assert len(re.findall(r"Iter #\d: [\d.]+ img/sec per process", out)) == 2, out[-4000:]
    assert re.search(r"Total img/sec on 2 process\(es\): [\d.]+", out), out[-4000:]
