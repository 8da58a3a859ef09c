"""Every epoch of ``fit`` in one device's order (issue 56).

A user's ``dataset.shuffle(...)`` reshuffles once per iterator made of it, so the order of
epoch e depends on how many iterators were made before it. Keras on one device makes two per
epoch (the epoch's own and an unused one after its last step); tfdp skips building the unused
distributed iterator but still makes its draw (tfdp/_tf_private/keras_trainer.py), so every
epoch, validation and ``predict`` see one device's order.

Each test records which examples every step trains on: a layer hands its input's example ids
to Python (``tf.py_function``) with the replica that saw them; a step's global batch is the
replicas' slices in replica order. The sequence of global batches, step by step, is compared
with one device's. Idioms: seeded and unseeded shuffles (under
``keras.utils.set_random_seed``), 2 and 4 replicas, a dataset of unknown length, a validation
set with its own shuffle, ``steps_per_epoch`` on a repeated dataset, ``initial_epoch``, several
``fit`` calls in a row and ``predict``, and BackupAndRestore resuming a relaunched job. The
guard shows the comparison fails without the draws (the defect of issue 56).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from helpers import cpu_devices
from tfdp._tf_private import keras_trainer
from epoch_order_cases import (EPOCHS, PREDICT_IDS, TRAIN_IDS, VAL_IDS, dataset,
                               model_in, seen as _seen, steps)

def strategy_of(replicas):
    if replicas == 1:
        return tf.distribute.get_strategy()
    return tfdp.DataParallelStrategy(devices=cpu_devices(replicas))


def record(replicas, run):
    """The global batches of ``run(strategy)`` on ``replicas`` (1: one device, no strategy);
    the global seed is set first, as a user's script does, so unseeded shuffles draw alike."""
    del _seen[:]
    keras.utils.set_random_seed(1)
    run(strategy_of(replicas))
    return steps(replicas)


def fit_epochs(seeded=True, unknown_length=False, validation=False):
    def run(strategy):
        model = model_in(strategy)
        val = dataset(VAL_IDS, seeded) if validation else None
        model.fit(dataset(TRAIN_IDS, seeded, unknown_length), epochs=EPOCHS, verbose=0,
                  validation_data=val)
    return run


def assert_same_order(replicas, run, epochs_steps=None):
    one, many = record(1, run), record(replicas, run)
    assert len(one) == len(many) and (epochs_steps is None or len(one) == epochs_steps)
    for i, (a, b) in enumerate(zip(one, many)):
        assert a == b, f"step {i}: one device {a}, {replicas} replicas {b}"
    # The run reshuffled: the epochs are not all one order (else the test proves nothing).
    train = [tuple(s) for s in one if s[0] < 100]
    assert len(set(train)) > 2, train
    return one


@pytest.mark.parametrize("seeded,replicas", [
    pytest.param(True, 2, id="seeded-2"), pytest.param(False, 4, id="unseeded-4"),
    # the other two corners run in the whole suite only (the quick subset's bound, README)
    pytest.param(True, 4, id="seeded-4", marks=pytest.mark.slow),
    pytest.param(False, 2, id="unseeded-2", marks=pytest.mark.slow)])
def test_every_epoch_and_validation_in_one_devices_order(seeded, replicas):
    # 3 epochs of 2 training steps, each followed by 2 validation steps of a shuffled set
    assert_same_order(replicas, fit_epochs(seeded, validation=True), EPOCHS * 4)


def test_unknown_length_in_one_devices_order():
    # Keras makes one iterator per epoch here: each epoch ends on the end of its data
    assert_same_order(2, fit_epochs(unknown_length=True), EPOCHS * 2)


def test_steps_per_epoch_on_a_repeated_dataset_in_one_devices_order():
    def run(strategy):
        model_in(strategy).fit(dataset(TRAIN_IDS, repeat=True), epochs=EPOCHS, verbose=0,
                               steps_per_epoch=3)  # epochs cut across the shuffled passes
    assert_same_order(2, run, EPOCHS * 3)


def test_initial_epoch_in_one_devices_order():
    def run(strategy):
        model_in(strategy).fit(dataset(TRAIN_IDS), epochs=EPOCHS + 1, initial_epoch=1,
                               verbose=0)
    assert_same_order(4, run, EPOCHS * 2)


def test_several_fits_then_predict_in_one_devices_order():
    def run(strategy):
        model, ds = model_in(strategy), dataset(TRAIN_IDS)
        model.fit(ds, epochs=2, verbose=0)
        model.fit(ds, epochs=2, verbose=0)
        model.predict(dataset(PREDICT_IDS), verbose=0)
        model.predict(dataset(PREDICT_IDS), verbose=0)
    one = assert_same_order(2, run, 4 * 2 + 2)
    assert sorted(one[-1]) == list(PREDICT_IDS)


