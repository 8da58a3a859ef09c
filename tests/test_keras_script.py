"""A plain Keras script on several workers behaves like the one-process script (issue 18).

Quick tests: the policies, and every hooked writer in this process playing a worker other
than the chief. Slow tests: tests/workers/keras_script.py on 2 workers x 2 replicas through
tfdp-run, compared with the same script run here in one process: the same files, each
written once by the chief and loadable anywhere; the same decisions on every worker.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp.strategy import chief_writes, consensus
from helpers import classification_data, cpu_devices, mlp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "workers", "keras_script.py")
LAUNCH_TIMEOUT = 300


# --- policies ------------------------------------------------------------------------------

def test_only_workers_other_than_the_chief_redirect_and_never_twice(tmp_path):
    root = str(tmp_path / "private")
    assert chief_writes.should_redirect("out/a.keras", False, root)
    assert not chief_writes.should_redirect("out/a.keras", True, root)  # the chief writes it
    assert not chief_writes.should_redirect(root + "/w-1/a.keras", False, root)  # already private
    assert not chief_writes.should_redirect(str(tmp_path / "tb/worker-1/train"), False, root,
                                            exempt=[str(tmp_path / "tb/worker-1")])
    assert chief_writes.should_redirect(str(tmp_path / "tb/worker-10"), False, root,
                                        exempt=[str(tmp_path / "tb/worker-1")])
    assert chief_writes.should_redirect("gs://bucket/run/m.keras", False, root)
    assert not chief_writes.should_redirect("gs://bucket/tb/w1/x", False, root,
                                            exempt=["gs://bucket/tb/w1"])
    for not_a_path in (None, "", object(), b"bytes"):  # file objects, tensors: the script's own
        assert not chief_writes.should_redirect(not_a_path, False, root)
    assert chief_writes.private_name("out/ckpt/") == "ckpt"
    assert chief_writes.private_name("hf://user/repo") == "repo"


def test_per_worker_path_and_the_switch():
    assert chief_writes.per_worker_path("logs/tb", rank=3) == os.path.join("logs/tb", "worker-3")
    assert chief_writes.per_worker_path("logs/{worker}/log.csv", rank=1) == "logs/1/log.csv"
    assert chief_writes.handling_enabled({})
    for off in ("0", "false", "No", "off"):
        assert not chief_writes.handling_enabled({chief_writes.CHIEF_WRITES_ENV: off})


def test_decisions_policy():
    assert consensus.agreed_stop(1.0) and not consensus.agreed_stop(0.0)
    assert consensus.restored_epochs_error([3, 3], "b") is None
    assert consensus.restored_epochs_error([None, None], "b") is None
    message = consensus.restored_epochs_error([3, None], "/out/backup")
    assert "worker 0: epoch 3" in message and "worker 1: no backup" in message
    assert "/out/backup" in message and "share" in message


# --- every hook, in this process playing worker 1 ----------------------------------------

@pytest.fixture
def as_worker_1(tmp_path, monkeypatch):
    """This process is worker 1 of 2 (not the chief); its private directory under tmp_path."""
    import tempfile

    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setattr(chief_writes, "_worker", None)
    monkeypatch.setattr(chief_writes, "_exempt", set())
    chief_writes.activate(types.SimpleNamespace(rank=1, is_chief=False))
    return private


def _files(directory):
    return sorted(os.path.relpath(os.path.join(r, f), directory)
                  for r, _, fs in os.walk(directory) for f in fs)


def test_a_worker_other_than_the_chief_writes_nothing_at_the_scripts_paths(
        tmp_path, as_worker_1, monkeypatch):
    out = str(tmp_path / "out")
    x, y = classification_data(n=64)
    model = mlp()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cbs = [keras.callbacks.ModelCheckpoint(out + "/ckpt/m-{epoch:02d}-{loss:.2f}.keras"),
           keras.callbacks.ModelCheckpoint(out + "/ckpt/w-{epoch}-{batch}.weights.h5",
                                           save_weights_only=True, save_freq=2),
           keras.callbacks.TensorBoard(out + "/tb", profile_batch=0),
           keras.callbacks.CSVLogger(out + "/log.csv"),
           keras.callbacks.BackupAndRestore(out + "/backup", double_checkpoint=True)]
    model.fit(x, y, batch_size=16, epochs=2, callbacks=cbs, verbose=0)
    model.save(out + "/final.keras")
    keras.saving.save_model(model, out + "/again.keras")
    model.save(out + "/legacy.h5")
    model.save(out + "/unzipped", zipped=False)
    model.save_weights(out + "/final.weights.h5")
    model.save_weights(out + "/sharded.weights.json", max_shard_size=1e-5)
    model.export(out + "/export", verbose=False)
    module = tf.Module()
    module.v = tf.Variable(1.0)
    tf.saved_model.save(module, out + "/saved_model")
    checkpoint = tf.train.Checkpoint(model=model)
    manager = tf.train.CheckpointManager(checkpoint, out + "/manager", max_to_keep=2)
    saved = [manager.save() for _ in range(3)]
    saved_by_checkpoint = checkpoint.save(out + "/plain/ckpt")
    written = checkpoint.write(out + "/plain/written")
    with tf.summary.create_file_writer(out + "/summaries").as_default():
        tf.summary.scalar("x", 1.0, step=0)

    # Nothing at the script's paths (ModelCheckpoint creates its directory on every worker).
    assert _files(out) == [], _files(out)
    # The manager's bookkeeping names the chief's files, as the chief's manager does.
    assert saved == [os.path.join(out, "manager", f"ckpt-{i}") for i in (1, 2, 3)]
    assert manager.latest_checkpoint == saved[-1] and manager.checkpoints == saved[1:]
    assert saved_by_checkpoint == out + "/plain/ckpt-4" and written == out + "/plain/written"
    # What stays private until exit: only the summary writer's directory. (AutoGraph writes
    # its generated modules to the temp directory too: TensorFlow's, not a saved file.)
    left = [p for p in _files(as_worker_1) if not p.startswith("__autograph_generated_file")]
    assert left and all("/summaries/events.out.tfevents." in p for p in left), left

    # A path named per worker is written by the worker itself.
    own = chief_writes.per_worker_path(out + "/own")
    os.makedirs(own)
    model.save_weights(own + "/w.weights.h5")
    assert _files(out) == ["own/worker-1/w.weights.h5"]
    # Guard: with the mechanism off this worker writes the script's path, as Keras alone does.
    monkeypatch.setenv(chief_writes.CHIEF_WRITES_ENV, "0")
    model.save(out + "/final.keras")
    assert "final.keras" in _files(out)


def test_a_redirected_checkpoint_directory_exists_and_can_be_removed(tmp_path, as_worker_1,
                                                                       monkeypatch):
    # TensorFlow's multi-worker custom-loop tutorial: a worker saves into a directory of its
    # own, lists nothing in particular, then removes it with tf.io.gfile.rmtree.
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    target = str(tmp_path / "out" / "workertemp_1" / "ckpt")
    tf.train.CheckpointManager(checkpoint, target, max_to_keep=1).save()
    assert tf.io.gfile.isdir(target) and tf.io.gfile.listdir(target) == []
    tf.io.gfile.rmtree(target)
    written = checkpoint.write(str(tmp_path / "plain" / "c"))
    assert tf.io.gfile.isdir(os.path.dirname(written))
    # Guard: without creating the directory the tutorial's removal fails, as it did.
    monkeypatch.setattr(chief_writes, "_make_directory", lambda path: None)
    tf.train.CheckpointManager(checkpoint, target, max_to_keep=1).save()
    with pytest.raises(tf.errors.NotFoundError):
        tf.io.gfile.rmtree(target)


def test_the_chief_writes_at_the_scripts_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(chief_writes, "_worker", None)
    chief_writes.activate(types.SimpleNamespace(rank=0, is_chief=True))
    model = mlp()
    model.build((None, 8))
    model.save(str(tmp_path / "m.keras"))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path / "c"), 1)
    assert manager.save() == str(tmp_path / "c" / "ckpt-1")
    assert _files(tmp_path) == ["c/checkpoint", "c/ckpt-1.data-00000-of-00001", "c/ckpt-1.index",
                                "m.keras"]


# --- real processes ----------------------------------------------------------------------

def _load_script():
    spec = importlib.util.spec_from_file_location("keras_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(tmp_path, out, phases, opt="adam", epochs=5, **env):
    temp = tmp_path / "worker-tmp"
    temp.mkdir(exist_ok=True)
    environ = dict(os.environ, TFDP_TEST_OUT=str(out), KS_PHASES=",".join(phases), KS_OPT=opt,
                   KS_EPOCHS=str(epochs), TMPDIR=str(temp), TF_CPP_MIN_LOG_LEVEL="2")
    environ.pop("TF_CONFIG", None)
    environ.update(env)
    cmd = [sys.executable, "-m", "tfdp.run", "--workers", "2", "--cpu-replicas", "2", "--",
           sys.executable, SCRIPT]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, cwd=ROOT,
                          timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr, temp


def _records(out, ranks=(0, 1)):
    return [json.load(open(os.path.join(out, "records", f"rank{r}.json"))) for r in ranks]


def _arrays(out, rank, phase):
    return dict(np.load(os.path.join(out, "records", f"rank{rank}-{phase}.npz")))


def _normalized_tree(directory):
    """Relative file names, with what legitimately differs between runs made generic: the
    event files' time/host/pid and the value of {val_loss} in a checkpoint name."""
    names = set()
    for name in _files(directory):
        name = re.sub(r"events\.out\.tfevents\..*", "EVENTS", name)
        name = re.sub(r"(m-\d\d)-[\d.]+\.keras$", r"\1-VAL.keras", name)
        names.add(name)
    return names


