"""What an epoch of ``model.fit`` costs beyond its steps: no strategy, MirroredStrategy and tfdp
on the same logical CPU replicas, measured in one run, each configuration in its own process.

A short epoch (the default: 10 steps of a small MLP, with a validation set of 2 batches) is
mostly per-epoch work: under a tf.distribute strategy Keras makes a distributed iterator for
every epoch and every validation (a MultiDeviceIterator whose per-device functions TensorFlow
traces anew each time), plus one after each epoch that the next one replaces and one per
validation to read a batch for building the model. tfdp makes only the ones that are used
(feature ``"epoch_iterators"``, docs/strategy.md; ``tfdp_keras_iterators`` is tfdp with those patches
undone, as before) and traces each device's generator functions once, not per iterator
(``_tf_private.patch_per_device_generators_traced_once``; ``tfdp_tf_generators`` is tfdp with
TensorFlow's own generators put back). Reported: wall and CPU milliseconds per epoch
(median over ``--epochs`` after a warm-up fit), the distributed iterators made per epoch, and
the ratios to tfdp.

    python tools/bench_epoch_overhead.py            # ~1 min; docs/benchmarks/bench_epoch_overhead.{md,csv,png}
    python tools/bench_epoch_overhead.py --replicas 2,4,8 --steps 10,100
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from absl import app, flags, logging as absl_logging

import harness
from harness import ROOT

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["none", "mirrored", "tfdp_keras_iterators", "tfdp_tf_generators",
                              "tfdp"],
                  "none, mirrored, tfdp_keras_iterators (tfdp with Keras's own iterator making, "
                  "as before the epoch_iterators feature), tfdp_tf_generators (tfdp with "
                  "TensorFlow's per-device generators, traced per iterator) and/or tfdp.")
flags.DEFINE_list("replicas", ["2", "4"], "Logical CPU replica counts (none: one device).")
flags.DEFINE_list("steps", ["10"], "Training steps per epoch.")
flags.DEFINE_integer("epochs", 8, "Measured epochs per process (after a warm-up fit).")
harness.define_flags(rounds=2, out=("docs/benchmarks/bench_epoch_overhead",
                                    "Output prefix for .md/.csv/.png ('' to skip)."),
                     child="'config,replicas,steps' measured in this process.")

GLOBAL_BATCH = 64


def child():
    """Measures one configuration; prints one JSON line."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    import numpy as np
    import tensorflow as tf
    import keras
    from tensorflow.python.distribute import input_lib

    import tfdp

    config, replicas, steps = FLAGS.child.split(",")
    replicas, steps = int(replicas), int(steps)
    tfdp.configure_cpu_replicas(replicas)
    devices = [f"/device:CPU:{i}" for i in range(replicas)]
    strategy = {"none": lambda: None, "mirrored": lambda: tf.distribute.MirroredStrategy(devices),
                "tfdp": lambda: tfdp.DataParallelStrategy(devices),
                "tfdp_keras_iterators": lambda: tfdp.DataParallelStrategy(devices),
                "tfdp_tf_generators": lambda: tfdp.DataParallelStrategy(devices)}[config]()
    if config == "tfdp_keras_iterators":  # the feature's patches undone: Keras's own methods
        from tfdp.strategy import keras_integration

        for owner, name in keras_integration.installed_features()["epoch_iterators"]:
            setattr(owner, name, getattr(owner, name).__wrapped__)  # tfdp's patches keep it
    if config == "tfdp_tf_generators":  # TensorFlow's own per-device generator functions
        from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

        mdi._PerDeviceGenerator.__init__ = mdi._PerDeviceGenerator.__init__.__wrapped__
    made = []  # distributed iterators made (none without a strategy)
    iterate = input_lib.DistributedDataset.__iter__
    input_lib.DistributedDataset.__iter__ = lambda self: made.append(1) or iterate(self)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 32)).astype("float32")
    y = rng.integers(0, 4, size=len(x)).astype("int32")
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    val = train.take(2)
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, validation_data=val, epochs=1, verbose=0)  # traces the steps
    times = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = (time.perf_counter(), time.process_time())

        def on_epoch_end(self, epoch, logs=None):  # after the epoch's validation
            times.append((time.perf_counter() - self.began[0],
                          time.process_time() - self.began[1]))

    made.clear()
    model.fit(train, validation_data=val, epochs=FLAGS.epochs, verbose=0, callbacks=[EpochTimer()])
    print(json.dumps({
        "config": config, "replicas": replicas if strategy else 1, "steps": steps,
        "ms_per_epoch": 1000 * statistics.median(t for t, _ in times),
        "cpu_ms_per_epoch": 1000 * statistics.median(c for _, c in times),
        "iterators_per_epoch": len(made) / FLAGS.epochs}), flush=True)


