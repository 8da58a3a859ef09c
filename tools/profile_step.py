"""A TensorFlow profiler trace of a few steps of a 2-worker tfdp job, and what it says about
the gradient exchange: per step, when backward ends, when each bucket's collective starts
and ends, and the share of the exchange hidden behind compute (issue 43).

Two workers on 127.0.0.1 (``tfdp-run --workers 2``, one CPU replica each, each pinned to
its own core with ``--pin``) train ``--model`` with Keras ``fit`` and SGD; after
``--warmup`` steps the chief records ``--steps`` steps with
``tf.profiler.experimental.start``/``stop`` into ``--logdir/worker0`` (TensorBoard's
profile plugin shows it: ``tensorboard --logdir LOGDIR``). The trace is then read here,
offline, from the ``.xplane.pb`` the profiler writes (TensorFlow's XSpace protocol buffer;
no TensorBoard plugin needed), and printed per step of the chief:

* ``backward_end``: the end of the last op of the gradient computation (Keras's
  ``gradient_tape/`` ops), from the step's start;
* for each collective of the step, in launch order: its start and end, its size, and
  ``launch``: which layers its bucket holds (``last`` when it reduces the output layer's
  gradient, ``first`` when it reduces the input layer's);
* ``hidden``: the share of the collectives' busy time that overlaps backward.

``--launch_order=first_layers_first`` runs the order of tfdp before issue 43, for the
comparison; ``--plot`` draws one step of each order as a timeline.

On a worker pinned to one core TensorFlow's inter-op pool has one thread and a ready
collective waits there until backprop ends; ``--interop=2`` gives the workers two (what
docs/strategy.md's picture shows).

    python tools/profile_step.py --model=mlp20m --pin --interop=2          # ~1 min
    python tools/profile_step.py --model=mlp20m --pin --interop=2 \
        --plot=docs/benchmarks/profile_step_overlap.png                    # both orders
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile

from absl import app, flags

import harness
from harness import HERE, ROOT

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp20m", "A model of tools/models.py (mlp20m: 20 Dense layers, "
                    "20.5M parameters).")
flags.DEFINE_integer("batch", 64, "Per-replica batch.")
flags.DEFINE_integer("warmup", 5, "Steps before the profiled ones.")
flags.DEFINE_integer("steps", 3, "Profiled steps.")
flags.DEFINE_boolean("pin", True, "Pin worker i to core i (mod the cores).")
flags.DEFINE_string("logdir", "", "Where the traces go (default: a new temporary directory).")
flags.DEFINE_enum("launch_order", "last_layers_first", ["last_layers_first", "first_layers_first"],
                  "tfdp's bucket launch order (first_layers_first: before issue 43).")
flags.DEFINE_integer("bucket_bytes", -1, "tfdp's bucket size (-1: the default).")
flags.DEFINE_string("plot", "", "Also profile the other launch order and draw one step of each "
                    "as a timeline into this PNG.")
flags.DEFINE_integer("timeout", 600, "Seconds the job may take.")
flags.DEFINE_boolean("json", False, "Print the parsed steps as one JSON line too.")
flags.DEFINE_integer("interop", 0, "TF_NUM_INTEROP_THREADS for the workers (0: TensorFlow's "
                     "default).")
flags.DEFINE_boolean("worker", False, "Internal: run as a worker of the job.")


# --- The worker ----------------------------------------------------------------------------

def worker():
    if FLAGS.pin:
        harness.pin_to_one_core()
    if FLAGS.interop:
        os.environ["TF_NUM_INTEROP_THREADS"] = str(FLAGS.interop)
    import numpy as np
    import keras
    import tensorflow as tf

    import tfdp
    from tfdp.strategy import collectives

    sys.path.insert(0, HERE)
    from models import build_model

    collectives.LAUNCH_ORDER = FLAGS.launch_order
    strategy = tfdp.DataParallelStrategy(
        bucket_bytes=None if FLAGS.bucket_bytes < 0 else FLAGS.bucket_bytes)
    rank = strategy.cluster.rank
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(FLAGS.model, keras)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    features, classes = model.input_shape[-1], model.output_shape[-1]
    global_batch = FLAGS.batch * strategy.num_replicas_in_sync
    steps = FLAGS.warmup + FLAGS.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * steps, features)).astype("float32")
    y = rng.integers(0, classes, size=len(x)).astype("int32")
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                 global_batch)
    logdir = os.path.join(FLAGS.logdir, f"worker{rank}")
    layers = [v.path for v in model.trainable_variables]

    class Profile(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == FLAGS.warmup:
                print(f"worker {rank}: profiling steps {batch}..{steps - 1}", flush=True)
                tf.profiler.experimental.start(logdir)

    # Only the chief's trace is read, so only the chief profiles. It stops once fit has
    # returned: stopping from a step's callback, with the input pipeline's threads still
    # running, once aborted a worker inside TensorFlow's profiler ("double free or corruption"
    # in profiler_v2.stop, a CI run of 2026-11-27).
    model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[Profile()] if rank == 0 else [])
    if rank == 0:
        tf.profiler.experimental.stop()
        print(f"worker {rank}: trace written under {logdir}", flush=True)
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, "variables.json"), "w") as f:
        json.dump({"variables": layers,
                   "sizes": [int(np.prod(v.shape)) for v in model.trainable_variables]}, f)


# --- Reading the trace ---------------------------------------------------------------------

def load_xspace(path):
    """The XSpace protocol buffer of one ``.xplane.pb``."""
    sys.path.insert(0, ROOT)
    from tfdp import _tf_private

    space = _tf_private.xspace_proto()()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def host_events(space):
    """Every event of the host plane: ``(name, start_ps, end_ps, thread, stats)``, by start."""
    events = []
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for e in line.events:
                start = base + e.offset_ps
                stats = {}
                for s in e.stats:
                    which = s.WhichOneof("value")
                    value = getattr(s, which) if which else None
                    if which == "ref_value":
                        value = stat_names.get(value, value)
                    stats[stat_names.get(s.metadata_id, s.metadata_id)] = value
                events.append((names.get(e.metadata_id, ""), start, start + e.duration_ps,
                               line.name, stats))
    events.sort(key=lambda e: e[1])
    return events


# --- The job -------------------------------------------------------------------------------

def run_job(logdir, launch_order):
    """Runs the 2-worker job writing its traces under ``logdir``; returns the chief's
    ``.xplane.pb`` and its variables' names and sizes."""
    env = dict(harness.child_env(), PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    cmd = harness.command(__file__, "--worker",
                          *harness.forward(FLAGS, "model", "batch", "warmup", "steps", "pin"),
                          f"--logdir={logdir}", f"--launch_order={launch_order}",
                          *harness.forward(FLAGS, "bucket_bytes", "interop"),
                          workers=2, launcher=["--timeout", str(FLAGS.timeout)])
    print(f"profile_step: 2 workers, {FLAGS.model}, launch order {launch_order} ...", flush=True)
    proc = harness.run(cmd, env=env, timeout=FLAGS.timeout + 60)
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.lstrip("[]0-9 ").startswith("worker "):
            print("  " + line.strip(), flush=True)
    traces = glob.glob(os.path.join(logdir, "worker0", "plugins", "profile", "*", "*.xplane.pb"))
    if proc.returncode != 0 or not traces:
        raise RuntimeError(f"the job failed (exit {proc.returncode}):\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    with open(os.path.join(logdir, "worker0", "variables.json")) as f:
        return traces[0], json.load(f)


# --- What one step did --------------------------------------------------------------------

STEP_FUNCTION = "__inference_multi_step_on_iterator"  # Keras's train function, one per step
BACKWARD = "gradient_tape/"  # Keras's tape.gradient names every backward op under it
BUCKET = re.compile(r"tfdp_bucket_(\d+)/")  # collectives.py names each bucket's collective


def _overlap(intervals, window):
    """Length of the union of ``intervals`` inside ``window`` (all (start, end))."""
    lo, hi = window
    total, reach = 0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def analyse(events, steps=None):
    """Per profiled step of one worker's events (``host_events``): a dict with, in
    milliseconds from the step's start, ``step``, ``backward_start``/``backward_end``, the
    collectives (``ready``: its kernel was called, its inputs present; ``start``/``end``:
    the collective ran; ``bucket``: tfdp's bucket index, 0 = the last layers'; in launch
    order), ``exchange`` (their busy time), ``hidden`` (the share of it inside backward)."""
    calls = [e for e in events if STEP_FUNCTION in e[0] and e[0].startswith("EagerLocalExecute")]
    if steps:
        calls = calls[-steps:]
    out = []
    for _, s0, s1, _, _ in calls:
        inside = [e for e in events if s0 <= e[1] <= s1]
        backward = [e for e in inside if BACKWARD in e[0] and ":" in e[0]]
        ready = {}
        for name, a, b, thread, stats in inside:
            if name == "CollectiveOpV2Kernel::Run" and stats.get("name"):
                ready.setdefault(stats["name"], a)
        collectives = []
        for name, a, b, thread, stats in inside:
            op, _, kind = name.rpartition(":")
            if not (kind.startswith("Collective") and kind.endswith("V2")):
                continue
            bucket = BUCKET.search(op)
            collectives.append({"op": op, "kind": kind,
                                "bucket": int(bucket.group(1)) if bucket else None,
                                "ready": (ready.get(op, a) - s0) / 1e9,
                                "start": (a - s0) / 1e9, "end": (b - s0) / 1e9})
        collectives.sort(key=lambda c: c["start"])
        bw = ((min(e[1] for e in backward) - s0) / 1e9,
              (max(e[2] for e in backward) - s0) / 1e9) if backward else (0.0, 0.0)
        spans = [(c["start"], c["end"]) for c in collectives]
        busy = _overlap(spans, (0.0, (s1 - s0) / 1e9))
        hidden = _overlap(spans, bw) / busy if busy else 0.0
        out.append({"step": (s1 - s0) / 1e9, "backward_start": bw[0], "backward_end": bw[1],
                    "collectives": collectives, "exchange": busy, "hidden": hidden,
                    "compute_ops": [((e[1] - s0) / 1e9, (e[2] - s0) / 1e9, BACKWARD in e[0])
                                    for e in inside
                                    if e[3].startswith("tf_Compute") and ":" in e[0]
                                    and not e[0].startswith(("ExecutorState", "Threadpool"))]})
    return out


def describe(steps, order):
    lines = [f"launch order {order}:"]
    for i, st in enumerate(steps):
        lines.append(f"  step {i}: {st['step']:.1f} ms; backward {st['backward_start']:.1f}"
                     f"..{st['backward_end']:.1f} ms; exchange busy {st['exchange']:.1f} ms, "
                     f"{100 * st['hidden']:.0f}% of it hidden behind backward")
        for c in st["collectives"]:
            which = ("" if c["bucket"] is None else
                     f"bucket {c['bucket']}" + (" (last layers)" if c["bucket"] == 0 else ""))
            lines.append(f"    {c['kind']:<20} {which:<22} ready {c['ready']:7.1f}  "
                         f"start {c['start']:7.1f}  end {c['end']:7.1f}"
                         + ("   <- before backward ends" if c["start"] < st["backward_end"]
                            else ""))
    return "\n".join(lines)


def plot(runs, path):
    """One step of each run (``{order: step}``) as a timeline: compute ops above, the
    gradient collectives below, backward's end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), sharex=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (order, st) in zip(axes, runs.items()):
        fwd = [(a, b - a) for a, b, back in st["compute_ops"] if not back]
        bwd = [(a, b - a) for a, b, back in st["compute_ops"] if back]
        ax.broken_barh(fwd, (10, 8), color="#9ecae1", label="forward / update ops")
        ax.broken_barh(bwd, (10, 8), color="#3182bd", label="backward ops")
        for c in st["collectives"]:
            ax.broken_barh([(c["start"], c["end"] - c["start"])], (0, 8), color="#e6550d",
                           edgecolor="white")
            if c["bucket"] is not None:
                ax.text((c["start"] + c["end"]) / 2, 4, f"b{c['bucket']}", ha="center",
                        va="center", fontsize=7, color="white")
        ax.axvline(st["backward_end"], color="k", linestyle="--", linewidth=1)
        ax.set_yticks([4, 14], ["collectives", "compute"])
        ax.set_title(f"{order}: step {st['step']:.0f} ms, exchange {st['exchange']:.0f} ms, "
                     f"{100 * st['hidden']:.0f}% hidden behind backward (dashed: its end)",
                     fontsize=9)
    axes[-1].set_xlabel("ms from the step's start (chief)")
    axes[0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv):
    del argv
    if FLAGS.worker:
        worker()
        return
    logdir = FLAGS.logdir or tempfile.mkdtemp(prefix="profile-step-")
    orders = [FLAGS.launch_order]
    if FLAGS.plot:
        orders = ["first_layers_first", "last_layers_first"]
    chosen = {}
    for order in orders:
        trace, _ = run_job(os.path.join(logdir, order), order)
        print(f"trace (TensorBoard: tensorboard --logdir {os.path.join(logdir, order)}): {trace}")
        steps = analyse(host_events(load_xspace(trace)), FLAGS.steps)
        print(describe(steps, order), flush=True)
        if FLAGS.json:
            print("JSON " + json.dumps({"order": order, "steps": [
                {k: v for k, v in st.items() if k != "compute_ops"} for st in steps]}))
        # The step shown: the median step by duration.
        chosen[order] = sorted(steps, key=lambda st: st["step"])[len(steps) // 2]
    if FLAGS.plot:
        plot(chosen, FLAGS.plot)


if __name__ == "__main__":
    app.run(main)
