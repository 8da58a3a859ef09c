"""A plain Keras script, run unchanged on several workers (issue 18).

tests/test_keras_script.py starts it through tfdp-run (2 workers) and also calls ``main`` in
its own process as the one-process reference. Nothing in it knows about workers: the only
tfdp line is the strategy (and ShardedOptimizer when asked for).

Phases (``KS_PHASES``, comma-separated; each writes under OUT/<phase>/):

* ``fit``: the issue's script: ModelCheckpoint (best ``.keras``, per-epoch ``.weights.h5``,
  every 3 steps, ``{val_loss}`` in the path), TensorBoard, CSVLogger, EarlyStopping,
  ReduceLROnPlateau, TerminateOnNaN, Keras's BackupAndRestore; ``fit`` with validation data and
  ``verbose=2``; then ``model.save``, ``save_weights``, ``export``, ``evaluate``, ``predict``.
* ``early_stop``: EarlyStopping(patience=1) and ReduceLROnPlateau(patience=0) on a validation
  loss that rises.
* ``nan``: one training sample's weight is NaN, so one worker's local loss is NaN at one step;
  TerminateOnNaN.
* ``local_stop``: a callback that stops training on the last worker only.
* ``ctl``: a custom training loop with tf.train.CheckpointManager and tf.summary (the
  TensorFlow tutorial's pattern, without its hand-made chief/temporary-directory code).

Each worker writes what the test compares to OUT/records/rank<R>.json (its logs, epochs,
learning rates, pid) and OUT/records/rank<R>-<phase>.npz (predictions, weights), with plain
``open``/``numpy`` writes that tfdp leaves alone. Env: TFDP_TEST_OUT, KS_PHASES, KS_OPT
(adam | sharded_adam), KS_EPOCHS.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras

import tfdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import classification_data, initial_weights, mlp

GLOBAL_BATCH = 32
PROBE = classification_data(n=256)[0][:16]


def _optimizer(name):
    if name == "sharded_adam":
        return tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01))
    return keras.optimizers.Adam(0.01)


def _compiled_model(strategy, opt_name):
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=_optimizer(opt_name),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


class _Recorder(keras.callbacks.Callback):
    """This worker's view of every epoch: the logs its callbacks decided on."""

    def __init__(self, record):
        super().__init__()
        self.record = record
        record.update(epochs=[], logs=[], lr=[], batches=0)

    def on_train_batch_end(self, batch, logs=None):
        self.record["batches"] += 1

    def on_epoch_end(self, epoch, logs=None):
        self.record["epochs"].append(epoch)
        self.record["logs"].append({k: float(v) for k, v in (logs or {}).items()})
        self.record["lr"].append(float(keras.ops.convert_to_numpy(
            self.model.optimizer.learning_rate)))


def _datasets(y_val=None):
    xs, ys = classification_data(n=256)
    xv, yv = classification_data(n=64, seed=1)
    train = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(GLOBAL_BATCH)
    if y_val is not None:  # validation on the training inputs with wrong labels: rises
        xv, yv = xs, y_val
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(GLOBAL_BATCH)
    return train, val


def phase_fit(strategy, out, opt_name, epochs, record, arrays):
    """The issue's script, unchanged but for the paths."""
    model = _compiled_model(strategy, opt_name)
    train, val = _datasets()
    cbs = [keras.callbacks.ModelCheckpoint(out + "/ckpt/best.keras", save_best_only=True,
                                           monitor="val_loss"),
           keras.callbacks.ModelCheckpoint(out + "/ckpt/w-{epoch:02d}.weights.h5",
                                           save_weights_only=True),
           keras.callbacks.ModelCheckpoint(out + "/ckpt/steps/s-{epoch:02d}-{batch:02d}.weights.h5",
                                           save_weights_only=True, save_freq=3),
           keras.callbacks.ModelCheckpoint(out + "/ckpt/m-{epoch:02d}-{val_loss:.3f}.keras"),
           keras.callbacks.TensorBoard(out + "/tb"),
           keras.callbacks.CSVLogger(out + "/log.csv"),
           keras.callbacks.EarlyStopping(patience=3),
           keras.callbacks.ReduceLROnPlateau(),
           keras.callbacks.TerminateOnNaN(),
           keras.callbacks.BackupAndRestore(out + "/backup", delete_checkpoint=False),
           _Recorder(record)]
    model.fit(train, validation_data=val, epochs=epochs, callbacks=cbs, verbose=2)
    model.save(out + "/final.keras")
    model.save_weights(out + "/final.weights.h5")
    model.export(out + "/export", verbose=False)
    record["evaluate"] = {k: float(v) for k, v in
                          model.evaluate(val, verbose=0, return_dict=True).items()}
    arrays["pred"] = model.predict(PROBE, verbose=0)


def phase_early_stop(strategy, out, opt_name, epochs, record, arrays):
    model = _compiled_model(strategy, opt_name)
    _, y = classification_data(n=256)
    train, val = _datasets(y_val=(y + 1) % 3)
    cbs = [keras.callbacks.EarlyStopping(patience=1),
           keras.callbacks.ReduceLROnPlateau(patience=0, factor=0.5, min_delta=0.0),
           _Recorder(record)]
    model.fit(train, validation_data=val, epochs=10, callbacks=cbs, verbose=0)


