"""A small GPT-2-style causal language model from KerasHub, trained data-parallel with tfdp on
the Python standard library's own source files (no download).

The model is KerasHub's ``GPT2CausalLM`` built from config (tiny dimensions, random init, no
preset); the text is tokenised by KerasHub's byte-level ``ByteTokenizer`` (256 ids, no
vocabulary file). Training is ``model.fit`` with AdamW + ``global_clipnorm`` under
``tfdp.DataParallelStrategy()``; the script prints the loss as it goes, the loss on held-out
files, and a sample the model writes after a prompt.

    python examples/kerashub_causal_lm.py --replicas 4 --steps 600
    python examples/kerashub_causal_lm.py --sharded               # tfdp.ShardedOptimizer (ZeRO-1)
    python examples/kerashub_causal_lm.py --shard_parameters      # ZeRO-3
    tfdp-run --workers 2 --cpu-replicas 2 -- python examples/kerashub_causal_lm.py

Needs keras-hub (``pip install --no-deps keras-hub==0.32.0``, docs/models.md).
"""

from __future__ import annotations

import glob
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
flags.DEFINE_integer("per_replica_batch", 8, "Sequences per replica per step.")
flags.DEFINE_integer("seq_len", 64, "Tokens (bytes) per training sequence.")
flags.DEFINE_integer("steps", 600, "Training steps.")
flags.DEFINE_integer("log_every", 100, "Print the loss every this many steps.")
flags.DEFINE_integer("files", 60, "Standard-library source files to read (the largest "
                     "first, skipping tests); the last tenth are held out.")
flags.DEFINE_integer("eval_batches", 16, "Global batches of held-out text the loss is "
                     "measured on, before and after training.")
