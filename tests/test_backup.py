"""BackupAndRestore in one process: step-exact resume, accumulation boundaries, guards.

A crash is an exception raised from a callback after step X (fit leaves without
on_train_end, as a killed process would); the relaunch is a new model, optimizer and
dataset in the same process, restored from the backup directory.
"""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from helpers import classification_data, cpu_devices, initial_weights, mlp

N, GLOBAL_BATCH, EPOCHS = 96, 16, 3  # 6 steps per epoch, 18 steps


class Crash(Exception):
    pass


class Steps(keras.callbacks.Callback):
    """Records the optimizer's iteration counter after every step; crashes where told."""

    def __init__(self, crash_after=None):
        super().__init__()
        self.iterations, self.crash_after = [], crash_after

    def on_train_batch_end(self, batch, logs=None):
        it = int(self.model.optimizer.iterations.numpy())
        self.iterations.append(it)
        if it == self.crash_after:
            raise Crash(it)


def optimizer(kind, accumulation=None):
    kwargs = {"gradient_accumulation_steps": accumulation} if accumulation else {}
    if kind == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9, **kwargs)
    adam = keras.optimizers.Adam(0.01, global_clipnorm=0.5, **kwargs)
    return tfdp.ShardedOptimizer(adam) if kind == "sharded_adam" else adam


def fit(backup_dir, replicas=4, kind="adam", crash_after=None, save_freq=4, shuffle=True,
        accumulation=None, tfdp_input=True, validation=None, name_dataset=True, **backup_kwargs):
    """``validation``: None, or "before"/"after": a tfdp.data validation pipeline created
    before or after the training one and given to fit; ``name_dataset``: pass dataset=."""
    x, y = classification_data(n=N)
    zero3 = kind == "zero3_adam"  # ZeRO-3: every trainable variable sliced over the replicas
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(replicas), shard_parameters=zero3,
                                         shard_min_elements=0)
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=optimizer("adam" if zero3 else kind, accumulation),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    source = tf.data.Dataset.from_tensor_slices((x, y))
    val_source = tf.data.Dataset.from_tensor_slices((x[:64], y[:64]))
    val = None
    if validation == "before":
        val = tfdp.data.distribute(strategy, val_source, GLOBAL_BATCH)
    if tfdp_input:
        train = tfdp.data.distribute(strategy, source, GLOBAL_BATCH,
                                     shuffle_buffer=N if shuffle else None, seed=3)
    else:
        train = source.batch(GLOBAL_BATCH)
    if validation == "after":
        val = tfdp.data.distribute(strategy, val_source, GLOBAL_BATCH)
    steps = Steps(crash_after)
    callbacks = [steps]
    if backup_dir is None and tfdp_input:
        callbacks.append(tfdp.callbacks.DatasetEpoch(train))  # epoch e's order = f(seed, e)
    if backup_dir is not None:
        callbacks.insert(0, tfdp.callbacks.BackupAndRestore(
            backup_dir, save_freq=save_freq,
            dataset=train if tfdp_input and name_dataset else None, **backup_kwargs))
    try:
        model.fit(train, epochs=EPOCHS, verbose=0, callbacks=callbacks, shuffle=False,
                  validation_data=val)
    except Crash:
        return None, steps.iterations
    return model.get_weights(), steps.iterations


_uninterrupted_runs = {}


def uninterrupted(**kwargs):
    """fit(None, **kwargs), run once per module: the reference several tests compare with
    (each run is deterministic, so sharing it changes no assertion)."""
    key = tuple(sorted(kwargs.items()))
    if key not in _uninterrupted_runs:
        _uninterrupted_runs[key] = fit(None, **kwargs)
    return _uninterrupted_runs[key]


