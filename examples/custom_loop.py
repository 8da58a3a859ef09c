"""A custom training loop with tfdp: strategy.run, optimizer.apply, clipping, checkpoints.

Trains the examples' ConvNet on the handwritten-digits data bundled with scikit-learn (no
download) with a hand-written loop instead of ``model.fit``:

    python examples/custom_loop.py --replicas 4 --epochs 20
    tfdp-run --workers 2 --cpu-replicas 2 -- python examples/custom_loop.py

What each piece does under tfdp.DataParallelStrategy:

* ``tfdp.data.distribute`` shards and batches the input: every replica gets
  ``global_batch / replicas`` examples per step, every example once per epoch.
* Loss scaling: each replica returns ``sum of its examples' losses / global batch``. tfdp
  sums gradients over all replicas (of all workers), so the update follows the gradient of
  the global-batch mean, as on one device. (Keras's default loss reduction does the same
  by dividing the local mean by the number of replicas: exact when all replicas get equal
  batches; ``tf.nn.compute_average_loss(per_example, global_batch_size=...)`` is the same
  rule as used here.)
* ``optimizer.apply(grads, variables)`` inside ``strategy.run``: tfdp sums the gradients
  over the replicas, then the optimizer clips them (``global_clipnorm``) and updates. So
  the clipping sees the global gradient, as on one device. Pass the local gradients as
  they are: do not all-reduce them yourself (they would be summed twice) and do not clip
  them yourself (that would clip local gradients).
* Checkpoints: ``tf.train.Checkpoint`` + ``CheckpointManager``. Every worker saves (saving
  may need every worker), the chief into ``--model_dir`` and the others into a private
  temporary directory (``tfdp.callbacks.write_path``) that they delete. A relaunch
  resumes from the last epoch saved; with ``train.set_epoch`` the resumed epochs see the
  same data order as an uninterrupted run.
* ``strategy.step_deadline()`` around each step: with several workers, a step that runs
  longer than the strategy's ``timeout_seconds`` (a peer alive but stuck elsewhere) fails
  with ``DeadlineExceededError`` instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401 (imports TensorFlow without its C++ startup notices)

import tensorflow as tf
from absl import app, flags

import tfdp

FLAGS = flags.FLAGS


def define_flags():
    """Flags of the command line (defined only when run as a script, so tests can import
    the training functions without registering flags twice)."""
    flags.DEFINE_integer("replicas", 4, "Logical CPU replicas to create (ignored when GPUs "
                         "exist or under tfdp-run).")
    flags.DEFINE_integer("per_replica_batch", 32, "Batch size per replica.")
    flags.DEFINE_integer("epochs", 20, "Training epochs.")
    flags.DEFINE_float("learning_rate", 0.002, "Adam learning rate.")
    flags.DEFINE_float("global_clipnorm", 1.0, "Clip the global gradient norm to this "
                       "(0 = no clipping).")
    flags.DEFINE_string("model_dir", "/tmp/tfdp-custom-loop", "Checkpoints (the chief's).")
    flags.DEFINE_float("min_accuracy", 0.0, "Exit non-zero if test accuracy ends below this.")


def make_train_step(strategy, model, optimizer, loss_fn, global_batch):
    """Builds ``train_step(iterator)``: one step on the iterator's next global batch.

    Args:
        strategy: the strategy whose scope created ``model`` and ``optimizer`` (the default
            strategy for one device).
        model, optimizer: Keras objects created in ``strategy.scope()``.
        loss_fn: a Keras loss with ``reduction="sum"`` (a sum over the examples given).
        global_batch: examples per step over all replicas of all workers.

    Returns:
        ``train_step(iterator) -> (mean loss, correct predictions)`` over the global batch.
    """

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            # This replica's share of the global-batch mean (see the module docstring).
            loss = loss_fn(y, logits) / global_batch
        grads = tape.gradient(loss, model.trainable_variables)
        # tfdp: sum over replicas -> clip (global_clipnorm) -> update, inside apply.
        optimizer.apply(grads, model.trainable_variables)
        correct = tf.reduce_sum(tf.cast(
            tf.equal(tf.argmax(logits, axis=-1, output_type=y.dtype), y), tf.float32))
        return loss, correct

    @tf.function
    def train_step(iterator):
        x, y = next(iterator)
        loss, correct = strategy.run(replica_step, args=(x, y))
        sum_ = tf.distribute.ReduceOp.SUM
        return strategy.reduce(sum_, loss, axis=None), strategy.reduce(sum_, correct, axis=None)

    return train_step


def train(strategy, model, optimizer, loss_fn, train_data, steps_per_epoch, epochs,
          global_batch, checkpoint_dir=None, report=print):
    """Runs (or resumes) the loop; returns one ``(loss, accuracy)`` per epoch trained here.

    Args:
        train_data: a ``tfdp.data.distribute`` dataset (or any iterable of global batches
            for the default strategy), ``steps_per_epoch`` full global batches per epoch.
        checkpoint_dir: where the chief keeps checkpoints (None: no checkpoints). The loop
            resumes from the latest one there.
        report: called with one progress line per epoch.
    """
    train_step = make_train_step(strategy, model, optimizer, loss_fn, global_batch)
    # tfdp's strategy bounds each step by its timeout_seconds; the default strategy has none.
    step_deadline = getattr(strategy, "step_deadline", contextlib.nullcontext)
    with strategy.scope():
        optimizer.build(model.trainable_variables)  # slots exist before a restore
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    start_epoch = 0
    if checkpoint_dir:
        latest = tf.train.latest_checkpoint(checkpoint_dir)
        if latest:
            checkpoint.restore(latest).assert_existing_objects_matched()
            start_epoch = int(optimizer.iterations.numpy()) // steps_per_epoch
            if start_epoch >= epochs:
                report(f"{latest} has already trained {start_epoch} epoch(s): nothing left to "
                       f"train (raise the number of epochs, or delete {checkpoint_dir})")
            else:
                report(f"resumed from {latest} at epoch {start_epoch + 1}")
        # Chief: the real directory; other workers: a private temporary one (deleted below).
        write_dir = tfdp.callbacks.write_path(checkpoint_dir, strategy)
        manager = tf.train.CheckpointManager(checkpoint, write_dir, max_to_keep=2)
    history = []
    for epoch in range(start_epoch, epochs):
        if hasattr(train_data, "set_epoch"):
            train_data.set_epoch(epoch)  # epoch e's order depends on (seed, e) only
        iterator = iter(train_data)
        started = time.perf_counter()
        loss_sum = correct_sum = 0.0
        for _ in range(steps_per_epoch):
            with step_deadline():  # a peer that never joins the step: an error, not a hang
                loss, correct = train_step(iterator)
            loss_sum += float(loss)
            correct_sum += float(correct)
        seconds = time.perf_counter() - started
        history.append((loss_sum / steps_per_epoch, correct_sum / (steps_per_epoch * global_batch)))
        if checkpoint_dir:
            manager.save(checkpoint_number=epoch + 1)
            if write_dir != checkpoint_dir:  # a worker's private copy: delete it
                tf.io.gfile.rmtree(write_dir)
        report(f"epoch {epoch + 1}/{epochs}: loss {history[-1][0]:.4f} accuracy "
               f"{history[-1][1]:.4f} ({steps_per_epoch * global_batch / seconds:,.0f} samples/s)")
    return history


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines are noise here
    import keras
    import numpy as np

    from common import build_model, load_digits

    if not os.environ.get("TF_CONFIG") and not tf.config.list_physical_devices("GPU"):
        tfdp.configure_cpu_replicas(FLAGS.replicas)  # before anything starts TensorFlow

    strategy = tfdp.DataParallelStrategy()
    chief = strategy.cluster.is_chief
    report = print if chief else (lambda line: None)  # the chief reports for the job
    replicas = strategy.num_replicas_in_sync
    global_batch = FLAGS.per_replica_batch * replicas
    report(f"tfdp: {strategy.cluster.num_workers} worker(s), {replicas} replica(s), "
           f"communication={strategy.communication}, global batch {global_batch}")

    (x_train, y_train), (x_test, y_test) = load_digits(image=True)
    train_data = tfdp.data.distribute(
        strategy, tf.data.Dataset.from_tensor_slices((x_train, y_train)),
        global_batch_size=global_batch, shuffle_buffer=len(x_train), seed=0,
        drop_remainder=True)  # equal per-replica batches: the loss scaling stays exact
    steps_per_epoch = len(x_train) // global_batch
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras)
        optimizer = keras.optimizers.Adam(
            FLAGS.learning_rate, global_clipnorm=FLAGS.global_clipnorm or None)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    train(strategy, model, optimizer, loss_fn, train_data, steps_per_epoch, FLAGS.epochs,
          global_batch, checkpoint_dir=FLAGS.model_dir, report=report)

    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == y_test))
    report(f"test accuracy: {accuracy:.4f}")
    if accuracy < FLAGS.min_accuracy:
        print(f"FAILED: accuracy {accuracy:.4f} < {FLAGS.min_accuracy}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