def phase_nan(strategy, out, opt_name, epochs, record, arrays):
    model = _compiled_model(strategy, opt_name)
    x, y = classification_data(n=256)
    # One sample of the second step (one worker sees it) has a NaN weight. Not a NaN input:
    # on AVX-512 hosts oneDNN's fused MatMul+ReLU maps NaN to 0 (x86 max), and the loss stays
    # finite even on one device (measured with Keras 3.15, TF 2.21).
    weights = np.ones(len(x), np.float32)
    weights[GLOBAL_BATCH + 3] = np.nan
    train = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(GLOBAL_BATCH)
    model.fit(train, epochs=2, callbacks=[keras.callbacks.TerminateOnNaN(), _Recorder(record)],
              verbose=0)


class _StopOnLastWorker(keras.callbacks.Callback):
    """A worker-local decision (a wall-clock limit, say): only the last worker stops."""

    def on_epoch_end(self, epoch, logs=None):
        cluster = getattr(self.model.distribute_strategy, "cluster", None)
        if cluster is not None and cluster.rank == cluster.num_workers - 1:
            self.model.stop_training = True


def phase_local_stop(strategy, out, opt_name, epochs, record, arrays):
    model = _compiled_model(strategy, opt_name)
    train, _ = _datasets()
    model.fit(train, epochs=3, callbacks=[_StopOnLastWorker(), _Recorder(record)], verbose=0)


def phase_ctl(strategy, out, opt_name, epochs, record, arrays):
    """TensorFlow's custom-training-loop tutorial, saving and summaries as in one process."""
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        optimizer = keras.optimizers.Adam(0.01)
        # Built here, as docs/custom_loops.md says: a Keras 3 optimizer first built inside the
        # multi-worker tf.function fails ("must feed a value for placeholder ... cond").
        optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, out + "/ckpt", max_to_keep=2)
    writer = tf.summary.create_file_writer(out + "/tb")
    train, _ = _datasets()
    dist = strategy.experimental_distribute_dataset(train)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(x, y):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)

    record["saved"] = []
    for epoch in range(3):
        losses = [float(train_step(x, y)) for x, y in dist]
        with writer.as_default():
            tf.summary.scalar("loss", sum(losses) / len(losses), step=epoch)
        record["saved"].append(manager.save())
    writer.close()
    _tutorial_checkpoint_idiom(strategy, checkpoint, out, record)
    record["latest"] = manager.latest_checkpoint
    record["checkpoints"] = list(manager.checkpoints)
    for i, w in enumerate(model.get_weights()):
        arrays[f"w{i}"] = w
    arrays["iterations"] = np.asarray(int(optimizer.iterations.numpy()))


def _tutorial_checkpoint_idiom(strategy, checkpoint, out, record):
    """The checkpoint idiom of TensorFlow's multi-worker custom-loop tutorial, word for word
    but for where the task comes from: a worker other than the chief saves into a temporary
    directory of its own and removes it. And is_chief() outside any scope."""
    task_type, task_id = strategy.cluster.task_type, strategy.cluster.task_index

    def _is_chief(task_type, task_id):
        return task_type == "chief" or (task_type == "worker" and task_id == 0)

    def _get_temp_dir(dirpath, task_id):
        temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
        tf.io.gfile.makedirs(temp_dir)
        return temp_dir

    def write_filepath(filepath, task_type, task_id):
        dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
        if not _is_chief(task_type, task_id):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    write_checkpoint_dir = write_filepath(out + "/tutorial_ckpt", task_type, task_id)
    manager = tf.train.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    manager.save()
    if not _is_chief(task_type, task_id):
        record["listed"] = tf.io.gfile.listdir(write_checkpoint_dir)
        tf.io.gfile.rmtree(write_checkpoint_dir)
    record["is_chief_outside_scope"] = tfdp.callbacks.is_chief()


PHASES = {"fit": phase_fit, "early_stop": phase_early_stop, "nan": phase_nan,
          "local_stop": phase_local_stop, "ctl": phase_ctl}


def main(out, phases, opt_name="adam", epochs=5, strategy=None):
    """Runs ``phases`` under ``strategy`` (default: tfdp.DataParallelStrategy()); returns the
    records and arrays of this worker (also written to OUT/records/)."""
    strategy = strategy or tfdp.DataParallelStrategy()
    cluster = strategy.cluster
    records = {"pid": os.getpid(), "rank": cluster.rank,
               "replicas": strategy.num_replicas_in_sync}
    os.makedirs(os.path.join(out, "records"), exist_ok=True)
    all_arrays = {}
    for phase in phases:
        record, arrays = {}, {}
        PHASES[phase](strategy, os.path.join(out, phase), opt_name, epochs, record, arrays)
        records[phase] = record
        all_arrays[phase] = arrays
        if arrays:
            np.savez(os.path.join(out, "records", f"rank{cluster.rank}-{phase}.npz"), **arrays)
    with open(os.path.join(out, "records", f"rank{cluster.rank}.json"), "w") as f:
        json.dump(records, f)
    print(f"rank {cluster.rank}: done", flush=True)
    return records, all_arrays


if __name__ == "__main__":
    main(os.environ["TFDP_TEST_OUT"], os.environ.get("KS_PHASES", "fit").split(","),
         os.environ.get("KS_OPT", "adam"), int(os.environ.get("KS_EPOCHS", "5")))
