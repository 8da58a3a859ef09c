"""A DLRM-style click-through-rate model in plain Keras, trained data-parallel with tfdp on
synthetic click logs (no download).

Each categorical feature (user, item, item category, device) has its own
``keras.layers.Embedding`` table, the user table large (``--rows``, 200,000 by default); the
dense features go through a bottom MLP; the feature vectors interact by pairwise dot products
(the upper triangle of X Xᵀ, DLRM's interaction); a top MLP gives the click probability.
Binary cross-entropy, Adagrad (or Adam), AUC.

The clicks are drawn from a hidden logistic model over latent vectors of the user and the
item, biases of the category and the device and the dense features, with power-law
(Zipf-like) id frequencies, so that a few users and items are seen often and most rarely.
The script prints each epoch's loss and AUC, the final validation AUC, and the AUC of the
hidden model itself on the same validation clicks (the best any model can do).

    python examples/recommender.py --replicas 4 --epochs 3
    python examples/recommender.py --sharded                    # tfdp.ShardedOptimizer (ZeRO-1)
    tfdp-run --workers 2 --cpu-replicas 2 -- python examples/recommender.py
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401 (imports TensorFlow without its C++ startup notices)

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 4, "Logical CPU replicas to create (ignored when GPUs exist "
                     "or under tfdp-run, whose --cpu-replicas decides).")
flags.DEFINE_integer("rows", 200_000, "Rows of the user embedding table (users).")
flags.DEFINE_integer("items", 20_000, "Rows of the item embedding table (items).")
flags.DEFINE_integer("examples", 262_144, "Training clicks.")
flags.DEFINE_integer("val_examples", 32_768, "Validation clicks (drawn apart, same model).")
flags.DEFINE_integer("per_replica_batch", 256, "Batch size per replica.")
flags.DEFINE_integer("epochs", 3, "Training epochs.")
flags.DEFINE_integer("dim", 16, "Embedding size (and the bottom MLP's output size).")
flags.DEFINE_enum("optimizer", "adagrad", ["adagrad", "adam"], "Optimizer.")
flags.DEFINE_float("lr", 0.0, "Learning rate at global batch 1024, scaled by the sqrt rule "
                   "(0: 0.15 for Adagrad, 1e-3 for Adam).")
flags.DEFINE_boolean("sharded", False, "Wrap the optimizer in tfdp.ShardedOptimizer (ZeRO-1).")
flags.DEFINE_float("min_auc", 0.0, "Exit non-zero if the final validation AUC is below this.")

CATEGORIES = 100
DEVICES = 6
DENSE = 8
LATENT = 8


def click_logs(rows, items, examples, val_examples, seed=0):
    """Synthetic click logs: ((train_x, train_y), (val_x, val_y), val_true_probability).

    x is a dict of int32 ids ("user", "item", "category", "device") and float32 "dense"
    [n, DENSE]; y the clicks, float32 0/1. Users and items are drawn with Zipf-like
    frequencies (p(k) ~ 1 / (k + 10)^1.1); an item's category is fixed; a click is drawn with
    probability sigmoid(2 <u, v> + category bias + device bias + w . dense
    + 0.5 dense_0 dense_1 - 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def zipf(n, size):
        p = 1.0 / (np.arange(n) + 10.0) ** 1.1
        return rng.choice(n, size=size, p=p / p.sum()).astype(np.int32)

    user_vec = rng.normal(0, 1 / np.sqrt(LATENT), (rows, LATENT)).astype(np.float32)
    item_vec = rng.normal(0, 1 / np.sqrt(LATENT), (items, LATENT)).astype(np.float32)
    item_category = rng.integers(0, CATEGORIES, items).astype(np.int32)
    category_bias = rng.normal(0, 0.5, CATEGORIES)
    device_bias = rng.normal(0, 0.3, DEVICES)
    dense_w = rng.normal(0, 0.4, DENSE)
    # Ids are shuffled so that frequent ones are spread over the table, not its first rows.
    user_perm, item_perm = rng.permutation(rows), rng.permutation(items)

    def draw(n):
        user = user_perm[zipf(rows, n)].astype(np.int32)
        item = item_perm[zipf(items, n)].astype(np.int32)
        device = rng.integers(0, DEVICES, n).astype(np.int32)
        dense = rng.normal(0, 1, (n, DENSE)).astype(np.float32)
        logit = (2.0 * np.sum(user_vec[user] * item_vec[item], axis=1)
                 + category_bias[item_category[item]] + device_bias[device]
                 + dense @ dense_w + 0.5 * dense[:, 0] * dense[:, 1] - 1.0)
        probability = 1 / (1 + np.exp(-logit))
        y = (rng.random(n) < probability).astype(np.float32)
        x = {"user": user, "item": item, "category": item_category[item], "device": device,
             "dense": dense}
        return x, y, probability

    train_x, train_y, _ = draw(examples)
    val_x, val_y, val_probability = draw(val_examples)
    return (train_x, train_y), (val_x, val_y), val_probability


def build_model(keras, rows, items, dim):
    """DLRM: embeddings + bottom MLP, pairwise dot-product interaction, top MLP."""
    from keras import layers, ops

    class DotInteraction(layers.Layer):
        """The dot products of every pair of feature vectors: [batch, F, dim] ->
        [batch, F (F - 1) / 2] (the strict upper triangle of X Xᵀ)."""

        def call(self, features):
            count = features.shape[1]
            gram = ops.matmul(features, ops.transpose(features, (0, 2, 1)))
            flat = ops.reshape(gram, (-1, count * count))
            upper = [i * count + j for i in range(count) for j in range(i + 1, count)]
            return ops.take(flat, upper, axis=1)

    tables = {"user": rows, "item": items, "category": CATEGORIES, "device": DEVICES}
    inputs = {name: keras.Input((), dtype="int32", name=name) for name in tables}
    inputs["dense"] = keras.Input((DENSE,), name="dense")
    bottom = layers.Dense(64, activation="relu", name="bottom_1")(inputs["dense"])
    bottom = layers.Dense(dim, activation="relu", name="bottom_2")(bottom)
    vectors = [bottom] + [layers.Embedding(size, dim, name=f"{name}_embedding")(inputs[name])
                          for name, size in tables.items()]
    stacked = layers.Lambda(lambda v: ops.stack(v, axis=1), name="stack")(vectors)
    interactions = DotInteraction(name="interaction")(stacked)
    top = layers.Concatenate()([bottom, interactions])
    top = layers.Dense(64, activation="relu", name="top_1")(top)
    top = layers.Dense(32, activation="relu", name="top_2")(top)
    click = layers.Dense(1, activation="sigmoid", name="click")(top)
    return keras.Model(inputs, click, name="dlrm")


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
    from sklearn.metrics import roc_auc_score

    strategy = tfdp.DataParallelStrategy()
    replicas = strategy.num_replicas_in_sync
    global_batch = FLAGS.per_replica_batch * replicas
    base_lr = FLAGS.lr or (1e-3 if FLAGS.optimizer == "adam" else 0.15)
    lr = tfdp.scale_learning_rate(base_lr, 1024, global_batch, rule="sqrt")
    print(f"tfdp: {strategy.cluster.num_workers} worker(s), {replicas} replica(s), "
          f"communication={strategy.communication}, global batch {global_batch}, "
          f"{FLAGS.optimizer} lr {lr:.4g}", flush=True)

    started = time.perf_counter()
    (train_x, train_y), (val_x, val_y), val_probability = click_logs(
        FLAGS.rows, FLAGS.items, FLAGS.examples, FLAGS.val_examples)
    print(f"click logs: {FLAGS.examples:,} training + {FLAGS.val_examples:,} validation, "
          f"click rate {train_y.mean():.3f}, {len(set(train_x['user'].tolist())):,} of "
          f"{FLAGS.rows:,} users seen ({time.perf_counter() - started:.1f} s)", flush=True)

    # TensorFlow 2.21: ending an input iterator of several local replicas (Keras does at the
    # end of every epoch) can block for up to a minute per replica on a busy host (tf.data's
    # autotuning thread can miss its cancellation and sleeps out its period); tf.data's debug
    # mode runs the input without that thread. Enabled before the pipelines are built.
    tf.data.experimental.enable_debug_mode()
    train = tfdp.data.distribute(
        strategy, tf.data.Dataset.from_tensor_slices((train_x, train_y)),
        global_batch_size=global_batch, shuffle_buffer=FLAGS.examples, seed=0,
        drop_remainder=True)
    val = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((val_x, val_y)),
                               global_batch_size=global_batch)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras, FLAGS.rows, FLAGS.items, FLAGS.dim)
        optimizer = (keras.optimizers.Adam(lr) if FLAGS.optimizer == "adam"
                     else keras.optimizers.Adagrad(lr))
        if FLAGS.sharded:
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc")])
    print(f"model: DLRM, {model.count_params():,} parameters "
          f"({FLAGS.rows * FLAGS.dim:,} in the user table)", flush=True)

    class Progress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            print(f"epoch {epoch + 1}/{FLAGS.epochs}: loss {logs['loss']:.4f} auc "
                  f"{logs['auc']:.4f} val_loss {logs['val_loss']:.4f} val_auc "
                  f"{logs['val_auc']:.4f} ({time.perf_counter() - self.started:.1f} s)",
                  flush=True)

    # shuffle=False: tfdp.data shuffles (shuffle_buffer); Keras cannot shuffle a dataset.
    history = model.fit(train, validation_data=val, epochs=FLAGS.epochs, verbose=0,
                        shuffle=False, callbacks=[tfdp.callbacks.DatasetEpoch(train),
                                                  Progress()])
    auc = history.history["val_auc"][-1]
    print(f"validation AUC: {auc:.4f} (the hidden model that drew the clicks: "
          f"{roc_auc_score(val_y, val_probability):.4f}; a constant guess: 0.5)", flush=True)
    if auc < FLAGS.min_auc:
        print(f"FAILED: validation AUC {auc:.4f} < {FLAGS.min_auc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
