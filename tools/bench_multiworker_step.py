"""Two workers on loopback: tfdp against patched MultiWorkerMirroredStrategy and against tfdp
before issue 20, in interleaved paired rounds, with the collectives each step runs.

tfdp and "before" train as a real job would, with ``tfdp.callbacks.BackupAndRestore`` (stop
agreement every step, saving at the epoch's end, after the measured steps); MWMS has no
per-step stop agreement (``--nobackup`` drops it for a plain comparison).

Layouts: 2 workers x 1 CPU replica and 2 workers x 2 CPU replicas (tfdp-run, 127.0.0.1).
Models: ``tiny`` (a 32-64-4 MLP whose step is well under a millisecond of compute) and ``mlp``
(the 1.05M-parameter benchmark MLP). Implementations, each in fresh processes:

* ``tfdp``: this tree, input through ``tfdp.data.distribute``;
* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` with the two Keras-3 fixes of
  TF_NOTES.md (and, for 2 replicas per worker, its local devices set to 2 logical CPUs, which
  the stock class never uses on a CPU host), input through Keras's own distribution;
* ``before``: tfdp at ``--before_commit`` (default 971cce4, before issue 20's leaner step:
  the end-of-data all-reduce every step, the stop flag's own all-reduce),
  checked out with ``git worktree add`` into ``--before_dir``.

A round runs every (model, layout) once per implementation, in an order rotated every round;
the per-round ratios tfdp/mwms and tfdp/before (of throughput) are summarised by their median
and spread, since this host's noise between processes is about +-25%. Each run appends one
JSON line to ``--results``, so the rounds can run in several invocations (one per lock) and
``--report`` summarises them. A separate short run per configuration counts the collectives
of a training step (``tfdp.resilience.stragglers`` times, hence counts, every collective).

Each run also records the chief's process CPU time per step (``cpu_ms``); the report gives a
bootstrap 95% interval of each median ratio. For looking into a gap: ``--nobackup`` (no stop
flag), ``--bucket_bytes=0`` (one collective per tensor), ``--pin`` (worker i on core i), each
with its own ``--results``/``--out``.

    python tools/bench_multiworker_step.py --rounds=15          # ~30 min in all
    python tools/bench_multiworker_step.py --rounds=1           # one round (~2 min), appended
    python tools/bench_multiworker_step.py --report             # docs/bench_multiworker_step.*
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

import harness
from harness import HERE, ROOT
from baselines import patched_mwms

FLAGS = flags.FLAGS
harness.define_flags(rounds=(1, "Interleaved rounds to run now (appended to --results)."),
                     warmup=(20, "Steps before the measured ones."),
                     steps=(100, "Measured steps per run."),
                     out=("docs/benchmarks/bench_multiworker_step", "Output prefix."),
                     child="implementation to run in this worker.")
flags.DEFINE_list("models", ["tiny", "mlp"], "Models: tiny, mlp, mlp20m (20 Dense layers, "
                  "20.5M parameters: issue 43's job).")
flags.DEFINE_list("layouts", ["1", "2"], "CPU replicas per worker (2 workers each).")
flags.DEFINE_list("impls", ["tfdp", "mwms", "before"], "Implementations to compare.")
flags.DEFINE_boolean("count", True, "Also count the collectives per step (one short run each).")
flags.DEFINE_boolean("report", False, "Only summarise --results into --out.")
flags.DEFINE_string("results", "docs/benchmarks/bench_multiworker_step.jsonl", "Raw results.")
flags.DEFINE_string("before_commit", "971cce4", "The tfdp commit to compare with.")
flags.DEFINE_string("note", "", "A sentence for the report: where and how its rows were measured "
                    "(the host, the commands), when it is not the default run.")
flags.DEFINE_string("before_dir", "/tmp/tfdp-before", "Where its worktree is checked out.")
# Child-process flags.
flags.DEFINE_string("model", "tiny", "Internal: model of --child.")
flags.DEFINE_integer("replicas", 1, "Internal: CPU replicas per worker of --child.")
flags.DEFINE_boolean("count_only", False, "Internal: count collectives instead of timing.")
flags.DEFINE_string("backup_dir", "", "Internal: tfdp.callbacks.BackupAndRestore's directory "
                    "for tfdp and before (empty: none).")
flags.DEFINE_boolean("pin", False, "Pin worker i to core i (mod the cores): each worker's thread "
                     "pools size themselves to one core and the workers stop preempting each "
                     "other, which narrows the spread between processes. Use with its own "
                     "--results/--out.")
flags.DEFINE_integer("bucket_bytes", -1, "tfdp's gradient bucket size (-1: the default; 0: one "
                     "collective per tensor, no concatenation).")
flags.DEFINE_string("variant", "", "Internal: the variant of --child (an impl named "
                    "'tfdp+VARIANT' or 'mwms+VARIANT'; see VARIANTS).")
flags.DEFINE_boolean("backup", True, "tfdp and before train with BackupAndRestore(check_every=1) "
                     "(preemption-safe, as a real job; MWMS has no per-step stop agreement).")

# Variants, for looking into a gap (impls named e.g. "tfdp+keras_input"; each is paired with the
# others of its round like any impl, and reported with --impls naming it):
VARIANTS = {
    "keras_input": "tfdp fed source.batch(global_batch) through Keras's own distribution",
    "tfdp_input": "MWMS fed through tfdp.data.distribute",
    "no_ride": "tfdp with the logs reduced by a collective of their own (no LogsRider)",
    "no_timeout": "tfdp with no per-collective deadline in TensorFlow's collectives",
    "old_order": "tfdp with its gradient exchange as before issue 43: buckets launched first "
                 "layers first, no backward pacing, TensorFlow's inter-op pool size",
    "fp16": "tfdp with compression='fp16' (half the bytes on the wire; within its tolerance, "
            "not exact)",
}
PER_REPLICA_BATCH = {"tiny": 32, "mlp": 64, "mlp20m": 64}
FEATURES = {"tiny": 32, "mlp": 256, "mlp20m": 1024}


def build(name, keras):
    if name == "tiny":
        return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(4)])
    from models import build_model

    return build_model(name, keras)


def _load_counter():
    """This tree's collective counter, loaded by file so that it also counts for the tfdp
    of another commit (whose package has no counter) and for MWMS."""
    modules = {}
    # distribute.py imports its core by name; this tree's core stands in for it while it loads
    # (another commit's tfdp has no such module).
    saved_core = sys.modules.get("tfdp._tf_private.core")
    for name, path in (("core", "tfdp/_tf_private/core.py"),
                       ("private", "tfdp/_tf_private/distribute.py"),
                       ("stragglers", "tfdp/resilience/stragglers.py")):
        spec = importlib.util.spec_from_file_location(f"bench_now_{name}", os.path.join(ROOT, path))
        modules[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = modules[name]  # dataclasses look their module up there
        if name == "core":
            sys.modules["tfdp._tf_private.core"] = modules[name]
        spec.loader.exec_module(modules[name])
    if saved_core is None:
        del sys.modules["tfdp._tf_private.core"]
    else:
        sys.modules["tfdp._tf_private.core"] = saved_core
    # The timing ops must run order-independently (this tree's rule), whatever tfdp is imported.
    modules["stragglers"]._independent = lambda t: (
        modules["private"].run_independently(getattr(t, "op", t)), t)[1]
    modules["private"].patch_collective_ops(modules["stragglers"]._timed)
    timer = modules["stragglers"].StepTimer()
    timer.listen()
    return modules["stragglers"].collectives_executed


def child():
    if FLAGS.pin:
        harness.pin_to_one_core()
    if FLAGS.variant == "old_order":  # TensorFlow's own pool size, as before issue 43
        os.environ["TF_NUM_INTEROP_THREADS"] = str(len(os.sched_getaffinity(0)))
    import numpy as np
    import keras
    import tensorflow as tf
    import tfdp

    kind, name, variant = FLAGS.child, FLAGS.model, FLAGS.variant
    if variant == "old_order":
        tfdp.strategy.collectives.LAUNCH_ORDER = "first_layers_first"
    if variant and variant not in VARIANTS:
        raise app.UsageError(f"unknown variant {variant!r}; one of {sorted(VARIANTS)}")
    if variant == "no_ride":
        tfdp.strategy.xla.rides_metrics = lambda *args, **kwargs: False
    count = _load_counter() if FLAGS.count_only else None
    if kind == "mwms":
        tfdp.configure_cpu_replicas(FLAGS.replicas)
        strategy = patched_mwms(tf, FLAGS.replicas)
    else:
        strategy = tfdp.DataParallelStrategy(  # TFDP_CPU_REPLICAS from tfdp-run
            bucket_bytes=None if FLAGS.bucket_bytes < 0 else FLAGS.bucket_bytes,
            compression="fp16" if variant == "fp16" else None)
    if variant == "no_timeout":
        tfdp._tf_private.communication_options(strategy.extended).timeout_seconds = None
    global_batch = PER_REPLICA_BATCH[name] * strategy.num_replicas_in_sync
    steps = FLAGS.warmup + (10 if FLAGS.count_only else FLAGS.steps)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * steps, FEATURES[name])).astype("float32")
    y = rng.integers(0, 4, size=len(x)).astype("int32")
    source = tf.data.Dataset.from_tensor_slices((x, y))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(name, keras)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_input = (kind == "mwms") != (variant in ("keras_input", "tfdp_input"))
    train = (source.batch(global_batch) if keras_input
             else tfdp.data.distribute(strategy, source, global_batch))

    class Stamps(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.cpu, self.counts = [], [], []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())  # every thread of this worker
            if count is not None:
                self.counts.append(count())

    stamps = Stamps()
    callbacks = [stamps]
    if kind != "mwms" and FLAGS.backup_dir:  # saves at the epoch's end, after the measurement
        callbacks.insert(0, tfdp.callbacks.BackupAndRestore(FLAGS.backup_dir, save_freq="epoch",
                                                            dataset=None if keras_input else train,
                                                            check_every=1))
    model.fit(train, epochs=1, verbose=0, callbacks=callbacks)
    result = {"impl": kind, "model": name, "replicas": FLAGS.replicas,
              "params": model.count_params(), "pinned": FLAGS.pin}
    if count is not None:
        deltas = [b - a for a, b in zip(stamps.counts[FLAGS.warmup:], stamps.counts[FLAGS.warmup + 1:])]
        result["collectives_per_step"] = statistics.median(deltas) / FLAGS.replicas
    else:
        deltas = [b - a for a, b in zip(stamps.times[FLAGS.warmup:], stamps.times[FLAGS.warmup + 1:])]
        result["step_ms"] = 1000 * statistics.median(deltas)
        measured = stamps.cpu[FLAGS.warmup:]
        # The chief's CPU time per step: the work, less sensitive than wall time to how the
        # host schedules the two workers (this host's noise between processes is +-25%).
        result["cpu_ms"] = 1000 * (measured[-1] - measured[0]) / (len(measured) - 1)
        result["samples_per_s"] = global_batch / statistics.median(deltas)
    print("RESULT " + json.dumps(result), flush=True)  # tfdp-run shows the chief's


def launch(impl, model, replicas, count_only=False):
    tree = FLAGS.before_dir if impl.startswith("before") else ROOT
    env = dict(harness.child_env(), PYTHONPATH=tree + os.pathsep + HERE)
    base, _, variant = impl.partition("+")
    backup = tempfile.mkdtemp(prefix="bench-backup-") if FLAGS.backup and base != "mwms" else ""
    cmd = harness.command(__file__, f"--child={'tfdp' if base == 'before' else base}",
                          f"--variant={variant}", f"--model={model}", f"--replicas={replicas}",
                          *harness.forward(FLAGS, "warmup", "steps"), f"--count_only={count_only}",
                          f"--backup_dir={backup}", *harness.forward(FLAGS, "pin", "bucket_bytes"),
                          workers=2, cpu_replicas=replicas, launcher=["--timeout", "600"])
    try:
        proc = harness.run(cmd, env=env, timeout=900)
    finally:
        if backup:
            shutil.rmtree(backup, ignore_errors=True)
    found = harness.results(proc.stdout + proc.stderr)
    if found:
        return dict(found[0], impl=impl)
    raise RuntimeError(f"{impl}/{model}/{replicas}: no result (exit {proc.returncode}):\n"
                       + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))


def run_rounds():
    if "before" in FLAGS.impls:
        harness.worktree(FLAGS.before_dir, FLAGS.before_commit)
    existing = harness.read_jsonl(FLAGS.results)
    first = 1 + max((r["round"] for r in existing if "round" in r), default=0)
    started = time.time()
    for r in range(first, first + FLAGS.rounds):
        for model in FLAGS.models:
            for replicas in map(int, FLAGS.layouts):
                shift = r % len(FLAGS.impls)  # rotate the order every round
                for impl in FLAGS.impls[shift:] + FLAGS.impls[:shift]:
                    row = dict(launch(impl, model, replicas), round=r)
                    harness.append_jsonl(FLAGS.results, row)
                    print(f"[{time.time() - started:5.0f}s] round {r} {model:4s} 2x{replicas} "
                          f"{impl:6s} {row['step_ms']:7.2f} ms/step", flush=True)
    if FLAGS.count:
        counted = {(c["impl"], c["model"], c["replicas"]) for c in existing if "collectives_per_step" in c}
        for model in FLAGS.models:
            for replicas in map(int, FLAGS.layouts):
                for impl in FLAGS.impls:
                    if (impl, model, replicas) not in counted:
                        row = launch(impl, model, replicas, count_only=True)
                        harness.append_jsonl(FLAGS.results, row)
                        print(f"collectives per step: {model} 2x{replicas} {impl}: "
                              f"{row['collectives_per_step']:g}", flush=True)


def ratios(rows, model, replicas, against, key="samples_per_s"):
    """Per-round ratios tfdp / ``against`` of ``key`` (>1: tfdp better): throughput, or with
    ``key="cpu_ms"`` the chief's CPU time per step the other way round."""
    by_round = {}
    for r in rows:
        if "round" in r and r["model"] == model and r["replicas"] == replicas and key in r:
            by_round.setdefault(r["round"], {})[r["impl"]] = r[key]
    pairs = [(v["tfdp"], v[against]) for v in by_round.values() if "tfdp" in v and against in v]
    return [b / a if key == "cpu_ms" else a / b for a, b in pairs]


