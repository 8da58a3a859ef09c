"""Training throughput of model.fit: tfdp.DataParallelStrategy against TensorFlow's own
strategies, same models and data, measured in one run, interleaved, in separate processes.

Single host (1, 2, 4 logical CPU replicas): tfdp vs tf.distribute.MirroredStrategy, and
OneDeviceStrategy at 1 replica. Two workers on 127.0.0.1 (through tfdp-run): tfdp vs
tf.distribute.MultiWorkerMirroredStrategy (stock is tried first; it fails with Keras 3, so
the patched form is measured and the output says so). Also: input-pipeline throughput of
tfdp.data against training throughput.

    python tools/bench_step.py                  # ~8 min; writes docs/benchmarks/bench_step.{md,csv,png}
"""

from __future__ import annotations

import json
import time

from absl import app, flags, logging as absl_logging

import harness
from harness import ROOT
from baselines import patched_mwms
from models import build_model  # flag-free: shared with other tools

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "convnet", "transformer"], "Models to measure.")
flags.DEFINE_list("replicas", ["1", "2", "4"], "Logical CPU replica counts.")
flags.DEFINE_integer("rounds", 2, "Interleaved rounds (each config once per round).")
flags.DEFINE_integer("windows", 5, "Measured windows per process (after warm-up).")
flags.DEFINE_integer("steps", 20, "Steps per window.")
flags.DEFINE_boolean("multi_worker", True, "Also run 2 workers through tfdp-run.")
flags.DEFINE_string("out", "docs/benchmarks/bench_step", "Output prefix for .md/.csv/.png ('' to skip).")
# Child-process flags.
flags.DEFINE_string("child", "", "Internal: strategy to measure in this process.")
flags.DEFINE_string("model", "mlp", "Internal: model for --child.")
flags.DEFINE_integer("n", 1, "Internal: replicas for --child.")

PER_REPLICA_BATCH = {"mlp": 64, "convnet": 32, "transformer": 32}


def input_shape(name):
    return {"mlp": (256,), "convnet": (32, 32, 3), "transformer": (32, 64)}[name]


