"""Multi-worker data-parallel training, launched on one host with tfdp-run:

    tfdp-run --workers 2 --cpu-replicas 2 -- python examples/multi_worker.py

On a cluster, run the same script on every host with TF_CONFIG set by the scheduler (see
README, "Running on a real cluster"). The chief saves the trained model; the job survives
preemption through tfdp.callbacks.BackupAndRestore (relaunch the same command).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401 (imports TensorFlow without its C++ startup notices)

FLAGS = flags.FLAGS
flags.DEFINE_integer("per_replica_batch", 32, "Batch size per replica.")
flags.DEFINE_integer("epochs", 30, "Training epochs.")
flags.DEFINE_string("model_dir", "/tmp/tfdp-multi-worker", "Where the chief saves the model and backups.")
flags.DEFINE_boolean("sharded", False, "Use tfdp.ShardedOptimizer (ZeRO-1) around LAMB.")


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines are noise here
    import keras
    import tensorflow as tf

    import tfdp
    from common import Throughput, build_model, load_digits

    strategy = tfdp.DataParallelStrategy()  # TF_CONFIG from tfdp-run or your scheduler
    cluster = strategy.cluster
    global_batch = FLAGS.per_replica_batch * strategy.num_replicas_in_sync
    print(f"worker {cluster.rank}/{cluster.num_workers} (chief={cluster.is_chief}): "
          f"{strategy.num_replicas_in_sync} replicas in sync, global batch {global_batch}",
          flush=True)

    (x_train, y_train), (x_test, y_test) = load_digits(image=True)
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x_train, y_train)),
                                 global_batch_size=global_batch, drop_remainder=True,
                                 shuffle_buffer=len(x_train), seed=0)
    steps = len(x_train) // global_batch
    schedule = tfdp.schedules.WarmupCosineDecay(
        tfdp.scale_learning_rate(0.01, 128, global_batch, rule="sqrt"),
        warmup_steps=steps * min(2, FLAGS.epochs), total_steps=steps * FLAGS.epochs)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras)
        optimizer = tfdp.optimizers.LAMB(schedule, weight_decay=1e-4)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        if FLAGS.sharded:
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    throughput = Throughput(steps * global_batch)
    backup = tfdp.callbacks.BackupAndRestore(os.path.join(FLAGS.model_dir, "backup"))
    # DatasetEpoch: a relaunched job replays exactly the shuffle order it would have seen.
    # shuffle=False: tfdp.data shuffles (shuffle_buffer); Keras cannot shuffle a dataset and warns.
    history = model.fit(train, epochs=FLAGS.epochs, verbose=0, shuffle=False,
                        callbacks=[backup, tfdp.callbacks.DatasetEpoch(train), throughput])
    print(f"final loss {history.history['loss'][-1]:.4f}, train accuracy "
          f"{history.history['accuracy'][-1]:.4f} (global metrics, same on every worker)")
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(f"throughput {throughput.samples_per_second:,.0f} samples/s across the cluster; "
          f"test accuracy {accuracy:.4f}", flush=True)
    # Only the chief writes to the final place; the others write to a private temp path.
    path = tfdp.callbacks.write_path(os.path.join(FLAGS.model_dir, "model.keras"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    model.save(path)
    if cluster.is_chief:
        print(f"saved {path}")


if __name__ == "__main__":
    app.run(main)
