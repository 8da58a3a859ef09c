"""A plain Keras script, unchanged on several workers, and what saving costs there.

    python examples/keras_script.py --out /tmp/ks-1                       # one process
    tfdp-run --workers 2 -- python examples/keras_script.py --out /tmp/ks-2

The script is the one every Keras guide has: ModelCheckpoint (best ``.keras`` and one
``.weights.h5`` per epoch), TensorBoard, CSVLogger, EarlyStopping, ReduceLROnPlateau, then
``model.save``. Only the strategy line is tfdp's. On several workers only the chief writes
under ``--out`` (the others write to a private temporary directory and remove it), and every
worker takes the same EarlyStopping / ReduceLROnPlateau decisions (docs/keras_script.md).

It prints, on the chief, how long the saves took: the per-epoch ModelCheckpoint saves and
the final ``model.save``, so the cost of saving on several workers (every worker runs the
save, so the collectives saving needs run everywhere) can be compared with one process.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401 (imports TensorFlow without its C++ startup notices)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "/tmp/tfdp-keras-script", "Output directory (shared by all workers).")
flags.DEFINE_integer("epochs", 5, "Training epochs.")
flags.DEFINE_integer("width", 1024, "Hidden width of the MLP (the size of what is saved).")
flags.DEFINE_integer("per_replica_batch", 64, "Batch size per replica.")
flags.DEFINE_boolean("sharded", False, "Wrap Adam in tfdp.ShardedOptimizer (saving gathers "
                     "its state across workers).")


def main(argv):
    del argv
    from absl import logging as absl_logging

    # absl's app.run logs at INFO, which would show TensorFlow's per-collective INFO lines.
    absl_logging.set_verbosity(absl_logging.WARNING)
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp
    from common import load_digits

    strategy = tfdp.DataParallelStrategy()
    chief = tfdp.callbacks.is_chief(strategy)
    global_batch = FLAGS.per_replica_batch * strategy.num_replicas_in_sync
    (x, y), (x_test, y_test) = load_digits()
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).batch(global_batch)
    val = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    with strategy.scope():
        model = keras.Sequential([keras.Input(x.shape[1:]),
                                  keras.layers.Dense(FLAGS.width, activation="relu"),
                                  keras.layers.Dense(FLAGS.width, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-3)
        if FLAGS.sharded:
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer=optimizer, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out = FLAGS.out
    save_seconds = []

    class TimedCheckpoint(keras.callbacks.ModelCheckpoint):
        """ModelCheckpoint, timed (for this example's report only)."""

        def on_epoch_end(self, epoch, logs=None):
            start = time.perf_counter()
            super().on_epoch_end(epoch, logs)
            save_seconds.append(time.perf_counter() - start)

    callbacks = [keras.callbacks.ModelCheckpoint(out + "/ckpt/best.keras", save_best_only=True),
                 TimedCheckpoint(out + "/ckpt/epoch-{epoch:02d}.keras"),
                 keras.callbacks.ModelCheckpoint(out + "/ckpt/w-{epoch:02d}.weights.h5",
                                                 save_weights_only=True),
                 keras.callbacks.TensorBoard(out + "/tb"),
                 keras.callbacks.CSVLogger(out + "/log.csv"),
                 keras.callbacks.EarlyStopping(patience=3),
                 keras.callbacks.ReduceLROnPlateau()]
    model.fit(train, validation_data=val, epochs=FLAGS.epochs, callbacks=callbacks,
              verbose=2)
    start = time.perf_counter()
    model.save(out + "/final.keras")
    final_seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(val, verbose=0)
    # Like fit and evaluate, predict runs collectives on a distributed model: every worker calls it.
    predicted = model.predict(x_test[:8], verbose=0)
    params = model.count_params()
    if chief:
        size = os.path.getsize(out + "/final.keras") / 2**20
        print(f"workers {strategy.cluster.num_workers}, replicas {strategy.num_replicas_in_sync}, "
              f"{params:,} parameters, final.keras {size:.1f} MiB")
        print(f"ModelCheckpoint(.keras) per epoch: median {statistics.median(save_seconds):.3f} s "
              f"(min {min(save_seconds):.3f}, max {max(save_seconds):.3f}, "
              f"{len(save_seconds)} epochs); model.save: {final_seconds:.3f} s")
        print(f"test accuracy: {accuracy:.4f} (loss {loss:.4f}); files under {out}: "
              f"{sorted(os.listdir(out))}")
        # The saved model, loaded in this process without the strategy, is the model in memory.
        np.testing.assert_allclose(
            keras.saving.load_model(out + "/final.keras").predict(x_test[:8], verbose=0),
            predicted, atol=1e-5)


if __name__ == "__main__":
    app.run(main)