def median_interval(q, draws=2000, seed=0):
    """A 95% bootstrap interval of the median of the per-round ratios ``q``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(q, k=len(q))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def ratio_cell(q):
    if not q:
        return "-"
    lo, hi = median_interval(q)
    return (f"{statistics.median(q):.3f} [{min(q):.3f}, {max(q):.3f}] "
            f"(95% CI of the median {lo:.2f}-{hi:.2f}; {sum(x >= 1 for x in q)}/{len(q)} >= 1)")


def summarise():
    rows = harness.read_jsonl(FLAGS.results)
    counts = {(r["impl"], r["model"], r["replicas"]): r["collectives_per_step"]
              for r in rows if "collectives_per_step" in r}
    lines = ["| model | layout | impl | ms/step (median of rounds) | collectives/step/replica |",
             "|---|---|---|---:|---:|"]
    table = ["| model | layout | rounds | tfdp/MWMS median [min, max] | tfdp/before median [min, max] "
             "| MWMS/tfdp chief CPU per step (rounds that measured it) |",
             "|---|---|---:|---|---|---|"]
    csv_rows = []
    for model in FLAGS.models:
        for replicas in map(int, FLAGS.layouts):
            for impl in FLAGS.impls:
                times = [r["step_ms"] for r in rows if "round" in r and r["impl"] == impl
                         and r["model"] == model and r["replicas"] == replicas]
                c = counts.get((impl, model, replicas))
                if times:
                    lines.append(f"| {model} | 2x{replicas} | {impl} | {statistics.median(times):.2f} | "
                                 + (f"{c:g} |" if c is not None else "- |"))
            cells = []
            for against in ("mwms", "before"):
                q = ratios(rows, model, replicas, against)
                cells.append(ratio_cell(q))
                csv_rows.append({"model": model, "replicas": replicas, "against": against,
                                 "rounds": len(q), "median_ratio": statistics.median(q) if q else None,
                                 "min": min(q) if q else None, "max": max(q) if q else None})
            n = len(ratios(rows, model, replicas, "mwms"))
            cpu = ratios(rows, model, replicas, "mwms", key="cpu_ms")
            table.append(f"| {model} | 2x{replicas} | {n} | {cells[0]} | {cells[1]} | "
                         f"{ratio_cell(cpu)} |")
    text = "\n".join(["# Two workers on loopback: tfdp, MultiWorkerMirroredStrategy, tfdp before",
                      "", "Throughput ratios of interleaved paired rounds (>1: tfdp faster; the "
                      "interval is a bootstrap of the rounds' median). The CPU column divides "
                      "the chief worker's process CPU time per step (>1: tfdp does less work). "
                      f"Before = tfdp at {FLAGS.before_commit}. "
                      + (FLAGS.note or "Command: `python tools/bench_multiworker_step.py "
                         "--rounds=15` (then `--report`)."),
                      "", *table, "", *lines])
    print(text)
    harness.write_text(FLAGS.out + ".md", text)
    if csv_rows:
        harness.write_csv(FLAGS.out + ".csv", csv_rows)
    plot(rows)


def plot(rows):
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, against in zip(axes, ("mwms", "before")):
        labels, data = [], []
        for model in FLAGS.models:
            for replicas in map(int, FLAGS.layouts):
                q = ratios(rows, model, replicas, against)
                if q:
                    labels.append(f"{model}\n2x{replicas}")
                    data.append(q)
        if data:
            ax.boxplot(data)
            ax.set_xticks(range(1, len(labels) + 1), labels)
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_title(f"tfdp / {against}: per-round throughput ratio")
    harness.save_figure(fig, FLAGS.out + ".png")


def main(argv):
    del argv
    if FLAGS.child:
        return child()
    if not FLAGS.report:
        run_rounds()
    summarise()


if __name__ == "__main__":
    app.run(main)
