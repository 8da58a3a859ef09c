"""ZeRO-3's step time against tfdp unsharded and ZeRO-2, on the same model and layout.

Configurations: ``unsharded`` (Keras's Adam under ``DataParallelStrategy``), ``zero2``
(``tfdp.ShardedOptimizer(Adam)``), ``zero3`` (``shard_parameters=True``, units re-gathered in
the backward pass) and ``zero3_keep`` (``reshard_after_forward=False``: no recomputation).
Layouts: ``4x1`` (one process, 4 logical CPU replicas) and ``2x2`` (``tfdp-run --workers 2
--cpu-replicas 2``, real processes on 127.0.0.1). Each run is a fresh process (or job): a
``--depth`` x ``--width`` MLP on ``--width`` inputs, Adam, ``fit`` for ``--warmup`` + ``--steps``
steps of global batch ``--batch``; the median time of the timed steps. A configuration with
the suffix ``_xla`` compiles with ``jit_compile=True``: ``zero3_xla`` compiles each unit on its
own (tfdp's ZeRO-3 under XLA), ``zero3_keep_xla`` the whole step with every parameter gathered
(what ZeRO-3 under XLA was before units: the baseline of issue 57's step-time bound, 1.25x).

A round runs every (layout, configuration) once, in an order rotated every round; each
round's ratio to ``unsharded`` is taken within the round (this host's noise between processes
is about +-25%, TF_NOTES.md), and the report gives the median ratio and its range.

    python tools/bench_zero3.py --rounds=3      # ~10 min; docs/benchmarks/zero3_speed.{md,csv}
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

import harness

CONFIGS = ("unsharded", "zero2", "zero3", "zero3_keep")
XLA_CONFIGS = ("unsharded_xla", "zero3_xla", "zero3_keep_xla")
LAYOUTS = ("4x1", "2x2")

FLAGS = flags.FLAGS


def define_flags():
    """The tool's flags (defined when it runs, so that importing it defines none)."""
    flags.DEFINE_list("configs", list(CONFIGS), "Configurations.")
    flags.DEFINE_list("layouts", list(LAYOUTS), "Layouts: 4x1 (one process), 2x2 (two workers).")
    flags.DEFINE_integer("depth", 8, "Dense layers.")
    flags.DEFINE_integer("width", 1024, "Units per layer (and inputs).")
    flags.DEFINE_integer("batch", 256, "Global batch.")
    harness.define_flags(
        rounds=(3, "Interleaved rounds."), warmup=(3, "Untimed steps (tracing)."),
        steps=(12, "Timed steps."),
        out=("docs/benchmarks/zero3_speed", "Output prefix ('' to skip)."),
        child="the configuration to run here.")
    flags.DEFINE_integer("child_replicas", 4, "Internal: local replicas of the child.")


def _child():
    import numpy as np
    import keras
    import tensorflow as tf

    import tfdp

    if "TF_CONFIG" not in os.environ:
        tfdp.configure_cpu_replicas(FLAGS.child_replicas)
    config, jit = FLAGS.child.removesuffix("_xla"), FLAGS.child.endswith("_xla")
    strategy = tfdp.DataParallelStrategy(shard_parameters=config.startswith("zero3"),
                                         reshard_after_forward=config != "zero3_keep")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(FLAGS.batch * 4, FLAGS.width)).astype("float32")
    y = rng.integers(0, 10, size=FLAGS.batch * 4).astype("int32")
    data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)).repeat(),
                                global_batch_size=FLAGS.batch)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FLAGS.width,))] + [
            keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth)]
            + [keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-4)
        if config == "zero2":
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer=optimizer, jit_compile=jit,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.warmup + FLAGS.steps, verbose=0,
              callbacks=[harness.timer(keras, times)])
    if strategy.cluster.is_chief:
        print(f"STEP_MS {1000 * statistics.median(times[FLAGS.warmup:]):.2f}", flush=True)


