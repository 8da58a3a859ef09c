"""What each epoch's distributed iterator costs: tfdp against MirroredStrategy, in one run.

Keras's ``fit`` makes a new distributed iterator at the start of every epoch (and every
``evaluate``); over several replicas it is a multi-device iterator with one generator dataset
per device. TensorFlow traces that generator's functions anew for every iterator; tfdp traces
them once per device and element structure (tfdp/_tf_private/data.py,
``patch_per_device_generators_traced_once``). For each replica count this reports the CPU time
of making an epoch's iterator and reading its first batch (median of ``--iterators``), and the
wall time of a ``fit`` epoch of ``--steps`` steps of a small MLP (median of ``--epochs`` epochs
after the first), each configuration's ratio to tfdp: MirroredStrategy (measured before any
tfdp strategy exists), tfdp, and tfdp with TensorFlow's own per-device generators put back
(the change alone). Each replica count runs in a process of its
own (MirroredStrategy instances of different sizes in one process reuse a collective group
key and abort), tfdp and MirroredStrategy side by side in it.

    python tools/bench_epoch_iterators.py                 # ~2 min on 2 cores
    python tools/bench_epoch_iterators.py --out docs/benchmarks/epoch_iterators
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags, logging as absl_logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["1", "2", "4", "8"], "Replica counts (logical CPU devices "
                  "where there is no GPU; at most the GPUs there are otherwise).")
flags.DEFINE_integer("iterators", 15, "Iterators made per configuration.")
flags.DEFINE_integer("epochs", 6, "fit epochs per configuration (the first is not counted).")
flags.DEFINE_integer("steps", 10, "Steps per fit epoch.")
flags.DEFINE_integer("global_batch", 64, "Global batch size.")
flags.DEFINE_string("out", "", "Output prefix for .json/.md ('' to print only).")
flags.DEFINE_bool("rows_only", False, "Internal: measure one replica count, print its rows "
                  "as JSON.")
ROWS = "rows: "


def _dataset(tf, np):
    x = np.random.default_rng(0).normal(size=(FLAGS.steps * FLAGS.global_batch, 32))
    y = (x[:, 0] > 0).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x.astype("float32"), y)).batch(
        FLAGS.global_batch)


def _iterator_seconds(tf, np, strategy):
    dist = strategy.experimental_distribute_dataset(_dataset(tf, np))
    times = []
    for _ in range(FLAGS.iterators):
        start = time.process_time()
        next(iter(dist))
        times.append(time.process_time() - start)
    return statistics.median(times)


def _epoch_seconds(tf, np, strategy):
    import keras

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.began)

    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = EpochTimes()
    model.fit(_dataset(tf, np), epochs=FLAGS.epochs, verbose=0, callbacks=[times])
    return statistics.median(times.times[1:])


def _measure_one_count(n):
    """Rows of tfdp and MirroredStrategy on ``n`` replicas (this process)."""
    import numpy as np
    import tensorflow as tf
    import tfdp

    gpus = tf.config.list_physical_devices("GPU")
    if n > (len(gpus) if gpus else n):
        return []
    if not gpus:
        tfdp.configure_cpu_replicas(n)
    devices = [f"/{'gpu' if gpus else 'cpu'}:{i}" for i in range(n)]
    # MirroredStrategy first: building a tfdp strategy installs tfdp's per-device generators
    # process-wide. "tfdp_tf_generators" is tfdp with TensorFlow's own put back.
    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

    strategies = {"mirrored": lambda: tf.distribute.MirroredStrategy(devices),
                  "tfdp": lambda: tfdp.DataParallelStrategy(devices=devices)}
    rows = []
    for name in ("mirrored", "tfdp", "tfdp_tf_generators"):
        strategy = strategies.get(name, strategies["tfdp"])()
        patched = vars(mdi._PerDeviceGenerator)["__init__"]
        if name == "tfdp_tf_generators":
            mdi._PerDeviceGenerator.__init__ = patched.__wrapped__
        try:
            iterator = _iterator_seconds(tf, np, strategy)
            epoch = _epoch_seconds(tf, np, strategy)
        finally:
            mdi._PerDeviceGenerator.__init__ = patched
        rows.append({"replicas": n, "config": name, "iterator_cpu_s": iterator,
                     "epoch_s": epoch, "kind": "GPU" if gpus else "CPU"})
        absl_logging.info("%d replicas %-8s iterator + first batch %.3f s CPU, "
                          "%d-step epoch %.3f s", n, name, iterator, FLAGS.steps, epoch)
    return rows


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.INFO)
    if FLAGS.rows_only:
        print(ROWS + json.dumps(_measure_one_count(int(FLAGS.replicas[0]))))
        return
    rows = []
    for n in FLAGS.replicas:
        argv = [sys.executable, os.path.abspath(__file__), f"--replicas={n}", "--rows_only",
                f"--iterators={FLAGS.iterators}", f"--epochs={FLAGS.epochs}",
                f"--steps={FLAGS.steps}", f"--global_batch={FLAGS.global_batch}"]
        out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
        rows += json.loads(next(l for l in out.splitlines() if l.startswith(ROWS))[len(ROWS):])
        print(f"{n} replicas measured", flush=True)
    import tensorflow as tf

    kind = rows[0]["kind"] if rows else "CPU"
    base = {r["replicas"]: r for r in rows if r["config"] == "tfdp"}
    for r in rows:
        r["iterator_ratio_to_tfdp"] = r["iterator_cpu_s"] / base[r["replicas"]]["iterator_cpu_s"]
        r["epoch_ratio_to_tfdp"] = r["epoch_s"] / base[r["replicas"]]["epoch_s"]
    header = (f"{kind} devices ({os.cpu_count()} cores), global batch "
              f"{FLAGS.global_batch}, {FLAGS.steps} steps per epoch, TensorFlow {tf.__version__}")
    lines = [header, "", "| replicas | strategy | iterator + first batch (CPU s) | ratio to tfdp "
             "| fit epoch (s) | ratio to tfdp |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['replicas']} | {r['config']} | {r['iterator_cpu_s']:.3f} | "
              f"{r['iterator_ratio_to_tfdp']:.2f} | {r['epoch_s']:.3f} | "
              f"{r['epoch_ratio_to_tfdp']:.2f} |" for r in rows]
    print("\n".join(lines))
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(FLAGS.out + ".json", "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