def assert_close(a, b, tol=1e-5):
    for p, q in zip(a, b):
        np.testing.assert_allclose(p, q, rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adam", "sharded_adam"])
def test_resume_mid_epoch_is_step_exact(tmp_path, kind):
    want, ran = uninterrupted(kind=kind)
    assert ran == list(range(1, 19))
    _, first = fit(tmp_path, kind=kind, crash_after=10)  # mid-epoch 1; backups at 4 and 8
    got, second = fit(tmp_path, kind=kind)
    assert first == list(range(1, 11))
    assert second == list(range(9, 19))  # resumes at step 9 of 18: epoch 1, batch 2
    assert_close(got, want)
    assert not os.path.exists(tmp_path)  # deleted after the successful end


@pytest.mark.slow
def test_resume_on_another_replica_count(tmp_path):
    want, _ = uninterrupted(kind="sharded_adam")
    fit(tmp_path, replicas=4, kind="sharded_adam", crash_after=10)
    got, second = fit(tmp_path, replicas=2, kind="sharded_adam")
    assert second == list(range(9, 19))
    assert_close(got, want)


@pytest.mark.slow
def test_zero3_backup_from_four_replicas_resumes_on_two_step_exact(tmp_path):
    want, _ = uninterrupted(kind="adam")
    fit(tmp_path, replicas=4, kind="zero3_adam", crash_after=10)
    got, second = fit(tmp_path, replicas=2, kind="zero3_adam")
    assert second == list(range(9, 19))
    assert_close(got, want)


@pytest.mark.slow
def test_backups_wait_for_the_update_boundary_with_accumulation(tmp_path):
    # k=4 micro-batches per update; save_freq=3 is due at 3, 6, 9 ... but taken at 4, 8, 12.
    want, _ = uninterrupted(kind="adam", accumulation=4, shuffle=False)
    backup = tmp_path / "b"
    fit(backup, kind="adam", accumulation=4, crash_after=None, save_freq=3, shuffle=False,
        delete_checkpoint=False)
    assert sorted(os.listdir(backup)) == ["step-000000000016"]  # newest only; 16 % 4 == 0
    crash_dir = tmp_path / "c"
    x_steps = []

    class CrashAtMicro(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            x_steps.append(batch)
            if len(x_steps) == 11:  # 11 micro-batches: mid accumulation cycle
                raise Crash()

    # optimizer.iterations counts updates under accumulation, so count micro-batches here.
    x, y = classification_data(n=N)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=optimizer("adam", 4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH,
                                 seed=3)
    with pytest.raises(Crash):
        model.fit(train, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[
            tfdp.callbacks.BackupAndRestore(crash_dir, save_freq=3, dataset=train), CrashAtMicro()])
    assert sorted(os.listdir(crash_dir)) == ["step-000000000008"]
    got, _ = fit(crash_dir, kind="adam", accumulation=4, save_freq=3, shuffle=False)
    assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("validation", ["after", "before"])
def test_resume_positions_the_dataset_fit_trains_on_not_the_validation_set(tmp_path, validation):
    # The usual script: a training and a validation pipeline, no dataset= for the callback.
    # It positions fit's x whatever was created last (it used to position the newest
    # distribute() result: with the validation set made after, 0.146 away from uninterrupted).
    want, ran = uninterrupted(validation=validation, name_dataset=False)
    assert ran == list(range(1, 19))
    fit(tmp_path, validation=validation, name_dataset=False, crash_after=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, second = fit(tmp_path, validation=validation, name_dataset=False)
    assert not [w for w in caught if "tfdp" in str(w.message)]
    assert second == list(range(9, 19))
    assert_close(got, want)


def test_guard_positioning_the_validation_set_instead_is_not_exact(tmp_path):
    # What the old default did with the validation set made after the training set: now
    # refused (it positioned the validation set, and training redid or skipped steps).
    fit(tmp_path, validation="after", name_dataset=False, crash_after=10)
    from tfdp.strategy import keras_integration

    original = keras_integration.fit_input
    keras_integration.fit_input = lambda model: (tfdp.data.latest_distributed(),)
    try:
        with pytest.raises(RuntimeError, match="fit does not train on it"):
            fit(tmp_path, validation="after", name_dataset=False)
    finally:
        keras_integration.fit_input = original


@pytest.mark.slow
def test_guard_a_resume_without_positioning_redoes_steps_and_says_so(tmp_path):
    want, _ = uninterrupted(tfdp_input=False, shuffle=False)
    fit(tmp_path, tfdp_input=False, crash_after=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, second = fit(tmp_path, tfdp_input=False)
    assert any("trained a second time" in str(w.message) and "the x of model.fit" in str(w.message)
               for w in caught)
    assert second[0] == 9 and len(second) == 12  # epoch 1 again from its first batch
    with pytest.raises(AssertionError):
        assert_close(got, want)  # the redone steps change the result: the check can fail


@pytest.mark.slow
def test_an_incomplete_newer_backup_is_ignored(tmp_path):
    want, _ = uninterrupted(kind="adam")
    fit(tmp_path, crash_after=10)
    (tmp_path / ".incomplete-step-000000000012-4242").mkdir()  # a writer killed mid-way
    (tmp_path / ".incomplete-step-000000000012-4242" / "model.weights.h5").write_bytes(b"torn")
    got, second = fit(tmp_path)
    assert second[0] == 9
    assert_close(got, want)


def test_save_freq_is_validated():
    with pytest.raises(ValueError, match="save_freq"):
        tfdp.callbacks.BackupAndRestore("/tmp/x", save_freq=0)
    with pytest.raises(ValueError, match="check_every"):
        tfdp.callbacks.BackupAndRestore("/tmp/x", check_every=0)
    config = tfdp.callbacks.BackupAndRestore("/tmp/x", save_freq=5, check_every=2).get_config()
    assert config["save_freq"] == 5 and config["check_every"] == 2


@pytest.mark.slow
def test_a_crash_inside_a_backup_write_resumes_from_the_previous_one(tmp_path, monkeypatch):
    # The third backup (step 12) dies after its weights are written, before the switch-in
    # rename: the job must resume from step 8's backup, with real Keras weights.
    want, _ = uninterrupted(kind="adam")
    from tfdp import resilience
    from tfdp.resilience import backups
    real_rename, calls = os.rename, []

    def dying_rename(src, dst):
        calls.append(dst)
        if os.path.basename(dst) == "step-000000000012":
            raise Crash("killed between the weights and the rename")
        return real_rename(src, dst)

    monkeypatch.setattr(backups.os, "rename", dying_rename)
    _, first = fit(tmp_path, crash_after=None)
    monkeypatch.setattr(backups.os, "rename", real_rename)
    assert first == list(range(1, 12))  # step 12 trained; its backup never switched in
    assert resilience.BackupStore(tmp_path).steps() == [8]
    got, second = fit(tmp_path)
    assert second[0] == 9
    assert_close(got, want)


def test_an_old_layout_backup_is_not_resumed_silently(tmp_path):
    (tmp_path / "training_metadata.json").write_text('{"epoch": 1}')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, ran = fit(tmp_path, crash_after=2)
    assert ran == [1, 2]  # started from the beginning
    assert any("does not resume" in str(w.message) for w in caught)


@pytest.mark.slow
def test_resume_from_a_tf_io_gfile_filesystem_is_step_exact():
    # TensorFlow's in-memory ram:// filesystem (tf.io.gfile, as gs:// and s3:// are reached).
    backup_dir = f"ram://tfdp-test-{os.getpid()}/backup"
    want, _ = uninterrupted(kind="adam")
    _, first = fit(backup_dir, crash_after=10)
    assert tf.io.gfile.exists(backup_dir + "/step-000000000008/meta.json")
    got, second = fit(backup_dir)
    assert first == list(range(1, 11)) and second == list(range(9, 19))
    assert_close(got, want)
    assert not tf.io.gfile.exists(backup_dir)  # deleted after the successful end