def _command(config, layout):
    args = [f"--child={config}",
            *harness.forward(FLAGS, "depth", "width", "batch", "warmup", "steps")]
    if layout == "4x1":
        return harness.command(__file__, *args, "--child_replicas=4")
    return harness.command(__file__, *args, workers=2, cpu_replicas=2)


def run_one(config, layout) -> float:
    proc = harness.run(_command(config, layout), env=harness.child_env(), timeout=900)
    for line in (proc.stdout + proc.stderr).splitlines():
        if "STEP_MS " in line:
            return float(line.split("STEP_MS ")[1])
    raise RuntimeError(f"{config} {layout} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def main(argv):
    del argv
    if FLAGS.child:
        return _child()
    jobs = [(layout, config) for layout in FLAGS.layouts for config in FLAGS.configs]
    runs = harness.interleaved(
        jobs, FLAGS.rounds, lambda layout, config: run_one(config, layout),
        lambda job, ms: f"{job[0]} {job[1]:10s} {ms:8.1f} ms/step", rotate=True)
    rows = [dict(round=r, layout=layout, config=config, step_ms=ms)
            for r, (layout, config), ms in runs]
    if FLAGS.out:
        _write(FLAGS.out, rows)


def base_of(config, configs) -> str:
    """What ``config`` is compared with: unsharded tfdp compiled alike where it was run. Pure."""
    base = "unsharded_xla" if config.endswith("_xla") else "unsharded"
    return base if base in configs else "unsharded"


def ratios(rows, layout, config, base="unsharded") -> list:
    """Per-round ratio of ``config``'s step time to ``base``'s, same layout. Pure."""
    by = {(r["round"], r["layout"], r["config"]): r["step_ms"] for r in rows}
    rounds = sorted({r["round"] for r in rows})
    return [by[(k, layout, config)] / by[(k, layout, base)] for k in rounds
            if (k, layout, config) in by and (k, layout, base) in by]


def _write(out, rows):
    params = FLAGS.depth * (FLAGS.width ** 2 + FLAGS.width) + FLAGS.width * 10 + 10
    text = [f"# ZeRO-3 step time ({time.strftime('%Y-%m-%d')})\n\n"
            f"`python tools/bench_zero3.py --rounds={FLAGS.rounds} "
            f"--configs={','.join(FLAGS.configs)} --layouts={','.join(FLAGS.layouts)}`: "
            f"an MLP of {FLAGS.depth} "
            f"Dense layers of {FLAGS.width} ({params / 1e6:.1f}M parameters), Adam, global "
            f"batch {FLAGS.batch}, median of {FLAGS.steps} steps after {FLAGS.warmup}, each "
            "run a fresh process (4x1) or tfdp-run job (2x2) on this 2-core host; ratios "
            "to unsharded tfdp within each round.\n\n"
            "| layout | configuration | ms/step (median of rounds) | compared with | "
            "median ratio | range |\n|---|---|---:|---|---:|---|\n"]
    for layout in FLAGS.layouts:
        for config in FLAGS.configs:
            ms = [r["step_ms"] for r in rows if r["layout"] == layout and r["config"] == config]
            base = base_of(config, FLAGS.configs)
            q = ratios(rows, layout, config, base) or [float("nan")]
            text.append(f"| {layout} | {config} | {statistics.median(ms):.1f} | {base} | "
                        f"{statistics.median(q):.2f} | {min(q):.2f}-{max(q):.2f} |\n")
        if {"zero3_xla", "zero3_keep_xla"} <= set(FLAGS.configs):
            q = ratios(rows, layout, "zero3_xla", "zero3_keep_xla")
            text.append(f"\n{layout}: ZeRO-3 with units compiled each on its own against the "
                        f"whole-gathered compiled step: median {statistics.median(q):.2f}x "
                        f"(range {min(q):.2f}-{max(q):.2f}; issue 57's bound 1.25x).\n\n")
    harness.write_report(out, "".join(text), rows)
    print(f"wrote {out}.md, {out}.csv")

if __name__ == "__main__":
    define_flags()
    app.run(main)
