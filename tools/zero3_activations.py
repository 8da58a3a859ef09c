"""ZeRO-3 under XLA: keeping each unit's activations against recomputing them (activation
checkpointing per unit, ``DataParallelStrategy(checkpoint_activations=True)``).

A KerasHub GPT-2 causal LM (``--layers`` blocks of ``--hidden``, sequence ``--seq``, vocabulary
``--vocab``), AdamW, ``shard_parameters=True`` with ``jit_compile=True`` on ``--replicas``
logical CPU replicas, global batch ``--batch``. Each configuration runs in a fresh process,
the two interleaved over ``--rounds``: the first step (tracing and compiling), the median step
after ``--warmup``, TensorFlow's allocator peak (the tensors of every replica of the process)
and the growth of the process's peak resident memory (VmHWM) from before the model is built.

    python tools/zero3_activations.py --rounds=2   # ~6 min; docs/benchmarks/zero3_activations.{md,csv,png}

Configurations: ``kept`` (the default: each compiled unit's backward program runs on the
activations its forward program kept) and ``checkpointed`` (``checkpoint_activations=True``:
each unit keeps only its inputs and recomputes its forward pass in its backward pass).
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

import harness

CONFIGS = ("kept", "checkpointed")

FLAGS = flags.FLAGS


def define_flags():
    """The tool's flags (defined when it runs, so that importing it defines none)."""
    flags.DEFINE_list("configs", list(CONFIGS), "Configurations.")
    flags.DEFINE_integer("replicas", 4, "Logical CPU replicas in the process.")
    flags.DEFINE_integer("layers", 4, "Transformer blocks.")
    flags.DEFINE_integer("hidden", 256, "Hidden width (4 heads; feed-forward 4x).")
    flags.DEFINE_integer("seq", 128, "Sequence length.")
    flags.DEFINE_integer("vocab", 2000, "Vocabulary.")
    flags.DEFINE_integer("batch", 32, "Global batch.")
    harness.define_flags(
        rounds=(2, "Interleaved rounds."), warmup=(4, "Untimed steps (tracing)."),
        steps=(10, "Timed steps."),
        out=("docs/benchmarks/zero3_activations", "Output prefix ('' to skip)."),
        child="the configuration to run here.")


def _child():
    import numpy as np

    import tfdp

    tfdp.configure_cpu_replicas(FLAGS.replicas)
    import keras
    import keras_hub
    import tensorflow as tf

    strategy = tfdp.DataParallelStrategy(shard_parameters=True, shard_min_elements=4096,
                                         checkpoint_activations=FLAGS.child == "checkpointed")
    rng = np.random.default_rng(0)
    rows = FLAGS.batch * 4
    tokens = rng.integers(1, FLAGS.vocab, size=(rows, FLAGS.seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, FLAGS.seq), bool)}
    data = tf.data.Dataset.from_tensor_slices((x, tokens[:, 1:])).batch(FLAGS.batch).repeat()
    before = harness.vm_hwm_bytes()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=FLAGS.vocab, num_layers=FLAGS.layers, num_heads=4,
            hidden_dim=FLAGS.hidden, intermediate_dim=4 * FLAGS.hidden,
            max_sequence_length=FLAGS.seq, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.AdamW(1e-4), jit_compile=True)
    times = []
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.warmup + FLAGS.steps, verbose=0,
              callbacks=[harness.timer(keras, times)])
    print("RESULT " + json.dumps(dict(
        config=FLAGS.child, params=model.count_params(), first_s=times[0],
        step_ms=1000 * statistics.median(times[FLAGS.warmup:]),
        allocator_peak=tf.config.experimental.get_memory_info("CPU:0")["peak"],
        growth=harness.vm_hwm_bytes() - before)), flush=True)


def run_one(config) -> dict:
    args = [f"--child={config}", *harness.forward(
        FLAGS, "replicas", "layers", "hidden", "seq", "vocab", "batch", "warmup", "steps")]
    proc = harness.run(harness.command(__file__, *args), env=harness.child_env(), timeout=900)
    found = harness.results(proc.stdout)
    if not found:
        raise RuntimeError(f"{config} failed (exit {proc.returncode}):\n"
                           f"{harness.tail(proc.stderr, 30)}")
    return found[-1]


def summary(rows) -> dict:
    """config -> the median over rounds of each measure. Pure."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        out[config] = {k: statistics.median(r[k] for r in mine)
                       for k in ("first_s", "step_ms", "allocator_peak", "growth")}
    return out


def main(argv):
    del argv
    if FLAGS.child:
        return _child()
    runs = harness.interleaved(
        FLAGS.configs, FLAGS.rounds, run_one,
        lambda config, r: (f"{config:12s} first step {r['first_s']:.1f} s, step "
                           f"{r['step_ms']:.0f} ms, allocator peak "
                           f"{r['allocator_peak'] / 1e6:.0f} MB, VmHWM growth "
                           f"{r['growth'] / 1e6:.0f} MB"), rotate=True)
    rows = [dict(result, round=index) for index, _, result in runs]
    if FLAGS.out:
        _write(FLAGS.out, rows)


def _write(out, rows):
    med = summary(rows)
    params = rows[0]["params"]
    text = [f"# ZeRO-3 under XLA: kept activations against checkpointing "
            f"({time.strftime('%Y-%m-%d')})\n\n"
            f"`python tools/zero3_activations.py --rounds={FLAGS.rounds}`: KerasHub GPT-2 "
            f"causal LM, {FLAGS.layers} blocks of {FLAGS.hidden} ({params / 1e6:.1f}M "
            f"parameters), sequence {FLAGS.seq}, vocabulary {FLAGS.vocab}, AdamW, "
            f"`shard_parameters=True`, `jit_compile=True`, {FLAGS.replicas} logical CPU "
            f"replicas, global batch {FLAGS.batch}; each run a fresh process on this host, "
            f"median over {FLAGS.rounds} interleaved rounds (the step: median of "
            f"{FLAGS.steps} after {FLAGS.warmup}).\n\n"
            "| configuration | first step (s) | step (ms) | allocator peak (MB) | "
            "VmHWM growth (MB) |\n|---|---:|---:|---:|---:|\n"]
    for config, m in med.items():
        text.append(f"| {config} | {m['first_s']:.1f} | {m['step_ms']:.0f} | "
                    f"{m['allocator_peak'] / 1e6:.0f} | {m['growth'] / 1e6:.0f} |\n")
    if {"kept", "checkpointed"} <= set(med):
        k, c = med["kept"], med["checkpointed"]
        text.append(f"\nKept / checkpointed: step {k['step_ms'] / c['step_ms']:.2f}x, "
                    f"allocator peak {k['allocator_peak'] / c['allocator_peak']:.2f}x.\n")

    def plot(ax):
        configs = list(med)
        ax.bar(configs, [med[c]["allocator_peak"] / 1e6 for c in configs])
        harness.label_axes(ax, ylabel="allocator peak (MB)",
                           title="ZeRO-3 + XLA, GPT-2: activations kept or recomputed")

    harness.write_report(out, "".join(text), rows, plot)
    print(f"wrote {out}.md, .csv, .png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