def _event_file_problems(directory, chief_pid):
    """Every TensorBoard directory must hold exactly one event file, written by the chief."""
    problems = []
    for events_dir in sorted({os.path.dirname(p) for p in
                              glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"),
                                        recursive=True)}):
        files = glob.glob(os.path.join(events_dir, "events.out.tfevents.*"))
        # events.out.tfevents.<time>.<host, may hold dots>.<pid>.<n>[.v2]
        pids = sorted(int(re.search(r"\.(\d+)\.\d+(\.v2)?$", os.path.basename(f)).group(1))
                      for f in files)
        if pids != [chief_pid]:
            problems.append(f"{events_dir}: event files of pids {pids}, chief {chief_pid}")
    return problems


def _same_decisions(records, phase):
    chief, other = records[0][phase], records[1][phase]
    assert chief["epochs"] == other["epochs"] and chief["batches"] == other["batches"]
    assert chief["lr"] == other["lr"]
    assert json.dumps(chief["logs"]) == json.dumps(other["logs"])  # bit for bit (NaN too)


def _predict_anywhere(path, expected, script):
    """The saved model predicts what the chief's model did: here without a strategy, and
    under 4 and 1 replicas (the job had 2 x 2)."""
    model = keras.saving.load_model(path)
    np.testing.assert_allclose(model.predict(script.PROBE, verbose=0), expected, atol=1e-6)
    for devices in (cpu_devices(4), cpu_devices(1)):
        with tfdp.DataParallelStrategy(devices=devices).scope():
            replicated = keras.saving.load_model(path)
        np.testing.assert_allclose(replicated.predict(script.PROBE, verbose=0), expected,
                                   atol=1e-6)
    return model


