"""What preemption safety costs: the per-step stop agreement, SIGTERM-to-exit time, backups.

Two workers on 127.0.0.1 (tfdp-run, 1 logical CPU replica each) train the benchmark MLP
(1.05M parameters, Adam, global batch 128) in three configurations, interleaved over rounds:

* ``plain``: no callback;
* ``backup``: ``tfdp.callbacks.BackupAndRestore(save_freq="epoch")`` with the default stop
  agreement every step (``check_every=1``; the flag rides in the gradient all-reduce, so no
  collective of its own);
* ``backup-every-10``: the same with ``check_every=10`` (which now only matters where the flag
  cannot ride, e.g. ShardedOptimizer);
* ``monitor``: ``tfdp.callbacks.StragglerMonitor(window=20)`` alone (every collective of the
  step timed: two timestamps and one host call each, one all-reduce per window).

Then it preempts a running job (SIGTERM to tfdp-run) and reports the time to exit 143, the
backup's size and the time to write it.

    python tools/bench_resilience.py            # ~3 min; writes docs/benchmarks/bench_resilience.{md,csv,png}
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time

from absl import app, flags

import harness
from harness import ROOT

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["plain", "backup", "backup-every-10", "monitor"],
                  "Configurations to measure (plain, backup, backup-every-10, monitor).")
flags.DEFINE_integer("preemptions", 3, "SIGTERM-to-exit measurements.")
flags.DEFINE_string("backup_dir", "", "Internal: backup directory for --child.")
harness.define_flags(rounds=(3, "Interleaved rounds of the three configurations."),
                     steps=(150, "Measured steps per run (after 20 warm-up steps)."),
                     out="docs/benchmarks/bench_resilience",
                     child="configuration to run in this worker.")

CONFIGS = ("plain", "backup", "backup-every-10", "monitor")
GLOBAL_BATCH = 128
WARMUP = 20


def child():
    import numpy as np
    import keras
    import tensorflow as tf
    import tfdp
    from models import build_model

    strategy = tfdp.DataParallelStrategy()
    rng = np.random.default_rng(0)
    steps = WARMUP + FLAGS.steps
    x = rng.normal(size=(GLOBAL_BATCH * steps, 256)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    with strategy.scope():
        model = build_model("mlp", keras)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH)

    class Times(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.count = [], 0

        def on_train_batch_end(self, batch, logs=None):
            self.count += 1
            self.times.append(time.perf_counter())
            if self.count == WARMUP:
                print("TRAINING", flush=True)

    times = Times()
    callbacks = [times]
    backup = None
    if FLAGS.child == "monitor":
        callbacks.append(tfdp.callbacks.StragglerMonitor(window=20))
    elif FLAGS.child != "plain":
        backup = tfdp.callbacks.BackupAndRestore(
            FLAGS.backup_dir, save_freq="epoch", dataset=train,
            check_every=10 if FLAGS.child == "backup-every-10" else 1)
        callbacks.insert(0, backup)
    epochs = 1000 if FLAGS.child == "preempt" else 1
    try:
        model.fit(train, epochs=epochs, verbose=0, callbacks=callbacks)
    except SystemExit:
        if strategy.cluster.is_chief:
            print("RESULT " + json.dumps({"backup_seconds": backup.last_backup_seconds}), flush=True)
        raise
    deltas = [b - a for a, b in zip(times.times[WARMUP:], times.times[WARMUP + 1:])]
    if strategy.cluster.is_chief:
        print("RESULT " + json.dumps({"step_ms": 1000 * statistics.median(deltas)}), flush=True)


def launch(config, backup_dir):
    cmd = harness.command(__file__, f"--child={config}", f"--backup_dir={backup_dir}",
                          workers=2, cpu_replicas=1)
    return subprocess.Popen(cmd, env=harness.child_env(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def result_of(lines):
    found = harness.results("".join(lines))
    if not found:
        raise RuntimeError("no result:\n" + "".join(lines[-30:]))
    return found[0]


def step_ms(config):
    with tempfile.TemporaryDirectory() as tmp:
        proc = launch(config, os.path.join(tmp, "backup"))
        lines = list(proc.stdout)
        proc.wait(timeout=600)
    return result_of(lines)["step_ms"]


def measure_steps():
    runs = harness.interleaved(FLAGS.configs, FLAGS.rounds, step_ms,
                               lambda config, ms: f"{config:16s} {ms:.2f} ms/step")
    return [{"round": r + 1, "config": config, "step_ms": round(ms, 3)} for r, config, ms in runs]


def measure_preemption():
    rows = []
    for i in range(FLAGS.preemptions):
        with tempfile.TemporaryDirectory() as tmp:
            backup_dir = os.path.join(tmp, "backup")
            proc = launch("preempt", backup_dir)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "TRAINING" in line:
                    break
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            lines += list(proc.stdout)
            code = proc.wait(timeout=120)
            seconds = time.monotonic() - sent
            size = sum(os.path.getsize(os.path.join(d, f))
                       for d, _, files in os.walk(backup_dir) for f in files)
            backup_s = result_of(lines)["backup_seconds"]
        print(f"preemption {i + 1}: exit {code} after {seconds:.2f} s; backup {size / 1e6:.1f} MB "
              f"in {backup_s:.2f} s", flush=True)
        rows.append({"exit_code": code, "sigterm_to_exit_s": round(seconds, 3),
                     "backup_mb": round(size / 1e6, 2), "backup_write_s": round(backup_s, 3)})
    return rows


def main(argv):
    del argv
    if FLAGS.child:
        child()
        return
    steps = measure_steps()
    preempt = measure_preemption()
    configs = [c for c in CONFIGS if c in FLAGS.configs]
    med = {c: statistics.median(r["step_ms"] for r in steps if r["config"] == c) for c in configs}
    lines = [
        "# Preemption safety: what it costs",
        "",
        "Two workers on 127.0.0.1 (tfdp-run, 1 CPU replica each), the 1.05M-parameter benchmark MLP,",
        f"Adam, global batch {GLOBAL_BATCH}; median step time over {FLAGS.steps} steps, "
        f"{FLAGS.rounds} interleaved rounds. Command: `python tools/bench_resilience.py`.",
        "",
        "| configuration | step (ms, median of rounds) | vs plain |",
        "|---|---|---|",
    ]
    for c in configs:
        lines.append(f"| {c} | {med[c]:.2f} | {med[c] / med['plain']:.3f} |")
    lines += ["", "Per round: " + "; ".join(f"{r['config']} {r['step_ms']:.2f}" for r in steps), "",
              "| preemption | exit code | SIGTERM to exit (s) | backup size (MB) | backup write (s) |",
              "|---|---|---|---|---|"]
    for i, r in enumerate(preempt):
        lines.append(f"| {i + 1} | {r['exit_code']} | {r['sigterm_to_exit_s']:.2f} | {r['backup_mb']:.1f} "
                     f"| {r['backup_write_s']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if FLAGS.out:
        harness.write_report(FLAGS.out, text, steps, lambda ax: plot(ax, steps, configs))


def plot(ax, steps, configs):
    for c in configs:
        vals = [r["step_ms"] for r in steps if r["config"] == c]
        ax.plot(range(1, len(vals) + 1), vals, marker="o", label=c)
    harness.label_axes(ax, "round", "ms / step (2 workers)",
                       "Cost of the preemption agreement and the straggler monitor", legend={})


if __name__ == "__main__":
    app.run(main)
