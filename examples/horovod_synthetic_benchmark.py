"""Horovod's synthetic benchmark, in the style of its tensorflow2_synthetic_benchmark.py, on tfdp.

    tfdp-run -np 2 -- python examples/horovod_synthetic_benchmark.py
    tfdp-run -np 8 -H a:4,b:4 -- python examples/horovod_synthetic_benchmark.py --model ResNet50

A Horovod user's throughput check, with one line changed (``import horovod.tensorflow as
hvd`` becomes ``import tfdp.horovod as hvd``): random images and labels, a custom loop with
``hvd.DistributedGradientTape``, rank 0's variables broadcast after the first step (Horovod's
recipe: the optimizer's slots exist only then), warm-up steps, then timed iterations of
``--batches_per_iter`` steps each; rank 0 prints images per second per process and in total.
``--model`` is ``small_cnn`` (default: a few convolutions, sized for a CPU) or any
``keras.applications`` name (``ResNet50``; ``--image_size 224`` for its usual input).
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

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines are noise here
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
    model = _model(keras, classes)
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if FLAGS.fp16_allreduce else hvd.Compression.none
    rng = np.random.default_rng(hvd.rank())
    data = tf.constant(rng.random((FLAGS.batch_size, FLAGS.image_size, FLAGS.image_size, 3),
                                  dtype=np.float32))
    target = tf.constant(rng.integers(0, classes, FLAGS.batch_size))

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        # Horovod's recipe: broadcast after the first step, once the optimizer's slots exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {FLAGS.model}, batch size: {FLAGS.batch_size}, processes: {hvd.size()}")
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=FLAGS.num_warmup_batches)
    rates = []
    for i in range(FLAGS.num_iters):
        seconds = timeit.timeit(lambda: benchmark_step(first_batch=False),
                                number=FLAGS.num_batches_per_iter)
        rate = FLAGS.batch_size * FLAGS.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per process")
        rates.append(rate)
    mean, spread = float(np.mean(rates)), 1.96 * float(np.std(rates))
    log(f"Img/sec per process: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} process(es): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * spread:.1f}")


if __name__ == "__main__":
    app.run(main)
