"""Horovod's elastic synthetic benchmark, in the style of its
tensorflow2_synthetic_benchmark_elastic.py, on tfdp.

    tfdp-run -np 2 --min-np 1 --reset-limit 2 -- \
        python examples/horovod_elastic_synthetic_benchmark.py

The elastic form of examples/horovod_synthetic_benchmark.py, with one line changed (``import
horovod.tensorflow as hvd`` becomes ``import tfdp.horovod as hvd``): the model and optimizer
live in a ``hvd.elastic.TensorFlowKerasState`` with the benchmark's counters (``iter``,
``batch``, ``warm``, ``img_secs``), committed every ``--num_batches_per_commit`` steps and after
every timed iteration; ``@hvd.elastic.run`` resumes from the last commit after tfdp-run
restarts the job (a process failed), and the reset callback rescales the learning rate to the
new ``hvd.size()``. docs/horovod.md ("Elastic training") says what differs from Horovod's
in-process re-rendezvous.
"""

from __future__ import annotations

import os
import sys
import timeit

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401 (imports TensorFlow without its C++ startup notices)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "small_cnn", "small_cnn, or a keras.applications model name.")
flags.DEFINE_integer("batch_size", 32, "Batch size per process.")
flags.DEFINE_integer("image_size", 32, "Height and width of the synthetic images.")
flags.DEFINE_integer("num_warmup_batches", 2, "Untimed steps before the timed iterations.")
flags.DEFINE_integer("num_batches_per_iter", 5, "Steps per timed iteration.")
flags.DEFINE_integer("num_batches_per_commit", 1, "Steps between commits.")
flags.DEFINE_integer("num_iters", 3, "Timed iterations.")
flags.DEFINE_boolean("fp16_allreduce", False, "Horovod's Compression.fp16 on the wire.")


def _model(keras, classes):
    if FLAGS.model != "small_cnn":
        return getattr(keras.applications, FLAGS.model)(weights=None, classes=classes)
    return keras.Sequential([
        keras.Input((FLAGS.image_size, FLAGS.image_size, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(classes),
    ])


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp.horovod as hvd  # was: import horovod.tensorflow as hvd

    hvd.init()
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    classes = 1000 if FLAGS.model != "small_cnn" else 10
    lr = 0.01
    model = _model(keras, classes)
    opt = keras.optimizers.SGD(lr * hvd.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if FLAGS.fp16_allreduce else hvd.Compression.none
    rng = np.random.default_rng(hvd.rank())
    data = tf.constant(rng.random((FLAGS.batch_size, FLAGS.image_size, FLAGS.image_size, 3),
                                  dtype=np.float32))
    target = tf.constant(rng.integers(0, classes, FLAGS.batch_size))

    @tf.function
    def train_one_batch():
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))

    def benchmark_step(state):
        train_one_batch()
        if state is not None:
            state.batch += 1
            if state.batch == FLAGS.num_batches_per_commit:
                state.batch = 0
                state.commit()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {FLAGS.model}, batch size: {FLAGS.batch_size}, processes: {hvd.size()}")

    @hvd.elastic.run
    def run_benchmark(state):
        if not state.warm:
            log("Running warmup...")
            timeit.timeit(lambda: benchmark_step(state), number=FLAGS.num_warmup_batches)
            state.warm = True
            state.commit()
        if state.iter == 0:
            log("Running benchmark...")
        for x in range(state.iter, FLAGS.num_iters):
            seconds = timeit.timeit(lambda: benchmark_step(state),
                                    number=FLAGS.num_batches_per_iter)
            img_sec = FLAGS.batch_size * FLAGS.num_batches_per_iter / seconds
            log(f"Iter #{x}: {img_sec:.1f} img/sec per process")
            state.img_secs.append(img_sec)
            state.iter = x + 1
            state.commit()

    def on_state_reset():
        opt.learning_rate.assign(lr * hvd.size())  # Horovod's opt.lr (Keras 2)

    state = hvd.elastic.TensorFlowKerasState(model, opt, img_secs=[], iter=0, batch=0,
                                             warm=False)
    state.register_reset_callbacks([on_state_reset])
    run_benchmark(state)

    mean, spread = float(np.mean(state.img_secs)), 1.96 * float(np.std(state.img_secs))
    log(f"Img/sec per process: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} process(es): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * spread:.1f}")


if __name__ == "__main__":
    app.run(main)