def _check_fit_phase(out, ref, records, script):
    fit, chief = os.path.join(out, "fit"), records[0]["fit"]
    assert _normalized_tree(fit) == _normalized_tree(os.path.join(ref, "fit"))
    assert _event_file_problems(fit, records[0]["pid"]) == []
    epochs = len(chief["epochs"])
    with open(os.path.join(fit, "log.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == chief["epochs"]
    assert [float(r["val_loss"]) for r in rows] == [e["val_loss"] for e in chief["logs"]]
    # Every checkpoint loads; {val_loss} in a name is the chief's value.
    for path in glob.glob(os.path.join(fit, "ckpt", "**", "*.keras"), recursive=True):
        keras.saving.load_model(path)
    for path in glob.glob(os.path.join(fit, "ckpt", "**", "*.weights.h5"), recursive=True):
        mlp().load_weights(path)
    val_names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(fit, "ckpt", "m-*")))
    assert val_names == [f"m-{e + 1:02d}-{log['val_loss']:.3f}.keras"
                         for e, log in zip(chief["epochs"], chief["logs"])]
    # best.keras is the model of the best epoch, the same as that epoch's weights file.
    best = int(np.argmin([log["val_loss"] for log in chief["logs"]]))
    best_model = mlp()
    best_model.load_weights(os.path.join(fit, "ckpt", f"w-{best + 1:02d}.weights.h5"))
    for got, want in zip(keras.saving.load_model(os.path.join(fit, "ckpt", "best.keras"))
                         .get_weights(), best_model.get_weights()):
        np.testing.assert_array_equal(got, want)
    # The final model, weights, export and backup predict what the chief's model predicted.
    pred = _arrays(out, 0, "fit")["pred"]
    np.testing.assert_array_equal(pred, _arrays(out, 1, "fit")["pred"])
    final = _predict_anywhere(os.path.join(fit, "final.keras"), pred, script)
    weights = mlp()
    weights.load_weights(os.path.join(fit, "final.weights.h5"))
    np.testing.assert_allclose(weights.predict(script.PROBE, verbose=0), pred, atol=1e-6)
    exported = tf.saved_model.load(os.path.join(fit, "export"))  # kept: serve uses its variables
    served = exported.serve(script.PROBE)
    np.testing.assert_allclose(served.numpy(), pred, atol=1e-6)
    with open(os.path.join(fit, "backup", "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == epochs
    assert records[0]["fit"]["evaluate"] == records[1]["fit"]["evaluate"]
    return final


@pytest.mark.slow
@pytest.mark.multiworker
def test_keras_script_on_two_workers_writes_and_decides_like_one_process(tmp_path):
    script = _load_script()
    out, ref = tmp_path / "job", tmp_path / "one-process"
    code, output, temp = _launch(tmp_path, out, ["fit", "early_stop"])
    assert code == 0, output
    script.main(str(ref), ["fit", "early_stop"], "adam", 5, tfdp.DataParallelStrategy())
    records, (reference,) = _records(out), _records(ref, ranks=(0,))
    # The terminal shows the job once (tfdp-run's default shows the chief).
    launcher_help = subprocess.run([sys.executable, "-m", "tfdp.run", "--help"], cwd=ROOT,
                                   capture_output=True, text=True).stdout
    assert output.count("Epoch 1/5") == (1 if "--output" in launcher_help else 2), output

    for phase in ("fit", "early_stop"):
        _same_decisions(records, phase)
    _check_fit_phase(str(out), str(ref), records, script)
    # EarlyStopping(patience=1) on a rising validation loss: epoch 2 of 10 everywhere, like
    # one process; ReduceLROnPlateau halved the rate at the same epoch everywhere.
    assert records[0]["early_stop"]["epochs"] == reference["early_stop"]["epochs"] == [0, 1]
    assert records[0]["early_stop"]["lr"] == pytest.approx([0.01, 0.005])
    # No private directory is left behind.
    assert glob.glob(str(temp / "tfdp-worker*")) == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_stop_seen_by_one_worker_stops_every_worker_at_the_same_point(tmp_path):
    # (A job of its own, so that no test of this module runs past a minute on a loaded host.)
    out = tmp_path / "job"
    code, output, temp = _launch(tmp_path, out, ["nan", "local_stop"])
    assert code == 0, output
    records = _records(out)
    for phase in ("nan", "local_stop"):
        _same_decisions(records, phase)
    # A NaN seen by one worker stops both at the same batch.
    assert records[0]["nan"]["batches"] == 2 and np.isnan(records[0]["nan"]["logs"][0]["loss"])
    # One worker's callback stops alone: every worker stops after the same epoch.
    assert records[0]["local_stop"]["epochs"] == records[1]["local_stop"]["epochs"] == [0]
    assert glob.glob(str(temp / "tfdp-worker*")) == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_sharded_optimizer_and_custom_loop_on_two_workers(tmp_path):
    script = _load_script()
    out, ref = tmp_path / "job", tmp_path / "one-process"
    code, output, temp = _launch(tmp_path, out, ["fit", "ctl"], opt="sharded_adam")
    assert code == 0, output
    script.main(str(ref), ["fit", "ctl"], "sharded_adam", 5, tfdp.DataParallelStrategy())
    records = _records(out)
    _same_decisions(records, "fit")
    final = _check_fit_phase(str(out), str(ref), records, script)
    # The optimizer state comes back whole: the one-process run's state, one device.
    assert isinstance(final.optimizer, tfdp.ShardedOptimizer)
    one_process = keras.saving.load_model(str(ref / "fit" / "final.keras"))
    # (Variable paths carry Keras's per-process layer numbering, so compare in order.)
    got = [(v.path, np.asarray(v)) for v in final.optimizer.variables]
    want = [(v.path, np.asarray(v)) for v in one_process.optimizer.variables]
    assert len(got) == len(want) > 2
    for (got_name, got_value), (name, value) in zip(got, want):
        assert re.sub(r"_\d+", "", got_name) == re.sub(r"_\d+", "", name)
        np.testing.assert_allclose(got_value, value, atol=1e-5, err_msg=name)

    # Custom loop: CheckpointManager and tf.summary as in one process, chief's files only.
    ctl = out / "ctl"
    tree = _normalized_tree(ctl)
    assert tree == _normalized_tree(ref / "ctl")
    assert {"tb/EVENTS", "ckpt/checkpoint", "ckpt/ckpt-3.index"} <= tree, tree
    assert _event_file_problems(str(ctl), records[0]["pid"]) == []
    chief, other = records[0]["ctl"], records[1]["ctl"]
    assert other["saved"] == chief["saved"] == [str(ctl / "ckpt" / f"ckpt-{i}") for i in (1, 2, 3)]
    assert other["latest"] == chief["latest"] and other["checkpoints"] == chief["checkpoints"]
    # The tutorial's idiom: worker 1 listed and removed its own temporary directory.
    assert other["listed"] == [] and not (ctl / "workertemp_1" / "tutorial_ckpt").exists()
    assert "tutorial_ckpt/checkpoint" in tree
    # is_chief() with no argument, outside any scope, answers for the process's job.
    assert chief["is_chief_outside_scope"] is True and other["is_chief_outside_scope"] is False
    model, optimizer = mlp(), keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(chief["latest"])
    arrays = _arrays(out, 0, "ctl")
    for i, w in enumerate(model.get_weights()):
        np.testing.assert_array_equal(w, arrays[f"w{i}"])
    assert int(optimizer.iterations) == int(arrays["iterations"])
    assert glob.glob(str(temp / "tfdp-worker*")) == []


@pytest.mark.slow
@pytest.mark.multiworker
def test_without_chief_writes_the_workers_collide(tmp_path):
    """Guard: TFDP_CHIEF_WRITES=0 gives Keras's own behaviour: both workers write the same
    files (h5py's lock fails, or a TensorBoard directory gets two event files)."""
    out = tmp_path / "job"
    code, output, _ = _launch(tmp_path, out, ["fit"], epochs=2,
                              **{chief_writes.CHIEF_WRITES_ENV: "0"})
    shared_event_dirs = [d for d in glob.glob(str(out / "fit" / "tb" / "*"))
                         if len(glob.glob(os.path.join(d, "events.out.tfevents.*"))) > 1]
    assert (code != 0 and "unable to lock file" in output) or shared_event_dirs, output


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_documented_example_runs_on_two_workers(tmp_path):
    """examples/keras_script.py as its docstring runs it (smaller): exit 0, the chief's report
    once, the files written once at --out, nothing private left behind."""
    out, temp = tmp_path / "ks-2", tmp_path / "worker-tmp"
    temp.mkdir()
    environ = dict(os.environ, TMPDIR=str(temp))
    environ.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "tfdp.run", "--workers", "2", "--", sys.executable,
           os.path.join(ROOT, "examples", "keras_script.py"), "--out", str(out), "--epochs", "2",
           "--width", "64"]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, cwd=ROOT,
                          timeout=LAUNCH_TIMEOUT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert output.count("workers 2, replicas 2") == 1, output
    assert output.count("ModelCheckpoint(.keras) per epoch: median") == 1, output
    assert "INFO:tensorflow" not in output and "Epoch 2/2" in output, output
    assert sorted(os.listdir(out)) == ["ckpt", "final.keras", "log.csv", "tb"]
    assert sorted(os.listdir(out / "ckpt")) == [
        "best.keras", "epoch-01.keras", "epoch-02.keras", "w-01.weights.h5", "w-02.weights.h5"]
    assert len(open(out / "log.csv").read().strip().splitlines()) == 1 + 2  # header + 2 epochs
    assert glob.glob(str(temp / "tfdp-worker*")) == []
