"""Data-parallel Keras training with tfdp on logical CPU replicas (or your GPUs).

Trains a ConvNet on the handwritten-digits data bundled with scikit-learn (no download),
reports test accuracy and throughput.

    python examples/keras_fit.py --replicas 4 --epochs 40
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401 (imports TensorFlow without its C++ startup notices)

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 4, "Logical CPU replicas to create (ignored when GPUs exist).")
flags.DEFINE_integer("per_replica_batch", 32, "Batch size per replica.")
flags.DEFINE_integer("epochs", 40, "Training epochs.")
flags.DEFINE_float("base_lr", 0.002, "Adam learning rate at global batch 128 (scaled by sqrt rule).")
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd", "lamb", "lars"], "Optimizer.")
flags.DEFINE_boolean("sharded", False, "Wrap the optimizer in tfdp.ShardedOptimizer (ZeRO-1).")
flags.DEFINE_float("min_accuracy", 0.0, "Exit non-zero if test accuracy ends below this.")


def make_optimizer(tfdp, keras, lr):
    if FLAGS.optimizer == "adam":
        opt = keras.optimizers.Adam(lr)
    elif FLAGS.optimizer == "sgd":
        opt = keras.optimizers.SGD(lr * 20, momentum=0.9)
    elif FLAGS.optimizer == "lamb":
        opt = tfdp.optimizers.LAMB(lr * 5, weight_decay=1e-4)
    else:
        opt = tfdp.optimizers.LARS(lr * 500, weight_decay=1e-4)
    if FLAGS.sharded:
        opt = tfdp.ShardedOptimizer(opt)
    return opt


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines are noise here
    import tfdp

    if not os.environ.get("TF_CONFIG"):
        import tensorflow as tf
        if not tf.config.list_physical_devices("GPU"):
            tfdp.configure_cpu_replicas(FLAGS.replicas)
    import keras
    import tensorflow as tf
    from common import Throughput, build_model, load_digits

    strategy = tfdp.DataParallelStrategy()
    replicas = strategy.num_replicas_in_sync
    global_batch = FLAGS.per_replica_batch * replicas
    lr = tfdp.scale_learning_rate(FLAGS.base_lr, 128, global_batch, rule="sqrt")
    print(f"tfdp: {strategy.cluster.num_workers} worker(s), {replicas} replica(s) on "
          f"{strategy.local_devices}, communication={strategy.communication}, "
          f"global batch {global_batch}, lr {lr:.4g}", flush=True)

    (x_train, y_train), (x_test, y_test) = load_digits(image=True)
    train = tfdp.data.distribute(
        strategy, tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
            len(x_train), seed=0, reshuffle_each_iteration=True),
        global_batch_size=global_batch, drop_remainder=True)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras)
        model.compile(optimizer=make_optimizer(tfdp, keras, lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    throughput = Throughput(len(x_train) // global_batch * global_batch)

    class Progress(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch % 10 == 9 or epoch == FLAGS.epochs - 1:
                print(f"epoch {epoch + 1}/{FLAGS.epochs}: loss {logs['loss']:.4f} "
                      f"accuracy {logs['accuracy']:.4f}", flush=True)

    # shuffle=False: the dataset shuffles itself; Keras cannot shuffle a dataset and warns.
    model.fit(train, epochs=FLAGS.epochs, verbose=0, shuffle=False,
              callbacks=[throughput, Progress()])
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(f"throughput: {throughput.samples_per_second:,.0f} samples/s "
          f"({replicas} replicas, median of epochs 2..{FLAGS.epochs})")
    print(f"test accuracy: {accuracy:.4f}")
    if accuracy < FLAGS.min_accuracy:
        print(f"FAILED: accuracy {accuracy:.4f} < {FLAGS.min_accuracy}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