def measure(config, replicas, steps):
    proc = harness.run(harness.command(__file__, f"--child={config},{replicas},{steps}",
                                       f"--epochs={FLAGS.epochs}"), cwd=ROOT, timeout=600)
    found = harness.results(proc.stdout, prefix="")
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{config} x{replicas}: {(proc.stdout + proc.stderr)[-2000:]}")
    return found[-1]


def main(argv):
    del argv
    if FLAGS.child:
        return child()
    grid = [(c, int(r), int(s)) for s in FLAGS.steps for r in FLAGS.replicas
            for c in FLAGS.configs if c != "none"]
    if "none" in FLAGS.configs:  # one device: once per epoch length
        grid = [("none", 1, int(s)) for s in FLAGS.steps] + grid
    runs = harness.by_key(harness.interleaved(grid, FLAGS.rounds, measure, lambda key, result: (
        f"{key[0]} x{key[1]}, {key[2]} steps: {result['ms_per_epoch']:.0f} ms/epoch, "
        f"{result['cpu_ms_per_epoch']:.0f} ms CPU, {result['iterators_per_epoch']:.0f} iterators")))
    rows = []
    for (config, replicas, steps), results in runs.items():
        rows.append({"config": config, "replicas": replicas, "steps": steps,
                     "ms_per_epoch": round(statistics.median(r["ms_per_epoch"] for r in results), 1),
                     "cpu_ms_per_epoch": round(statistics.median(
                         r["cpu_ms_per_epoch"] for r in results), 1),
                     "iterators_per_epoch": results[-1]["iterators_per_epoch"]})
    tfdp_ms = {(r["replicas"], r["steps"]): r["ms_per_epoch"] for r in rows if r["config"] == "tfdp"}
    command = " ".join(["python tools/bench_epoch_overhead.py", *sys.argv[1:]])
    lines = [f"Command: `{command}`",
             "", f"An epoch of an MLP (32-64-4) at a global batch of {GLOBAL_BATCH} with a 2-batch "
             f"validation, median over {FLAGS.epochs} epochs and {FLAGS.rounds} rounds; one "
             "process per configuration.", "",
             "| strategy | replicas | steps | ms/epoch | CPU ms/epoch | distributed iterators/epoch | / tfdp |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = tfdp_ms.get((r["replicas"], r["steps"]))
        ratio = f"{r['ms_per_epoch'] / base:.2f}" if base and r["config"] != "none" else ""
        lines.append(f"| {r['config']} | {r['replicas']} | {r['steps']} | {r['ms_per_epoch']:.0f} | "
                     f"{r['cpu_ms_per_epoch']:.0f} | {r['iterators_per_epoch']:.0f} | {ratio} |")
    text = "\n".join(lines)
    print(text)
    if FLAGS.out:
        harness.write_report(FLAGS.out, text, rows, lambda ax: plot(ax, rows), figsize=(8, 3.8))
        print(f"wrote {FLAGS.out}.md, .csv, .png")


def plot(ax, rows):
    labels = [f"{r['config'].replace('_', ' ')}\nx{r['replicas']}" for r in rows]
    ax.bar(range(len(rows)), [r["ms_per_epoch"] for r in rows],
           color=[{"none": "#999999", "mirrored": "#d62728", "tfdp_keras_iterators": "#9ecae1",
                   "tfdp_tf_generators": "#6baed6", "tfdp": "#1f77b4"}[r["config"]]
                  for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    harness.label_axes(ax, None, "ms per epoch (with validation)",
                       "What an epoch costs beyond its steps")


if __name__ == "__main__":
    app.run(main)