flags.DEFINE_integer("layers", 2, "Transformer layers.")
flags.DEFINE_integer("hidden", 64, "Hidden size.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_float("dropout", 0.0, "Dropout rate of the backbone.")
flags.DEFINE_float("lr", 5e-3, "Peak AdamW learning rate (warmup, then cosine decay).")
flags.DEFINE_float("clipnorm", 1.0, "AdamW global_clipnorm.")
flags.DEFINE_boolean("sharded", False, "Wrap AdamW in tfdp.ShardedOptimizer (ZeRO-1).")
flags.DEFINE_boolean("shard_parameters", False, "DataParallelStrategy(shard_parameters=True) "
                     "(ZeRO-3: parameters, gradients and optimizer state 1/N per replica).")
flags.DEFINE_string("prompt", "def ", "Prompt of the sample printed at the end.")
flags.DEFINE_integer("top_k", 5, "Sample from the k likeliest bytes (1: greedy).")
flags.DEFINE_float("max_final_loss", 0.0, "Exit non-zero if the held-out loss ends above "
                   "this (0: no check).")


def read_corpus(count):
    """The text of ``count`` standard-library .py files, the largest first (test files left
    out), in a fixed order: (train_texts, held_out_texts)."""
    stdlib = os.path.dirname(os.__file__)
    paths = [p for p in glob.glob(os.path.join(stdlib, "*.py"))
             if not os.path.basename(p).startswith(("test", "_test"))]
    paths = sorted(paths, key=lambda p: (-os.path.getsize(p), p))[:count]
    texts = []
    for path in sorted(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    held = max(1, len(texts) // 10)
    return texts[:-held], texts[-held:]


def windows(tokenizer, texts, seq_len):
    """Every file tokenised into bytes, joined with a blank line, cut into rows of
    ``seq_len + 1`` tokens (int32 numpy [rows, seq_len + 1])."""
    import numpy as np

    ids = np.concatenate([np.asarray(tokenizer(text + "\n\n"), np.int32) for text in texts])
    rows = len(ids) // (seq_len + 1)
    return ids[:rows * (seq_len + 1)].reshape(rows, seq_len + 1)


def lm_dataset(tf, rows, global_batch, shuffle, seed=0):
    """Batches of the global batch: (x, y), x the model's own input dict (token ids and
    padding mask), y the next byte at each position."""
    ds = tf.data.Dataset.from_tensor_slices(rows)
    if shuffle:
        ds = ds.shuffle(len(rows), seed=seed, reshuffle_each_iteration=True).repeat()

    def split(batch):
        x = {"token_ids": batch[:, :-1], "padding_mask": tf.ones_like(batch[:, :-1], tf.bool)}
        return x, batch[:, 1:]

    return ds.batch(global_batch, drop_remainder=True).map(split)


def build_model(keras_hub, vocabulary_size):
    """KerasHub's GPT-2 causal LM built from config (random init, nothing downloaded); no
    preprocessor: it takes token ids and a padding mask."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, num_layers=FLAGS.layers, num_heads=FLAGS.heads,
        hidden_dim=FLAGS.hidden, intermediate_dim=4 * FLAGS.hidden,
        max_sequence_length=FLAGS.seq_len, dropout=FLAGS.dropout)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


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
    import keras_hub
    import numpy as np
    import tensorflow as tf

    strategy = tfdp.DataParallelStrategy(shard_parameters=FLAGS.shard_parameters)
    replicas = strategy.num_replicas_in_sync
    global_batch = FLAGS.per_replica_batch * replicas

    tokenizer = keras_hub.tokenizers.ByteTokenizer(lowercase=False)  # ids 0..255, no vocab file
    # Every worker reads the same files (the same Python on every host) in the same order.
    train_texts, held_texts = read_corpus(FLAGS.files)
    train_rows = windows(tokenizer, train_texts, FLAGS.seq_len)
    held_rows = windows(tokenizer, held_texts, FLAGS.seq_len)
    print(f"tfdp: {strategy.cluster.num_workers} worker(s), {replicas} replica(s), "
          f"communication={strategy.communication}, global batch {global_batch} x "
          f"{FLAGS.seq_len} bytes; corpus: {len(train_texts)} + {len(held_texts)} held-out "
          f"stdlib files, {train_rows.size:,} + {held_rows.size:,} bytes", flush=True)

    # TensorFlow 2.21: ending an input iterator of several local replicas can block for up to
    # a minute per replica on a busy host (tf.data's autotuning thread can miss its
    # cancellation and sleeps out its period); tf.data's debug mode runs the input without
    # that thread. Enabled before the pipelines are built; the input here is tiny.
    tf.data.experimental.enable_debug_mode()
    # KerasHub's task fit takes a tf.data.Dataset batched to the global batch, not the
    # distributed dataset tfdp.data.distribute returns (docs/models.md, "Input on several
    # workers"); tfdp splits each global batch across the replicas and workers.
    train = lm_dataset(tf, train_rows, global_batch, shuffle=True)
    held_out = lm_dataset(tf, held_rows, global_batch, shuffle=False).take(FLAGS.eval_batches)

    schedule = tfdp.schedules.WarmupCosineDecay(
        FLAGS.lr, warmup_steps=max(1, FLAGS.steps // 10), total_steps=FLAGS.steps, alpha=0.1)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras_hub, tokenizer.vocabulary_size())
        optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.01,
                                           global_clipnorm=FLAGS.clipnorm)
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
        if FLAGS.sharded:
            optimizer = tfdp.ShardedOptimizer(optimizer)
        # The task's own loss (sparse cross-entropy over the padding mask) and a top-k sampler.
        model.compile(optimizer=optimizer,
                      sampler=keras_hub.samplers.TopKSampler(k=FLAGS.top_k, seed=0))
    mode = ("ZeRO-3" if FLAGS.shard_parameters else
            "ShardedOptimizer" if FLAGS.sharded else "replicated")
    print(f"model: GPT-2, {FLAGS.layers} layers, hidden {FLAGS.hidden}, "
          f"{model.count_params():,} parameters, AdamW {mode}", flush=True)

    initial = model.evaluate(held_out, verbose=0, return_dict=True)["loss"]
    print(f"held-out loss before training: {initial:.4f} (uniform over 256 bytes: "
          f"{np.log(256):.4f})", flush=True)
    started = time.perf_counter()

    class Progress(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # one "epoch" = log_every steps
            print(f"step {(epoch + 1) * FLAGS.log_every}/{rounds * FLAGS.log_every}: loss "
                  f"{logs['loss']:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)

    rounds = max(1, FLAGS.steps // FLAGS.log_every)
    model.fit(train, steps_per_epoch=FLAGS.log_every, epochs=rounds, verbose=0,
              shuffle=False, callbacks=[Progress()])
    seconds = time.perf_counter() - started
    tokens = rounds * FLAGS.log_every * global_batch * FLAGS.seq_len
    final = model.evaluate(held_out, verbose=0, return_dict=True)["loss"]
    print(f"trained {rounds * FLAGS.log_every} steps in {seconds:.1f} s "
          f"({tokens / seconds:,.0f} tokens/s, first step's tracing included)")
    print(f"held-out loss: {final:.4f} (before training {initial:.4f})", flush=True)

    # KerasHub's generate runs its own tf.function outside strategy.run: a ZeRO-3 model's
    # parameters, sliced across the workers, cannot be read whole there on several workers.
    # Sample from an ordinary copy then (get_weights gathers them, on every worker together).
    generator = model
    if FLAGS.shard_parameters and strategy.cluster.num_workers > 1:
        generator = build_model(keras_hub, tokenizer.vocabulary_size())  # outside the scope
        generator.set_weights(model.get_weights())
        generator.compile(sampler=keras_hub.samplers.TopKSampler(k=FLAGS.top_k, seed=0))
    # Every worker generates, the chief prints.
    prompt_ids = np.asarray(tokenizer(FLAGS.prompt), np.int32)[:FLAGS.seq_len - 1]
    token_ids = np.zeros((1, FLAGS.seq_len), np.int32)
    token_ids[0, :len(prompt_ids)] = prompt_ids
    padding_mask = np.arange(FLAGS.seq_len)[None, :] < len(prompt_ids)
    out = generator.generate({"token_ids": token_ids, "padding_mask": padding_mask},
                             stop_token_ids=None)
    sample = tokenizer.detokenize(np.asarray(out["token_ids"])[0].tolist())
    if strategy.cluster.is_chief:
        how = "greedy" if FLAGS.top_k == 1 else f"top-{FLAGS.top_k}"
        print(f"sample ({how}, {FLAGS.seq_len} bytes):\n{sample}\n---", flush=True)
    if FLAGS.max_final_loss and not final <= FLAGS.max_final_loss:
        print(f"FAILED: held-out loss {final:.4f} > {FLAGS.max_final_loss}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
