"""A Horovod Keras script on tfdp: Horovod's keras_mnist.py with one line changed.

    tfdp-run -np 2 -- python examples/horovod_keras.py --epochs 6
    tfdp-run -np 8 -H a:4,b:4 -- python examples/horovod_keras.py

The only change from Horovod is the import (``import horovod.tensorflow.keras as hvd``
becomes ``import tfdp.horovod.keras as hvd``) and the launcher (``horovodrun`` becomes
``tfdp-run``). Everything else is the Horovod recipe: one process per replica, the model
built outside any strategy scope, the dataset sharded by rank, the learning rate scaled by
the number of processes and warmed up, the optimizer wrapped, rank 0's weights broadcast
before training, the metrics averaged, and only rank 0 writes checkpoints and prints.
Data: the handwritten digits bundled with scikit-learn (no download). docs/horovod.md is the
migration guide.
"""

from __future__ import annotations

import os
import sys
import tempfile

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # imports TensorFlow without its C++ startup notices

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 32, "Batch size per process.")
flags.DEFINE_integer("epochs", 6, "Training epochs.")
flags.DEFINE_float("lr", 0.001, "Learning rate of one process (scaled by hvd.size()).")
flags.DEFINE_integer("warmup_epochs", 2, "Epochs of learning-rate warm-up.")
flags.DEFINE_string("checkpoint_dir", None, "Where rank 0 writes checkpoints (default: a "
                    "temporary directory).")


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines are noise here
    import keras
    import tensorflow as tf

    import tfdp.horovod.keras as hvd  # was: import horovod.tensorflow.keras as hvd

    # Horovod: initialize Horovod, then pin one GPU per process (before TensorFlow starts).
    hvd.init()
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (x_train, y_train), (x_test, y_test) = common.load_digits(image=True)
    # Horovod: each process reads its own shard of the data.
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank()).repeat().shuffle(2000, seed=hvd.rank())
               .batch(FLAGS.batch_size))
    steps_per_epoch = len(x_train) // (FLAGS.batch_size * hvd.size())

    model = common.build_model(keras)
    # Horovod: scale the learning rate by the number of processes, wrap the optimizer.
    scaled_lr = FLAGS.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=optimizer, metrics=["accuracy"])

    callbacks = [
        # Horovod: start every process from rank 0's weights, average the epoch's metrics.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: from lr / size to lr over the first epochs (Goyal et al., 2017).
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=FLAGS.warmup_epochs,
                                                 momentum_correction=False, verbose=1),
    ]
    # Horovod: only rank 0 writes checkpoints.
    if hvd.rank() == 0:
        folder = FLAGS.checkpoint_dir or tempfile.mkdtemp(prefix="horovod-keras-")
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "checkpoint-{epoch}.keras")))
        print(f"{hvd.size()} process(es), {steps_per_epoch} steps per epoch, checkpoints in "
              f"{folder}", flush=True)

    model.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=FLAGS.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    # Every process evaluates its shard of the test set; the mean is the whole set's.
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).shard(hvd.size(), hvd.rank())
    loss, accuracy = model.evaluate(test.batch(256), verbose=0)
    accuracy = float(hvd.allreduce(tf.constant(accuracy)))
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f} (mean over {hvd.size()} shard(s))", flush=True)


if __name__ == "__main__":
    app.run(main)
