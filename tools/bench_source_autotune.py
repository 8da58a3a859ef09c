"""Input throughput of a distributed dataset with tf.data's autotune model off (tfdp's default
since tfdp/strategy/source_pipeline.py) and on, against MirroredStrategy, in one run.

The pipeline is input-bound on purpose: a ``map`` with ``num_parallel_calls=AUTOTUNE`` doing
``--work`` rounds of image-like arithmetic per element (a stand-in for decoding and
augmentation), batched and prefetched; each configuration reads ``--batches`` global batches
from an iterator of the distributed dataset (after ``--warmup``), no training step. With the
autotune model off, the map runs at TensorFlow's default parallelism, min(16, cores); with it
on, the model searches the parallelism while the iterator runs. Also reported: the longest
destruction of an iterator (what the autotune thread can hold up; see the module docstring of
tfdp/strategy/source_pipeline.py). Configurations are interleaved over ``--rounds`` in one
process; medians and ratios to tfdp.

    python tools/bench_source_autotune.py                       # ~1 min on 2 cores
    python tools/bench_source_autotune.py --out docs/benchmarks/source_autotune
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags, logging as absl_logging

import harness

sys.path.insert(0, harness.ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["tfdp", "tfdp_autotune", "mirrored"],
                  "tfdp (its default: autotune model off), tfdp_autotune (the dataset's options "
                  "set autotune.enabled=True) and/or mirrored (tf.distribute.MirroredStrategy).")
flags.DEFINE_integer("replicas", 2, "Logical CPU replicas where there is no GPU.")
flags.DEFINE_integer("global_batch", 64, "Global batch size.")
flags.DEFINE_integer("work", 8, "Rounds of arithmetic per element in the map.")
flags.DEFINE_integer("batches", 200, "Global batches timed per measurement.")
harness.define_flags(warmup=(20, "Global batches read before timing."), rounds=3,
                     out=("", "Output prefix for .json/.md ('' to print only)."))


def _source(tf, autotune: bool | None):
    def augment(i):
        x = tf.random.stateless_uniform([64, 64, 3], seed=tf.stack([i, i + 1]))
        for _ in range(FLAGS.work):
            x = tf.tanh(x * 1.01 + 0.1) + tf.reverse(x, axis=[0]) * 0.5
        return x, i % 10

    ds = (tf.data.Dataset.range(10**9)
          .map(augment, num_parallel_calls=tf.data.AUTOTUNE)
          .batch(FLAGS.global_batch, drop_remainder=True)
          .prefetch(tf.data.AUTOTUNE))
    if autotune is not None:
        options = tf.data.Options()
        options.autotune.enabled = autotune
        ds = ds.with_options(options)
    return ds


def _measure(tf, strategy, autotune):
    iterator = iter(strategy.experimental_distribute_dataset(_source(tf, autotune)))
    for _ in range(FLAGS.warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(FLAGS.batches):
        next(iterator)
    seconds = time.perf_counter() - start
    began = time.perf_counter()
    del iterator
    return FLAGS.batches * FLAGS.global_batch / seconds, time.perf_counter() - began


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.INFO)
    import tensorflow as tf
    import tfdp

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        tfdp.configure_cpu_replicas(FLAGS.replicas)
    devices = ([f"/gpu:{i}" for i in range(len(gpus))] if gpus
               else [f"/cpu:{i}" for i in range(FLAGS.replicas)])
    strategies = {"tfdp": tfdp.DataParallelStrategy(devices=devices),
                  "mirrored": tf.distribute.MirroredStrategy(devices)}
    runs = {name: [] for name in FLAGS.configs}
    for round_ in range(FLAGS.rounds):
        for name in FLAGS.configs:
            strategy = strategies["mirrored" if name == "mirrored" else "tfdp"]
            rate, teardown = _measure(tf, strategy, True if name == "tfdp_autotune" else None)
            runs[name].append((rate, teardown))
            absl_logging.info("round %d %-14s %9.0f elements/s, iterator destroyed in %.3f s",
                              round_ + 1, name, rate, teardown)
    base = statistics.median(r for r, _ in runs.get("tfdp", runs[FLAGS.configs[0]]))
    rows = [{"config": name, "elements_per_s": statistics.median(r for r, _ in values),
             "ratio_to_tfdp": statistics.median(r for r, _ in values) / base,
             "longest_teardown_s": max(t for _, t in values)} for name, values in runs.items()]
    header = (f"devices: {devices} ({os.cpu_count()} cores), global batch {FLAGS.global_batch}, "
              f"work {FLAGS.work}, {FLAGS.batches} batches x {FLAGS.rounds} rounds, "
              f"TensorFlow {tf.__version__}")
    lines = [header, "", "| configuration | elements/s (median) | ratio to tfdp | longest "
             "iterator teardown |", "|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['elements_per_s']:.0f} | {r['ratio_to_tfdp']:.2f} | "
              f"{r['longest_teardown_s']:.3f} s |" for r in rows]
    print("\n".join(lines))
    if FLAGS.out:
        harness.write_text(FLAGS.out + ".md", "\n".join(lines))
        with open(FLAGS.out + ".json", "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