def child():
    """Measure one configuration; print one JSON line."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    import numpy as np
    import tensorflow as tf
    import keras

    import tfdp

    kind, name, n = FLAGS.child, FLAGS.model, FLAGS.n
    multi = kind in ("tfdp-mw", "mwms", "mwms-stock")
    if not multi:
        tfdp.configure_cpu_replicas(n)
    devices = [f"/device:CPU:{i}" for i in range(n)]
    if kind in ("tfdp", "tfdp-mw"):
        strategy = tfdp.DataParallelStrategy(devices=None if multi else devices)
    elif kind == "mirrored":
        strategy = tf.distribute.MirroredStrategy(devices)
    elif kind == "onedevice":
        strategy = tf.distribute.OneDeviceStrategy(devices[0])
    elif kind == "mwms-stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = patched_mwms(tf)
    replicas = strategy.num_replicas_in_sync
    global_batch = PER_REPLICA_BATCH[name] * replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch,) + input_shape(name)).astype("float32")
    y = rng.integers(0, 10, size=global_batch).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(name, keras)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0)  # trace + warm up
    rates = []
    for _ in range(FLAGS.windows):
        t = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0)
        rates.append(global_batch * FLAGS.steps / (time.perf_counter() - t))
    result = {"strategy": kind, "model": name, "replicas": replicas,
              "samples_per_s": float(np.median(rates)), "params": model.count_params()}
    if kind == "tfdp" and name == "mlp":
        # Input pipeline alone: tfdp.data.distribute over the same element stream.
        dist = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)).repeat(),
                                    global_batch)
        it = iter(dist)
        for _ in range(5):
            next(it)
        t = time.perf_counter()
        for _ in range(200):
            next(it)
        result["input_samples_per_s"] = global_batch * 200 / (time.perf_counter() - t)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(args, multi_worker=False):
    cmd = harness.command(__file__, *harness.forward(FLAGS, "windows", "steps"), *args,
                          workers=2 if multi_worker else 0, launcher=["--timeout", "300"])
    proc = harness.run(cmd, env=harness.child_env(ROOT), timeout=600)
    results = harness.results(proc.stdout)
    if proc.returncode != 0 or not results:
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                  if "Error" in ln and "oneDNN" not in ln]
        tail = errors[-2:] or (proc.stdout + proc.stderr).strip().splitlines()[-2:]
        return None, " | ".join(t.strip()[:300] for t in tail)
    return results[0], None  # worker 0's line comes first with tfdp-run? take any: they agree


def main(argv):
    del argv
    if FLAGS.child:
        return child()
    import numpy as np

    configs = []
    for model in FLAGS.models:
        for n in map(int, FLAGS.replicas):
            for kind in (["onedevice"] if n == 1 else []) + ["mirrored", "tfdp"]:
                configs.append((kind, model, n))
    samples = {c: [] for c in configs}
    extra = {}
    notes = []
    started = time.time()
    for r in range(FLAGS.rounds):
        for c in configs:
            kind, model, n = c
            res, err = run_child([f"--child={kind}", f"--model={model}", f"--n={n}"])
            if res is None:
                notes.append(f"{kind}/{model}/{n}: failed: {err}")
                print(f"[{time.time() - started:5.0f}s] {kind:9s} {model:11s} n={n}: FAILED {err}", flush=True)
                continue
            samples[c].append(res["samples_per_s"])
            if "input_samples_per_s" in res:
                extra.setdefault("input", []).append((res["input_samples_per_s"], res["samples_per_s"], n))
            print(f"[{time.time() - started:5.0f}s] round {r + 1}: {kind:9s} {model:11s} n={n}: "
                  f"{res['samples_per_s']:9,.0f} samples/s", flush=True)
    mw = {}
    if FLAGS.multi_worker:
        res, err = run_child(["--child=mwms-stock", "--model=mlp", "--n=1"], multi_worker=True)
        stock_note = ("stock MultiWorkerMirroredStrategy + Keras 3 model.fit "
                      + ("ran" if res else f"FAILED ({err}); measured with the TF_NOTES.md patch "
                         "(reduce mapped over nests, axis=None for scalars)"))
        print(stock_note, flush=True)
        notes.append(stock_note)
        for r in range(FLAGS.rounds):
            for kind in ("mwms", "tfdp-mw"):
                res, err = run_child([f"--child={kind}", "--model=mlp", "--n=1"], multi_worker=True)
                if res:
                    mw.setdefault(kind, []).append(res["samples_per_s"])
                    print(f"[{time.time() - started:5.0f}s] round {r + 1}: 2 workers {kind}: "
                          f"{res['samples_per_s']:,.0f} samples/s", flush=True)
                else:
                    notes.append(f"2 workers {kind}: failed: {err}")

    med = {c: float(np.median(v)) for c, v in samples.items() if v}
    lines = ["| model | replicas | OneDevice | Mirrored | tfdp | tfdp / Mirrored |",
             "|---|---:|---:|---:|---:|---:|"]
    rows = []
    for model in FLAGS.models:
        for n in map(int, FLAGS.replicas):
            one = med.get(("onedevice", model, n))
            mir = med.get(("mirrored", model, n))
            ours = med.get(("tfdp", model, n))
            ratio = ours / mir if ours and mir else float("nan")
            rows.append({"model": model, "replicas": n, "onedevice": one, "mirrored": mir,
                         "tfdp": ours, "ratio_tfdp_mirrored": ratio})
            def fmt(v):
                return f"{v:,.0f}" if v else "-"

            lines.append(f"| {model} | {n} | {fmt(one)} | {fmt(mir)} | {fmt(ours)} | {ratio:.2f} |")
    if mw:
        a, b = np.median(mw.get("mwms", [np.nan])), np.median(mw.get("tfdp-mw", [np.nan]))
        lines += ["", "| 2 workers x 1 CPU, mlp | MultiWorkerMirrored (patched) | tfdp | tfdp / MWMS |",
                  "|---|---:|---:|---:|", f"| samples/s | {a:,.0f} | {b:,.0f} | {b / a:.2f} |"]
    if "input" in extra:
        lines += ["", "| input pipeline (mlp, tfdp.data) | replicas | input samples/s | training samples/s | input / training |",
                  "|---|---:|---:|---:|---:|"]
        by_n = {}
        for inp, trn, n in extra["input"]:
            by_n.setdefault(n, []).append((inp, trn))
        for n, vals in sorted(by_n.items()):
            inp, trn = np.median([v[0] for v in vals]), np.median([v[1] for v in vals])
            lines.append(f"| | {n} | {inp:,.0f} | {trn:,.0f} | {inp / trn:.1f} |")
    text = "\n".join(lines)
    print("\n" + text + "\n\n" + "\n".join(f"note: {n}" for n in notes))
    if FLAGS.out:
        harness.write_csv(FLAGS.out + ".csv", rows)
        harness.write_text(FLAGS.out + ".md", "# model.fit throughput (tools/bench_step.py)\n\n"
                    f"Median samples/s over {FLAGS.rounds} interleaved rounds x {FLAGS.windows} "
                    f"windows of {FLAGS.steps} steps; SGD+momentum; synthetic data; per-replica "
                    f"batch {PER_REPLICA_BATCH}. 2-core CPU host, logical CPU replicas.\n\n"
                          + text + "\n\n" + "\n".join(f"- {n}" for n in notes))
        plt = harness.pyplot()
        fig, axes = plt.subplots(1, len(FLAGS.models), figsize=(4.5 * len(FLAGS.models), 3.6))
        for ax, model in zip(np.atleast_1d(axes), FLAGS.models):
            for kind, style in (("mirrored", "s--"), ("tfdp", "o-")):
                pts = [(n, med[(kind, model, n)]) for n in map(int, FLAGS.replicas) if (kind, model, n) in med]
                if pts:
                    ax.plot(*zip(*pts), style, label=kind)
            if ("onedevice", model, 1) in med:
                ax.plot([1], [med[("onedevice", model, 1)]], "k^", label="onedevice")
            ax.set_title(model)
            ax.set_xlabel("CPU replicas (2 physical cores)")
            ax.set_ylabel("samples/s")
            ax.legend()
        harness.save_figure(fig, FLAGS.out + ".png")
        print(f"wrote {FLAGS.out}.md/.csv/.png")


if __name__ == "__main__":
    app.run(main)
