"""Step time and peak memory of a DLRM-style recommender (tools/dlrm.py) with one large
Embedding table, Adam, global batch 256: one device, MirroredStrategy, tfdp and
tfdp.ShardedOptimizer on 4 logical CPU replicas, each in a fresh process, in interleaved
rounds (the order rotates every round), reported as ratios to one device.

Each child builds the model, runs ``--warmup`` steps of ``fit`` (tracing), then times
``--steps`` steps, and reports the median step time of its windows and its peak resident
memory (``VmHWM``) minus its resident memory just before the model was built. Keras's Adam
updates a table densely (its moments decay every row), so one device's step is dominated by
that update; under MirroredStrategy and tfdp every replica runs it on its own copy; under
ShardedOptimizer the table's owner runs it once and sends the new table to the others.

    python tools/bench_recommender.py                              # ~15 min on 2 cores
    python tools/bench_recommender.py --rows=1000000 --rounds=3    # the issue's headline
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

from absl import app, flags

import harness
from harness import HERE, ROOT

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["100000", "1000000", "4000000"], "Rows of the large table.")
flags.DEFINE_list("impls", ["one", "mirrored", "tfdp", "sharded"], "What to measure.")
flags.DEFINE_integer("replicas", 4, "Logical CPU replicas (all but one).")
flags.DEFINE_integer("dim", 64, "Embedding width.")
flags.DEFINE_integer("batch", 256, "Global batch.")
harness.define_flags(rounds=(2, "Interleaved rounds."), warmup=(2, "Untimed steps (tracing)."),
                     steps=(6, "Timed steps per process (in windows of 2)."),
                     out=("docs/benchmarks/bench_recommender", "Output prefix ('' to skip)."),
                     child="the implementation to measure in this process.")
flags.DEFINE_integer("child_timeout", 900, "Seconds before a child is stopped.")
flags.DEFINE_string("results", "", "JSON-lines file the runs append to (default: --out.jsonl).")
flags.DEFINE_boolean("report_only", False, "Only summarise --results into --out.")
flags.DEFINE_string("before_dir", "/tmp/tfdp-before-41",
                    "A checkout of --before_commit for the 'sharded_before' implementation.")
flags.DEFINE_string("before_commit", "e563938", "tfdp before issue 41's exchange changes.")
flags.DEFINE_integer("child_rows", 0, "Internal: rows for --child.")

LABELS = {"one": "one device", "mirrored": "MirroredStrategy", "tfdp": "tfdp",
          "sharded": "tfdp + ShardedOptimizer",
          "sharded_before": "ShardedOptimizer before (e563938)"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child():
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    impl, rows = FLAGS.child, FLAGS.child_rows
    import tfdp

    print(f"tfdp from {os.path.dirname(os.path.dirname(tfdp.__file__))}", flush=True)
    if impl != "one":
        tfdp.configure_cpu_replicas(FLAGS.replicas)
    import tensorflow as tf
    import keras

    import dlrm

    steps = FLAGS.warmup + FLAGS.steps
    x, y = dlrm.synthetic_clicks(rows, FLAGS.batch * steps, seed=1)
    if impl == "one":
        strategy = tf.distribute.get_strategy()
    elif impl == "mirrored":
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(FLAGS.replicas)])
    else:
        strategy = tfdp.DataParallelStrategy()
    before = _status_kib("VmRSS")
    with strategy.scope():
        model = dlrm.build_dlrm(rows, dim=FLAGS.dim)
        optimizer = keras.optimizers.Adam(1e-3)
        if impl.startswith("sharded"):
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer, "binary_crossentropy")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(FLAGS.batch, drop_remainder=True)

    class StepTimes(keras.callbacks.Callback):
        """When each step ends: one fit, so no fit's own start-up is in a step's time."""

        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    times = StepTimes()
    start = time.perf_counter()
    model.fit(ds, epochs=1, verbose=0, callbacks=[times])
    first = times.ends[FLAGS.warmup - 1] - start
    steps_timed = [b - a for a, b in zip(times.ends[FLAGS.warmup - 1:], times.ends[FLAGS.warmup:])]
    windows = [sum(steps_timed[i:i + 2]) / len(steps_timed[i:i + 2])
               for i in range(0, len(steps_timed), 2)]
    print(json.dumps({"impl": impl, "rows": rows,
                      "tfdp": os.path.dirname(os.path.dirname(os.path.abspath(tfdp.__file__))), "replicas": 1 if impl == "one" else FLAGS.replicas,
                      "step_ms": 1000 * statistics.median(windows),
                      "windows_ms": [round(1000 * w, 1) for w in windows],
                      "warmup_s": round(first, 1),
                      "peak_growth_mb": (_status_kib("VmHWM") - before) / 1024}), flush=True)


def run_child(impl, rows):
    env = dict(os.environ)
    if impl == "sharded_before":  # that tree's tfdp first on the path
        env = harness.child_env(harness.worktree(FLAGS.before_dir, FLAGS.before_commit), HERE)
    cmd = harness.command(__file__, f"--child={impl}", f"--child_rows={rows}",
                          *harness.forward(FLAGS, "replicas", "dim", "batch", "warmup", "steps"))
    try:
        proc = harness.run(cmd, timeout=FLAGS.child_timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "rows": rows, "error": f"timed out after {FLAGS.child_timeout} s"}
    found = harness.results(proc.stdout, prefix="")
    if found:
        return found[-1]
    tail = harness.tail(proc.stderr or proc.stdout, 3, " | ")
    return {"impl": impl, "rows": rows, "error": f"exit {proc.returncode}: {tail}"}


def summarise(results):
    """Per (rows, impl): median step, spread, ratio to one device per round, peak growth."""
    table = []
    for rows in sorted({r["rows"] for r in results}):
        ones = {r["round"]: r["step_ms"] for r in results
                if r["rows"] == rows and r["impl"] == "one" and "step_ms" in r}
        for impl in LABELS:
            runs = [r for r in results if r["rows"] == rows and r["impl"] == impl]
            if not runs:
                continue
            ok = [r for r in runs if "step_ms" in r]
            row = {"rows": rows, "impl": impl, "runs": len(runs)}
            if not ok:
                row["error"] = runs[-1]["error"]
                table.append(row)
                continue
            steps = [r["step_ms"] for r in ok]
            ratios = [r["step_ms"] / ones[r["round"]] for r in ok if r["round"] in ones]
            row.update(step_ms=statistics.median(steps), step_min=min(steps), step_max=max(steps),
                       ratio=statistics.median(ratios) if ratios else None,
                       ratio_min=min(ratios) if ratios else None,
                       ratio_max=max(ratios) if ratios else None,
                       peak_growth_mb=statistics.median(r["peak_growth_mb"] for r in ok))
            table.append(row)
    return table


def write_report(table, prefix):
    harness.write_csv(prefix + ".csv", table)
    lines = ["# Recommender step time and peak memory (tools/bench_recommender.py)", "",
             f"DLRM-style model (tools/dlrm.py), one large table x {FLAGS.dim}, Adam, global batch "
             f"{FLAGS.batch}, {FLAGS.replicas} logical CPU replicas on this 2-core host; fresh "
             "process per run, interleaved rounds; ratio = step time over one device's in the "
             "same round (median, with the range over rounds). Peak = VmHWM growth from just "
             "before the model is built.", "",
             "| table rows | implementation | step (ms) | x one device | peak growth (MB) | runs |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in table:
        if "error" in r:
            lines.append(f"| {r['rows']:,} | {LABELS[r['impl']]} | failed: {r['error'][:80]} | | | {r['runs']} |")
            continue
        ratio = ("" if r["ratio"] is None else
                 f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
        lines.append(f"| {r['rows']:,} | {LABELS[r['impl']]} | {r['step_ms']:.0f} "
                     f"({r['step_min']:.0f}-{r['step_max']:.0f}) | {ratio} | "
                     f"{r['peak_growth_mb']:.0f} | {r['runs']} |")
    harness.write_text(prefix + ".md", "\n".join(lines) + "\n")
    plt = harness.pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted({r["rows"] for r in table})
    for impl, label in LABELS.items():
        pts = [(r["rows"], r) for r in table if r["impl"] == impl and "error" not in r]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1]["step_ms"] for p in pts], "o-", label=label)
            ax2.plot([p[0] for p in pts], [p[1]["peak_growth_mb"] for p in pts], "o-", label=label)
    for ax, title in ((ax1, "step time (ms)"), (ax2, "peak memory growth (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
        ax.set_xlabel("rows of the large table")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    harness.save_figure(fig, prefix + ".png")


def main(argv):
    del argv
    if FLAGS.child:
        child()
        return
    results_path = FLAGS.results or (FLAGS.out + ".jsonl" if FLAGS.out else "")
    results = harness.read_jsonl(results_path)
    if not FLAGS.report_only:
        first_round = max((r["round"] for r in results), default=-1) + 1
        configs = [(int(rows), impl) for rows in FLAGS.rows for impl in FLAGS.impls]
        for k in range(FLAGS.rounds):
            shift = (first_round + k) % len(FLAGS.impls)
            order = sorted(configs, key=lambda c: (c[0], (FLAGS.impls.index(c[1]) - shift)
                                                   % len(FLAGS.impls)))
            for rows, impl in order:
                start = time.perf_counter()
                result = run_child(impl, rows)
                result["round"] = first_round + k
                print(f"round {first_round + k}: {rows:,} rows, {LABELS[impl]}: "
                      + (f"{result['step_ms']:.0f} ms/step, peak +{result['peak_growth_mb']:.0f} MB"
                         if "step_ms" in result else result["error"])
                      + f" ({time.perf_counter() - start:.0f} s)", flush=True)
                results.append(result)
                if results_path:
                    harness.append_jsonl(results_path, result)
    table = summarise(results)
    for r in table:
        print(r)
    if FLAGS.out:
        write_report(table, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
