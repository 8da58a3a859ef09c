"""A straggler's cost and the recovery: steps/s over time, with and without eviction.

Three workers on 127.0.0.1 (tfdp-run, 1 logical CPU replica each) train a small MLP whose
forward pass takes well under a millisecond (``--compute_ms`` adds work per step; default none).
After ``--slow_after`` steps, this tool slows worker 2 from outside with a SIGSTOP/SIGCONT duty
cycle (``--stop_ms`` stopped, ``--run_ms`` running), as a throttled or oversubscribed host
would be: its lost time falls anywhere (Python between steps, the input pipeline, the step).
``tfdp.callbacks.StragglerMonitor`` names it; in the ``evict`` run (tfdp-run ``--min-workers 2
--max-restarts 1``) the job backs up, restarts without it and continues on two workers. The
report shows the monitor's split of each worker's step (own time: in the step, input, host;
waiting for the others) in the first window after the slow-down.

    python tools/straggler_demo.py          # ~2 min; writes docs/benchmarks/straggler.{md,png,csv}
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time

from absl import app, flags

import harness
from harness import ROOT

FLAGS = flags.FLAGS
harness.define_flags(steps=(240, "Training steps of the job."), out="docs/benchmarks/straggler",
                     child="run as a worker writing to this directory.")
flags.DEFINE_integer("slow_after", 40, "Step after which worker 2 is slowed.")
flags.DEFINE_float("compute_ms", 0.0, "Work added to the forward pass per step (ms).")
flags.DEFINE_float("stop_ms", 150.0, "SIGSTOP phase of the duty cycle (ms).")
flags.DEFINE_float("run_ms", 50.0, "SIGCONT phase of the duty cycle (ms).")
flags.DEFINE_integer("window", 10, "StragglerMonitor window (steps).")
flags.DEFINE_boolean("evict", False, "Internal: StragglerMonitor(evict=True) in the worker.")

GLOBAL_BATCH = 24
EXAMPLES = 240  # 10 steps per epoch


def child():
    import numpy as np
    import keras
    import tensorflow as tf
    import tfdp

    out = FLAGS.child
    slot = int(os.environ.get("TFDP_SLOT", "0"))
    with open(os.path.join(out, f"pid-{slot}"), "w") as f:
        f.write(str(os.getpid()))
    strategy = tfdp.DataParallelStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 32)).astype("float32")
    y = rng.integers(0, 4, size=EXAMPLES).astype("int32")
    work_s = FLAGS.compute_ms / 1000.0

    def spin(_):
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        return 0.0

    def heavy(t):
        done = tf.py_function(spin, [t], tf.float32)
        with tf.control_dependencies([done]):
            return tf.identity(t)

    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Lambda(heavy),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH)

    stamps = open(os.path.join(out, f"steps-{slot}.txt"), "a")

    def stamp(batch, logs=None):
        it = int(model.optimizer.iterations.numpy())
        stamps.write(f"{os.environ.get('TFDP_ATTEMPT', '0')} {it} {time.time():.4f}\n")
        stamps.flush()  # the parent polls this file to know when to slow worker 2

    monitor = tfdp.callbacks.StragglerMonitor(window=FLAGS.window, evict=FLAGS.evict)
    callbacks = [keras.callbacks.LambdaCallback(on_train_batch_end=stamp), tfdp.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=10,
                                                           dataset=train), monitor]
    model.fit(train, epochs=FLAGS.steps // (EXAMPLES // GLOBAL_BATCH), verbose=0, callbacks=callbacks)
    if strategy.cluster.is_chief:
        with open(os.path.join(out, f"monitor-{os.environ.get('TFDP_ATTEMPT', '0')}.json"), "w") as f:
            json.dump(monitor.history, f)


class DutyCycle(threading.Thread):
    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid = pid
        self.done = threading.Event()

    def run(self):
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(FLAGS.stop_ms / 1000)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(FLAGS.run_ms / 1000)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def read_steps(path):
    with open(path) as f:
        return [(int(a), int(i), float(t)) for a, i, t in (ln.split() for ln in f if ln.strip())]


def run_job(evict):
    tmp = tempfile.mkdtemp(prefix="tfdp-straggler-")
    extra = ["--max-restarts", "1", "--min-workers", "2"] if evict else []
    cmd = harness.command(__file__, f"--child={tmp}", f"--evict={evict}",
                          *harness.forward(FLAGS, "compute_ms", "window", "steps"),
                          workers=3, cpu_replicas=1, launcher=extra)
    proc = subprocess.Popen(cmd, env=harness.child_env(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, slow, slowed_at = [], None, None
    steps_file = os.path.join(tmp, "steps-0.txt")

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "straggler" in line or "restart" in line or "dropped" in line:
                print("  " + line.rstrip(), flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while proc.poll() is None and slow is None:
        if os.path.exists(steps_file) and len(read_steps(steps_file)) >= FLAGS.slow_after:
            with open(os.path.join(tmp, "pid-2")) as f:
                slow = DutyCycle(int(f.read()))
            slowed_at = time.time()
            slow.start()
            print(f"  slowing worker 2 from step {FLAGS.slow_after}", flush=True)
        else:
            time.sleep(0.05)  # polling the job's progress file
    code = proc.wait(timeout=1200)
    if slow is not None:
        slow.done.set()
        slow.join()
    reader.join(timeout=5)
    if code != 0:
        raise RuntimeError(f"job failed ({code}):\n" + "".join(lines[-40:]))
    history_file = os.path.join(tmp, "monitor-0.json")
    history = json.load(open(history_file)) if os.path.exists(history_file) else []
    return read_steps(steps_file), slowed_at, lines, history


def rate_over_time(records, t0, bin_s=2.0):
    times = [t - t0 for _, _, t in records]
    counts = [0] * (int(max(times) // bin_s) + 1)
    for t in times:
        counts[int(t // bin_s)] += 1  # empty bins stay 0: the restart gap shows
    return [(b * bin_s + bin_s / 2, n / bin_s) for b, n in enumerate(counts)]


def split_table(result):
    """The monitor's split of each worker's step in the first window after the slow-down."""
    first = FLAGS.slow_after + 2 * FLAGS.window
    window = next((h for h in result["history"] if h["step"] >= first), None)
    if window is None:
        return []
    rows = [f"| {r} | {window['compute_ms'][r]:.1f} | {window['step_ms'][r]:.1f} | "
            f"{window['input_ms'][r]:.1f} | {window['host_ms'][r]:.1f} | {window['wait_ms'][r]:.1f} |"
            for r in range(len(window["compute_ms"]))]
    return ["", f"StragglerMonitor's window ending at step {window['step']} (evict=False run), "
            "ms/step per worker: own time (*compute*) = in the step + input + host; waiting "
            "is time in collectives waiting for the others.", "",
            "| rank | compute (own) | in the step | input | host | waiting |", "|---|---|---|---|---|---|",
            *rows, "", "First line the chief logged:", "", "```",
            *(result["named"][:1] or ["(none)"]), "```"]


def main(argv):
    del argv
    if FLAGS.child:
        child()
        return
    results = {}
    for evict in (False, True):
        print(f"job with evict={evict}", flush=True)
        records, slowed_at, lines, history = run_job(evict)
        t0 = records[0][2]
        before = [r for r in records if r[2] < slowed_at]
        slowed = [r for r in records if r[2] >= slowed_at and r[0] == 0]
        after = [r for r in records if r[0] == 1]

        def rate(rs):
            return (len(rs) - 1) / (rs[-1][2] - rs[0][2]) if len(rs) > 2 else float("nan")

        results[evict] = {"records": records, "t0": t0, "slowed_at": slowed_at - t0,
                          "healthy": rate(before), "slowed": rate(slowed), "after": rate(after),
                          "total_s": records[-1][2] - t0, "history": history,
                          "named": [ln.split("tfdp: ", 1)[1].strip() for ln in lines
                                    if "tfdp: straggler: rank" in ln]}
        print(f"  steps/s healthy {rate(before):.1f}, with straggler {rate(slowed):.1f}"
              + (f", after eviction {rate(after):.1f}" if evict else "")
              + f"; job {records[-1][2] - t0:.0f} s", flush=True)
    text = "\n".join([
        "# A straggler's cost and the recovery",
        "",
        f"Three workers (tfdp-run, 1 CPU replica each), a small MLP (forward pass well under 1 ms, "
        f"{FLAGS.compute_ms:g} ms of added work),",
        f"global batch {GLOBAL_BATCH}, {FLAGS.steps} steps. After step {FLAGS.slow_after} worker 2 is slowed",
        f"from outside (SIGSTOP {FLAGS.stop_ms:g} ms / SIGCONT {FLAGS.run_ms:g} ms). "
        f"`StragglerMonitor(window={FLAGS.window})`. Command: `python tools/straggler_demo.py`.",
        "",
        "| run | steps/s healthy | steps/s with straggler | steps/s after eviction | job time (s) |",
        "|---|---|---|---|---|",
        *(f"| {'evict=True (--min-workers 2)' if e else 'evict=False'} | {r['healthy']:.1f} | "
          f"{r['slowed']:.1f} | {r['after']:.1f} | {r['total_s']:.0f} |" if e else
          f"| evict=False | {r['healthy']:.1f} | {r['slowed']:.1f} | - | {r['total_s']:.0f} |"
          for e, r in results.items()),
        "",
        "![steps/s over time](straggler.png)",
        *split_table(results[False]),
    ])
    print(text)
    if FLAGS.out:
        rows = [{"evict": e, "attempt": a, "iteration": i, "seconds": round(t - r["t0"], 4)}
                for e, r in results.items() for a, i, t in r["records"]]
        harness.write_report(FLAGS.out, text, rows, lambda ax: plot(ax, results), figsize=(7, 3.5))


def plot(ax, results):
    for e, r in results.items():
        series = rate_over_time(r["records"], r["t0"])
        ax.plot([s for s, _ in series], [v for _, v in series], marker=".",
                label="evict=True" if e else "evict=False")
        ax.axvline(r["slowed_at"], color="grey", linestyle=":", linewidth=1)
    harness.label_axes(ax, "seconds since the first step", "steps / s (2 s bins)",
                       "Worker 2 slowed (dotted line): cost and recovery by eviction", legend={})


if __name__ == "__main__":
    app.run(main)