def test_guard_without_the_draws_epoch_two_is_one_no_device_sees(monkeypatch):
    """Issue 56's defect: with the unused iterator's draw left out, epoch 2 of 4 replicas
    trains on an order one device never sees (and epoch 3 on one device's epoch 2)."""
    monkeypatch.setattr(keras_trainer, "make_draws_of_iterators", lambda dataset, count: None)
    one, many = record(1, fit_epochs()), record(4, fit_epochs())
    assert one[:2] == many[:2]  # epoch 1 agrees
    assert many[2:4] != one[2:4] and many[4:6] == one[2:4]


def test_keras_iterators_before_epoch_counts_one_devices_iterators():
    count = keras_trainer.keras_iterators_before_epoch
    assert [count(e, True, None) for e in range(4)] == [0, 2, 4, 6]
    assert [count(e, False, None) for e in range(4)] == [0, 1, 2, 3]
    assert count(2, True, 5) is None


@pytest.mark.parametrize("draws,unknown_length", [
    (True, False), (False, False), (True, True)],
    ids=["resumed", "guard_without_draws", "resumed_unknown_length"])
def test_backup_and_restore_resumes_in_the_uninterrupted_order(tmp_path, monkeypatch, draws,
                                                               unknown_length):
    """A job stopped after epoch 2 and relaunched (a fresh model and dataset, the global seed
    set again, as a new process would) trains epoch 3 on the uninterrupted run's order. The
    guard: without the draws of the iterators the uninterrupted run made before epoch 3, the
    relaunch trains it on the order of epoch 1."""
    if not draws:
        monkeypatch.setattr(tfdp.callbacks.BackupAndRestore, "_draw_orders_before",
                            lambda self, epoch: None)

    class StopAfterSecondEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt  # after BackupAndRestore wrote the epoch's backup

    def launch(strategy, stop):
        model = model_in(strategy)
        backup = tfdp.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        callbacks = [backup] + ([StopAfterSecondEpoch()] if stop else [])
        model.fit(dataset(TRAIN_IDS, unknown_length=unknown_length), epochs=EPOCHS, verbose=0,
                  callbacks=callbacks)

    uninterrupted = record(2, fit_epochs(unknown_length=unknown_length))
    del _seen[:]
    keras.utils.set_random_seed(1)
    strategy = strategy_of(2)
    with pytest.raises(KeyboardInterrupt):
        launch(strategy, stop=True)
    first = steps(2)
    del _seen[:]
    keras.utils.set_random_seed(1)  # the relaunched process
    launch(strategy, stop=False)
    resumed = steps(2)
    assert first == uninterrupted[:4]
    assert len(resumed) == 2, resumed  # only epoch 3 ran
    if draws:
        assert resumed == uninterrupted[4:6]
    else:
        assert resumed == uninterrupted[:2] != uninterrupted[4:6]


def tutorial_loss(strategy):
    """TensorFlow's Keras distributed-training tutorial (tensorflow.org/tutorials/distribute/
    keras) with its shuffle seeded, on MNIST-shaped synthetic data (no download here): the
    final epoch's training loss after 2 epochs at global batch 128 with Adam."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(1024, 28, 28, 1), dtype=np.uint8)
    labels = (images[:, 10:18, 10:18, 0].mean(axis=(1, 2)) // 26).astype("int64") % 10

    def scale(image, label):
        return tf.cast(image, tf.float32) / 255.0, label

    keras.utils.set_random_seed(1)
    train = (tf.data.Dataset.from_tensor_slices((images, labels)).map(scale).cache()
             .shuffle(10000, seed=7).batch(128))
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model.fit(train, epochs=2, verbose=0).history["loss"][-1]


@pytest.mark.slow
def test_tensorflows_keras_tutorial_ends_at_one_devices_loss():
    one = tutorial_loss(strategy_of(1))
    two = tutorial_loss(strategy_of(2))
    print(f"tutorial: final loss one device {one:.7f}, tfdp on 2 replicas {two:.7f}")
    assert abs(two - one) <= 1e-5 * abs(one), (one, two)


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_workers_train_every_epoch_in_one_devices_order(tmp_path):
    """2 workers x 1 replica on a batched ``from_tensor_slices`` (DATA sharding: each worker
    keeps its rows of every global batch), an unseeded shuffle (tfdp seeds it alike on every
    worker, docs/data.md): every step of every epoch is one device's global batch."""
    import json

    from launching import run_job, tfdp_run_command, worker_env, worker_script

    environ = worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_SEEDED=0, TF_CPP_MIN_LOG_LEVEL=2)
    code, out = run_job(tfdp_run_command(worker_script("epoch_order_worker.py")), environ, 240)
    assert code == 0, out
    ranks = [json.loads((tmp_path / f"order-{rank}.json").read_text()) for rank in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == EPOCHS * 2
    two_workers = [a[1] + b[1] for a, b in zip(*ranks)]
    assert two_workers == record(1, fit_epochs(seeded=False))
