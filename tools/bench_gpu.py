"""GPU training throughput: ResNet-50 (images/s) and a transformer encoder (tokens/s) under
no strategy, tf.distribute.MirroredStrategy and tfdp.DataParallelStrategy, each with its
defaults (no jit_compile argument: Keras's "auto"), in float32 and mixed_bfloat16.

Each configuration runs in its own process (the mixed-precision policy and GPU memory are
per process); configurations are interleaved over rounds. Synthetic data built on the host
once and repeated (``tf.data``, prefetched). Step time = wall time of an epoch of ``--steps``
steps after a warm-up epoch (which includes XLA compilation), median over ``--epochs``.

    python tools/bench_gpu.py                       # on a GPU host; writes docs/benchmarks/bench_gpu.{md,csv}
    python tools/bench_gpu.py --tiny --out /tmp/b   # a CPU smoke run with tiny sizes
    python tools/bench_gpu.py --models resnet50 --precisions bf16 --batch 256

On a host with several GPUs, MirroredStrategy and tfdp use all of them (global batch =
per-replica batch x GPUs) and "no strategy" uses one: compare per-replica rates then.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from absl import app, flags, logging as absl_logging

import harness
from harness import ROOT

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["resnet50", "transformer"], "resnet50 and/or transformer.")
flags.DEFINE_list("configs", ["none", "mirrored", "tfdp"], "Strategies: none, mirrored, tfdp.")
flags.DEFINE_list("precisions", ["fp32", "bf16"], "fp32 (TF32 matmuls on GPUs) and/or bf16.")
flags.DEFINE_string("jit_compile", "default",
                    "default (no argument: Keras's 'auto'), true or false.")
harness.define_flags(
    batch=(0, "Per-replica batch (0: 128 for resnet50, 64 for transformer)."),
    steps=(50, "Steps per measured epoch."),
    epochs=(3, "Measured epochs per process (after one warm-up epoch)."),
    rounds=1, out=("docs/benchmarks/bench_gpu", "Output prefix for .md/.csv ('' to skip)."),
    child="'model,config,precision' measured in this process.")
flags.DEFINE_integer("image_size", 224, "ResNet-50 input size.")
flags.DEFINE_integer("seq_len", 512, "Transformer sequence length.")
flags.DEFINE_integer("layers", 6, "Transformer encoder layers.")
flags.DEFINE_integer("width", 768, "Transformer model width (heads of 64).")
flags.DEFINE_boolean("tiny", False, "Tiny sizes for a CPU smoke run.")

TINY = {"image_size": 32, "seq_len": 16, "layers": 1, "width": 32, "batch": 2, "steps": 2,
        "epochs": 1}


def setting(name):
    return TINY[name] if FLAGS.tiny and name in TINY else getattr(FLAGS, name)


def per_replica_batch(model_name):
    return setting("batch") or {"resnet50": 128, "transformer": 64}[model_name]


def build(model_name, keras):
    """(model, one synthetic (x, y) batch of size 1, units of work per example)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if model_name == "resnet50":
        size = setting("image_size")
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                            classes=1000)
        x = rng.normal(size=(1, size, size, 3)).astype("float32")
        return model, (x, np.array([7], "int32")), 1
    seq, width = setting("seq_len"), setting("width")
    inputs = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(32000, width)(inputs)
    for _ in range(setting("layers")):
        a = keras.layers.MultiHeadAttention(max(1, width // 64), 64)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(f))
    outputs = keras.layers.Dense(2, dtype="float32")(keras.layers.GlobalAveragePooling1D()(h))
    x = rng.integers(0, 32000, size=(1, seq)).astype("int32")
    return keras.Model(inputs, outputs), (x, np.array([1], "int32")), seq


def child():
    """Measures one configuration; prints one JSON line."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    import numpy as np
    import tensorflow as tf
    import keras

    import tfdp

    model_name, config, precision = FLAGS.child.split(",")
    if precision == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    strategy = {"none": lambda: None, "mirrored": tf.distribute.MirroredStrategy,
                "tfdp": tfdp.DataParallelStrategy}[config]()
    replicas = strategy.num_replicas_in_sync if strategy else 1
    batch = per_replica_batch(model_name) * replicas
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model, (x1, y1), units = build(model_name, keras)
        kwargs = {} if FLAGS.jit_compile == "default" else {
            "jit_compile": FLAGS.jit_compile == "true"}
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **kwargs)
    x = np.repeat(x1, batch, axis=0)
    y = np.repeat(y1, batch, axis=0)
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(tf.data.AUTOTUNE)
    times = []
    steps = setting("steps")
    model.fit(data, epochs=1 + setting("epochs"), steps_per_epoch=steps, verbose=0,
              callbacks=[harness.timer(keras, times, per="epoch")])
    ms = 1000 * statistics.median(times[1:]) / steps
    gpus = tf.config.list_physical_devices("GPU")
    device = (tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
              if gpus else "CPU")
    print(json.dumps({"model": model_name, "config": config, "precision": precision,
                      "replicas": replicas, "batch": batch, "ms_per_step": ms,
                      "units": units, "per_second": batch * units * 1000 / ms,
                      "jit_compile": bool(
                          model.jit_compile), "device": device,
                      "tensorflow": tf.__version__, "keras": keras.__version__}), flush=True)


def measure(model_name, config, precision):
    proc = harness.run(harness.command(
        __file__, f"--child={model_name},{config},{precision}",
        *harness.forward(FLAGS, "jit_compile", "batch", "steps", "epochs", "image_size", "seq_len",
                         "layers", "width", "tiny")), cwd=ROOT)
    found = harness.results(proc.stdout, prefix="")
    if proc.returncode != 0 or not found:
        return {"model": model_name, "config": config, "precision": precision,
                "error": harness.tail(proc.stdout + proc.stderr, 3, " | ")}
    return found[-1]


def table(results):
    """Markdown: one row per strategy x precision, ms/step and throughput per model."""
    unit = {"resnet50": "images/s", "transformer": "tokens/s"}
    first = next((r for r in results if "device" in r), {})
    lines = [f"Device: {first.get('device', '?')}; TensorFlow {first.get('tensorflow', '?')}, "
             f"Keras {first.get('keras', '?')}; jit_compile: {FLAGS.jit_compile}.", "",
             "| model | strategy | precision | replicas | batch | jit | ms/step | throughput |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | {r['precision']} | | | | failed: "
                         f"{r['error'][:120]} | |")
            continue
        lines.append(f"| {r['model']} | {r['config']} | {r['precision']} | {r['replicas']} | "
                     f"{r['batch']} | {r['jit_compile']} | {r['ms_per_step']:.1f} | "
                     f"{r['per_second']:,.0f} {unit[r['model']]} |")
    return "\n".join(lines) + "\n"


def median_of(runs):
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = dict(ok[0])
    best["ms_per_step"] = statistics.median(r["ms_per_step"] for r in ok)
    best["per_second"] = best["batch"] * best["units"] * 1000 / best["ms_per_step"]
    return best


def main(argv):
    del argv
    if FLAGS.child:
        child()
        return
    keys = [(m, c, p) for m in FLAGS.models for p in FLAGS.precisions for c in FLAGS.configs]
    runs = harness.by_key(harness.interleaved(keys, FLAGS.rounds, measure, lambda key, result: (
        f"{','.join(key)}: " + (f"{result['ms_per_step']:.1f} ms/step" if "error" not in result
                               else f"failed: {result['error']}"))))
    results = [median_of(runs[k]) for k in keys]
    text = table(results)
    print(text)
    if FLAGS.out:
        out = os.path.join(ROOT, FLAGS.out) if not os.path.isabs(FLAGS.out) else FLAGS.out
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        command = "python tools/bench_gpu.py " + " ".join(sys.argv[1:])
        with open(out + ".md", "w") as f:
            f.write(f"Command: `{command}`\n\n" + text)
        with open(out + ".csv", "w") as f:
            columns = ["model", "config", "precision", "replicas", "batch", "jit_compile",
                       "ms_per_step", "per_second", "device", "error"]
            f.write(",".join(columns) + "\n")
            for r in results:
                f.write(",".join(str(r.get(c, "")).replace(",", ";") for c in columns) + "\n")
        print(f"wrote {out}.md and {out}.csv")


if __name__ == "__main__":
    app.run(main)
