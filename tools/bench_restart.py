"""What a restart costs, from the SIGKILL to the next finished step, cold and warm (issue 59).

For each model (a KerasHub GPT-2 from config: 2 blocks, width 64, sequence 32, vocabulary
1024; and the README's ConvNet on the 8x8 digits), a 2-worker job runs under
``tfdp-run --workers 2 --cpu-replicas 1 --max-restarts 1 --compile-cache DIR`` with
``jit_compile=True`` and ``tfdp.callbacks.BackupAndRestore(save_freq=--save_freq)``. Worker 1
writes a file once the backup of step ``save_freq`` exists (step ``--kill_at``) and waits; the
tool SIGKILLs it on that file. tfdp-run restarts both workers; each logs timestamps
(``time.time()``) of its phases, and TensorFlow's own XLA timers (``TF_CPP_VMODULE``:
``device_compiler``, ``device_executable_persistor``) go to a log file per worker and attempt:

    kill -> process start    tfdp-run sees the exit, stops the survivor, starts new workers
    start -> imports         Python, tensorflow, keras, tfdp, keras_hub / the example's module
    imports -> cluster       tfdp.DataParallelStrategy() (cluster, coordination service)
    cluster -> built         model built and compiled, data distributed
    built -> restored        fit up to the end of BackupAndRestore.on_train_begin (restore)
    restored -> first step   trace + XLA (TF graph -> HLO, then compile or cache load) + run

``cold``: the restarted workers find an empty cache (each attempt gets a directory of its own);
``warm``: they find the first attempt's entries. Rounds interleave cold and warm.

    python tools/bench_restart.py   # ~11 min (shared 2-core host): docs/benchmarks/bench_restart.*

The parsing and aggregation functions (``parse_xla_log``, ``phases_of``, ``summarize``,
``verdict``) are pure and unit-tested (tests/test_tools_and_examples.py).
"""

from __future__ import annotations

import time

_T_TOP = time.time()  # the child's first moment in Python (before absl and everything else)

import json  # noqa: E402 (after the clock)
import os  # noqa: E402 (after the clock)
import re  # noqa: E402 (after the clock)
import signal  # noqa: E402 (after the clock)
import statistics  # noqa: E402 (after the clock)
import subprocess  # noqa: E402 (after the clock)
import sys  # noqa: E402 (after the clock)
import tempfile  # noqa: E402 (after the clock)
import threading  # noqa: E402 (after the clock)

from absl import app, flags  # noqa: E402 (after the clock)

import harness  # noqa: E402 (after the clock)
from harness import ROOT  # noqa: E402 (after the clock)

FLAGS = flags.FLAGS


def define_flags():
    """The tool's flags, defined when it runs (not at import: tests import its pure parts
    beside other tools that define flags of the same names)."""
    flags.DEFINE_list("models", ["gpt2", "convnet"], "Models: gpt2, convnet.")
    flags.DEFINE_list("modes", ["cold", "warm"], "cold: the restart finds an empty cache; warm: "
                      "the first attempt's entries.")
    harness.define_flags(
        rounds=(2, "Rounds (each runs every model cold and warm, interleaved)."),
        steps=(20, "Training steps of the job (one epoch)."), out="docs/benchmarks/bench_restart",
        child="the model this worker trains.",
        backup_dir=("", "Internal: BackupAndRestore's directory."))
    flags.DEFINE_integer("save_freq", 4, "BackupAndRestore(save_freq=...) in steps.")
    flags.DEFINE_integer("kill_at", 6, "Worker 1 is SIGKILLed after this step of the first attempt.")
    flags.DEFINE_float("target", 0.2, "Warm compile time / cold compile time to meet.")
    flags.DEFINE_string("child_out", "", "Internal: where the worker writes its records.")
    flags.DEFINE_boolean("cold_restart", False, "Internal: each attempt gets its own empty cache.")


MODES = ("cold", "warm")
# Phases of the restarted attempt, in order (stacked bottom to top in the plot).
PHASES = ("relaunch", "interpreter", "imports", "cluster", "build", "restore",
          "trace_run", "tf2xla", "xla_compile_or_load")
PHASE_LABELS = {
    "relaunch": "kill -> new process (tfdp-run)",
    "interpreter": "Python start",
    "imports": "imports",
    "cluster": "strategy / cluster",
    "build": "model build + data",
    "restore": "fit start + restore",
    "trace_run": "first step: trace + run + rest",
    "tf2xla": "first step: TF graph -> HLO",
    "xla_compile_or_load": "first step: XLA compile / load",
}
GPT2 = dict(vocabulary_size=1024, num_layers=2, num_heads=2, hidden_dim=64,
            intermediate_dim=256, max_sequence_length=32)
GLOBAL_BATCH = {"gpt2": 16, "convnet": 64}
TIMEOUT = 400  # seconds for one job


# --- pure: parsing and aggregation -----------------------------------------------------------

_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:(\d+\.\d+)\s+\d+ (\S+):\d+\] (.*)$")
_TIME = re.compile(r"time: [^(]*\((\d+) us\)")


def parse_xla_log(text: str) -> list[dict]:
    """The XLA compilations in a worker's C++ log (``TF_CPP_VMODULE=device_compiler=2,
    device_executable_persistor=2``; TensorFlow's records carry Unix seconds): one dict per
    ``Compilation of XLA executable`` with ``end`` (Unix s), ``seconds`` (TensorFlow's timer:
    TF graph -> HLO, then build or load, then persist), ``tf2xla`` (seconds from ``Instantly
    compiling`` to the start of the cache lookup; None without a persistent cache),
    ``loaded`` (the executable came from the persistent cache) and ``signature``."""
    found = []
    current = None
    for line in text.splitlines():
        m = _RECORD.match(line)
        if not m:
            continue
        stamp, message = float(m.group(1)), m.group(3)
        if message.startswith("Instantly compiling for signature: "):
            current = {"signature": message.split(": ", 1)[1].strip(), "start": stamp,
                       "lookup": None, "loaded": False}
        elif current is None:
            continue
        elif message.startswith("Try loading serialized cache entry"):
            t = _TIME.search(message)
            current["lookup"] = stamp - (int(t.group(1)) / 1e6 if t else 0.0)
        elif message.startswith("Loading cached entry for"):
            current["loaded"] = True
        elif message.startswith("Compilation of XLA executable time"):
            t = _TIME.search(message)
            seconds = int(t.group(1)) / 1e6 if t else stamp - current["start"]
            tf2xla = None if current["lookup"] is None else current["lookup"] - current["start"]
            found.append({"signature": current["signature"], "end": stamp, "seconds": seconds,
                          "tf2xla": tf2xla, "loaded": current["loaded"]})
            current = None
    return found


def steady_step(step_times: list[float]) -> float:
    """The median interval between consecutive step ends, leaving out the first two steps
    (the first compiles, the second still warms caches)."""
    gaps = [b - a for a, b in zip(step_times[1:], step_times[2:])]
    return statistics.median(gaps) if gaps else float("nan")


def phases_of(events: dict, compiles: list[dict], kill: float | None) -> dict:
    """Seconds per phase of one worker's attempt (see PHASES) from its ``events`` (Unix s:
    proc_start, top, imports, cluster, built, restored, steps = [step end, ...]), the
    ``compiles`` of its log (parse_xla_log) and the ``kill`` time (None: a first attempt).
    The first step is split as: XLA compilations that ended inside it (tf2xla part and the
    rest), and everything else (tracing, the run, the input's first batch). Also:
    ``first_step`` (restored -> first step end), ``steady_step``, ``compile`` (TensorFlow's
    compile timers, all of the first step's clusters), ``first_minus_steady`` and ``total``
    (kill, or process start, -> first step end), ``loaded`` (every cluster came from the
    cache)."""
    first = events["steps"][0]
    inside = [c for c in compiles if events["restored"] <= c["end"] <= first]
    compile_s = sum(c["seconds"] for c in inside)
    tf2xla = sum(c["tf2xla"] or 0.0 for c in inside)
    first_step = first - events["restored"]
    steady = steady_step(events["steps"])
    out = {
        "relaunch": (events["proc_start"] - kill) if kill is not None else 0.0,
        "interpreter": events["top"] - events["proc_start"],
        "imports": events["imports"] - events["top"],
        "cluster": events["cluster"] - events["imports"],
        "build": events["built"] - events["cluster"],
        "restore": events["restored"] - events["built"],
        "trace_run": first_step - compile_s,
        "tf2xla": tf2xla,
        "xla_compile_or_load": compile_s - tf2xla,
        "first_step": first_step,
        "steady_step": steady,
        "compile": compile_s,
        "first_minus_steady": first_step - steady,
        "clusters": len(inside),
        "loaded": bool(inside) and all(c["loaded"] for c in inside),
        "import_tfdp": events["imported_tfdp"] - events["top"],
        "import_tensorflow": events["imported_tensorflow"] - events["imported_tfdp"],
        "import_keras": events["imported_keras"] - events["imported_tensorflow"],
        "import_model_module": events["imports"] - events["imported_keras"],
        "total": first - (kill if kill is not None else events["proc_start"]),
    }
    return out


def summarize(rows: list[dict]) -> dict:
    """{(model, mode): {key: median over rounds and workers}} for the numeric keys of
    ``rows`` (one row per model, mode, round, worker)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["model"], row["mode"]), []).append(row)
    table = {}
    for key, group in groups.items():
        numeric = [k for k, v in group[0].items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k not in ("round", "worker")]
        table[key] = {k: statistics.median(r[k] for r in group) for k in numeric}
        table[key]["n"] = len(group)
        table[key]["all_loaded"] = all(r.get("loaded") for r in group)
    return table


def verdict(warm: float, cold: float, target: float) -> tuple[float, bool, str]:
    """(warm / cold, met, sentence) for the compile-time target (warm at most ``target`` of
    cold)."""
    ratio = warm / cold if cold > 0 else float("inf")
    met = ratio <= target
    gap = ratio - target
    said = (f"{ratio:.1%} of cold: met ({-gap:.1%} under the {target:.0%} target)" if met else
            f"{ratio:.1%} of cold: missed by {gap:.1%} (target {target:.0%})")
    return ratio, met, said


# --- the worker ---------------------------------------------------------------------------------

def _process_start() -> float:
    """This process's start time (Unix s) from /proc (10 ms resolution)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def child():
    slot = int(os.environ.get("TFDP_SLOT", "0"))
    attempt = int(os.environ.get("TFDP_ATTEMPT", "0"))
    out = FLAGS.child_out
    tag = f"slot{slot}-attempt{attempt}"
    events = {"proc_start": _process_start(), "top": _T_TOP}
    # TensorFlow's C++ log (XLA's own timers) to a file of this worker and attempt.
    log = os.open(os.path.join(out, f"cpp-{tag}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "device_compiler=2,device_executable_persistor=2"
    if FLAGS.cold_restart:  # a directory per attempt: the restart finds no entries
        os.environ["TFDP_COMPILE_CACHE"] = os.path.join(os.environ["TFDP_COMPILE_CACHE"],
                                                        f"attempt{attempt}")
    # tfdp first: it sets TF_XLA_FLAGS (the cache). Under absl's app.run, TensorFlow imported
    # before tfdp has already read them and the cache stays off (measured; see the report).
    import tfdp
    events["imported_tfdp"] = time.time()
    import numpy as np
    import tensorflow as tf
    events["imported_tensorflow"] = time.time()
    import keras
    events["imported_keras"] = time.time()
    if FLAGS.child == "gpt2":
        import keras_hub
    else:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import common  # the example's module: sklearn's digits and the ConvNet
    events["imports"] = time.time()
    events["cache"] = os.environ.get("TF_XLA_FLAGS", "")

    strategy = tfdp.DataParallelStrategy()
    events["cluster"] = time.time()

    rng = np.random.default_rng(0)
    batch = GLOBAL_BATCH[FLAGS.child]
    n = batch * FLAGS.steps
    keras.utils.set_random_seed(7)
    with strategy.scope():
        if FLAGS.child == "gpt2":
            seq = GPT2["max_sequence_length"]
            tokens = rng.integers(1, GPT2["vocabulary_size"], size=(n, seq + 1)).astype("int32")
            source = tf.data.Dataset.from_tensor_slices(
                ({"token_ids": tokens[:, :seq], "padding_mask": np.ones((n, seq), bool)},
                 tokens[:, 1:]))
            backbone = keras_hub.models.GPT2Backbone(**GPT2)
            model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
            model.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                          jit_compile=True)
        else:
            (x, y), _ = common.load_digits(image=True)
            idx = rng.integers(0, len(x), size=n)
            source = tf.data.Dataset.from_tensor_slices((x[idx], y[idx]))
            model = common.build_model(keras)
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=True)
    if FLAGS.child == "gpt2":
        # KerasHub's task fit takes a tf.data.Dataset, not a distributed one: tfdp distributes
        # it (and a restart resumes at the backup's epoch, not its step).
        train, position = source.batch(batch, drop_remainder=True), None
    else:
        train = position = tfdp.data.distribute(strategy, source, batch)
    backup = tfdp.callbacks.BackupAndRestore(FLAGS.backup_dir, save_freq=FLAGS.save_freq,
                                             dataset=position)
    events["built"] = time.time()
    events["steps"] = []

    def record():
        with open(os.path.join(out, f"times-{tag}.json.tmp"), "w") as f:
            json.dump(events, f)
        os.replace(os.path.join(out, f"times-{tag}.json.tmp"),
                   os.path.join(out, f"times-{tag}.json"))

    class Times(keras.callbacks.Callback):
        """After BackupAndRestore: its on_train_begin (the restore) has run; its backup of a
        step is written when this callback sees the step."""

        def on_train_begin(self, logs=None):
            events["restored"] = time.time()

        def on_train_batch_begin(self, batch, logs=None):
            if "uid_at_first_batch" not in events:  # the traced names (XLA's cache keys) to come
                from tensorflow.python.framework import ops
                events["uid_at_first_batch"] = ops.uid()

        def on_train_batch_end(self, batch, logs=None):
            events["steps"].append(time.time())
            if len(events["steps"]) == 1:
                record()
                print(f"FIRST_STEP slot {slot} attempt {attempt}", flush=True)
            iteration = int(self.model.optimizer.iterations.numpy())
            if attempt == 0 and slot == 1 and iteration == FLAGS.kill_at:
                record()
                ready = os.path.join(out, "kill-me")
                with open(ready + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(ready + ".tmp", ready)
                waited = threading.Event()
                # The tool SIGKILLs this process on the file; nothing else ends this wait.
                if not waited.wait(120):
                    os._exit(3)

    model.fit(train, epochs=1, verbose=0, callbacks=[backup, Times()])
    record()


# --- the driver ---------------------------------------------------------------------------------

def _wait_for(path, proc, deadline):
    """Until ``path`` exists (the worker's own signal), the job ends, or the deadline."""
    ended = threading.Event()
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > deadline:
            return False
        ended.wait(0.02)
    return True


def run_job(model, mode, tmp):
    out, cache, backup = (os.path.join(tmp, d) for d in ("out", "cache", "backup"))
    os.makedirs(out)
    cmd = harness.command(__file__, f"--child={model}", f"--child_out={out}",
                          f"--backup_dir={backup}", f"--cold_restart={mode == 'cold'}",
                          workers=2, cpu_replicas=1,
                          launcher=["--max-restarts", "1", "--compile-cache", cache])
    proc = subprocess.Popen(cmd, env=harness.child_env(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not _wait_for(os.path.join(out, "kill-me"), proc, time.time() + TIMEOUT):
            raise RuntimeError("no kill signal from worker 1:\n" + "".join(ln for _, ln in lines[-40:]))
        with open(os.path.join(out, "kill-me")) as f:
            pid = int(f.read())
        kill = time.time()
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    text = "".join(line for _, line in lines)
    if code != 0:
        raise RuntimeError(f"job exited {code}:\n{text[-4000:]}")
    seen = {}
    for stamp, line in lines:
        if "stopping the other workers" in line and "death_seen" not in seen:
            seen["death_seen"] = stamp - kill
        if "restart 1/1" in line and "restart_seen" not in seen:
            seen["restart_seen"] = stamp - kill
        if "FIRST_STEP" in line and "attempt 1" in line and "first_step_seen" not in seen:
            seen["first_step_seen"] = stamp - kill
    results = []
    for attempt in (0, 1):
        for slot in (0, 1):
            tag = f"slot{slot}-attempt{attempt}"
            with open(os.path.join(out, f"times-{tag}.json")) as f:
                events = json.load(f)
            with open(os.path.join(out, f"cpp-{tag}.log"), errors="replace") as f:
                compiles = parse_xla_log(f.read())
            if attempt == 0 and slot == 1:
                events["steps"] = events["steps"] or [float("nan")]
            row = phases_of(events, compiles, kill if attempt == 1 else None)
            row.update(attempt=attempt, worker=slot, **(seen if attempt == 1 else {}))
            results.append(row)
    return results, text


def _r(v):
    return round(v, 4) if isinstance(v, float) else v


def measure():
    rows, firsts = [], []
    for r in range(FLAGS.rounds):
        # Interleaved; the order of the modes alternates between rounds.
        modes = FLAGS.modes if r % 2 == 0 else list(reversed(FLAGS.modes))
        for model in FLAGS.models:
            for mode in modes:
                started = time.time()
                with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
                    results, _ = run_job(model, mode, tmp)
                for row in results:
                    base = {"model": model, "mode": mode, "round": r + 1}
                    full = dict(base, **{k: _r(v) for k, v in row.items()})
                    (rows if row["attempt"] == 1 else firsts).append(full)
                restarted = [x for x in results if x["attempt"] == 1]
                print(f"round {r + 1}/{FLAGS.rounds} {model:8s} {mode}: kill -> first step "
                      + ", ".join(f"w{x['worker']} {x['total']:.2f} s (compile {x['compile']:.2f} s,"
                                  f" {'loaded' if x['loaded'] else 'compiled'})" for x in restarted)
                      + f"; job {time.time() - started:.0f} s", flush=True)
    return rows, firsts


def write_report(rows, firsts):
    table = summarize(rows)
    first = summarize(firsts)
    models = [m for m in FLAGS.models if (m, "cold") in table]
    lines = [
        "# What a restart costs: SIGKILL to the next finished step, cold and warm XLA cache",
        "",
        "2 workers on 127.0.0.1 (`tfdp-run --workers 2 --cpu-replicas 1 --max-restarts 1 "
        "--compile-cache DIR`), `jit_compile=True`, `tfdp.callbacks.BackupAndRestore("
        f"save_freq={FLAGS.save_freq})`; worker 1 SIGKILLed after step {FLAGS.kill_at} of "
        f"{FLAGS.steps} (the backup of step {FLAGS.save_freq} written), tfdp-run restarts both. "
        "GPT-2: `keras_hub.models.GPT2CausalLM` from config (2 blocks, width 64, 2 heads, "
        "MLP 256, sequence 32, vocabulary 1024; AdamW; global batch 16). ConvNet: the README's "
        "(examples/common.py, 8x8 digits; Adam; global batch 64). **cold**: the restarted "
        "workers' cache directory is empty; **warm**: it holds the first attempt's entries. "
        f"Median over {FLAGS.rounds} interleaved rounds x 2 workers (seconds), 2-core host "
        "shared with other jobs. Command: `python tools/bench_restart.py`.",
        "",
        "| phase (s) | " + " | ".join(f"{m} {mode}" for m in models for mode in MODES) + " |",
        "|---|" + "---|" * (2 * len(models)),
    ]
    for key in PHASES + ("total",):
        label = PHASE_LABELS.get(key, "**kill -> first step end** (median of the totals)")
        lines.append(f"| {label} | " + " | ".join(
            f"{table[(m, mode)][key]:.2f}" for m in models for mode in MODES) + " |")
    lines += [
        "| *first step (restored -> end)* | " + " | ".join(
            f"{table[(m, mode)]['first_step']:.2f}" for m in models for mode in MODES) + " |",
        "| *steady step* | " + " | ".join(
            f"{table[(m, mode)]['steady_step']:.3f}" for m in models for mode in MODES) + " |",
        "| *first step - steady step* | " + " | ".join(
            f"{table[(m, mode)]['first_minus_steady']:.2f}" for m in models for mode in MODES) + " |",
        "| *XLA compile, TF's timer (graph -> HLO + compile/load)* | " + " | ".join(
            f"{table[(m, mode)]['compile']:.2f}" for m in models for mode in MODES) + " |",
        "| *imports: tfdp / tensorflow / keras / keras_hub or the example's module* | " + " | ".join(
            "{import_tfdp:.2f} / {import_tensorflow:.2f} / {import_keras:.2f} / "
            "{import_model_module:.2f}".format(**table[(m, mode)]) for m in models
            for mode in MODES) + " |",
        "| *tfdp-run: kill -> death seen (survivor told to stop)* | " + " | ".join(
            f"{table[(m, mode)].get('death_seen', float('nan')):.2f}" for m in models
            for mode in MODES) + " |",
        "| *tfdp-run: kill -> restart logged* | " + " | ".join(
            f"{table[(m, mode)].get('restart_seen', float('nan')):.2f}" for m in models
            for mode in MODES) + " |",
        "| *tfdp-run: kill -> restarted chief's first step relayed* | " + " | ".join(
            f"{table[(m, mode)].get('first_step_seen', float('nan')):.2f}" for m in models
            for mode in MODES) + " |",
        "| *every cluster loaded from the cache* | " + " | ".join(
            "yes" if table[(m, mode)]["all_loaded"] else "no" for m in models
            for mode in MODES) + " |",
        "",
        f"## The target: warm compilation at most {FLAGS.target:.0%} of cold",
        "",
        "| model | compile cold (s) | compile warm (s) | warm / cold | of which graph -> HLO warm (s)"
        " | XLA compile vs load only | rest of the restart warm (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for m in models:
        cold, warm = table[(m, "cold")], table[(m, "warm")]
        ratio, met, said = verdict(warm["compile"], cold["compile"], FLAGS.target)
        backend = verdict(warm["xla_compile_or_load"], cold["xla_compile_or_load"], FLAGS.target)
        verdicts.append((m, said, backend[2]))
        lines.append(f"| {m} | {cold['compile']:.2f} | {warm['compile']:.2f} | **{ratio:.1%}** "
                     f"({'met' if met else 'missed'}) | {warm['tf2xla']:.2f} | "
                     f"{cold['xla_compile_or_load']:.2f} -> {warm['xla_compile_or_load']:.2f} "
                     f"({backend[0]:.1%}) | {warm['total'] - warm['compile']:.2f} |")
    lines += [""] + [f"- {m}: compilation (TensorFlow's timer) {said}; XLA's own compile vs "
                     f"cache load (graph -> HLO left out): {backend}." for m, said, backend in verdicts]
    lines += ["", "First attempt of the same jobs (a cold start, process start -> first step end, "
              "median s): " + "; ".join(
                  f"{m} {first[(m, mode)]['total']:.2f} (compile {first[(m, mode)]['compile']:.2f})"
                  for m in models for mode in MODES if (m, mode) in first), ""]
    text = "\n".join(lines)
    print(text)
    if not FLAGS.out:
        return
    harness.write_report(FLAGS.out, text, rows + firsts,
                         lambda ax: plot(ax, table, [(m, mode) for m in models for mode in MODES]),
                         figsize=(8, 4.2))


def plot(ax, table, bars):
    """The restart's phases stacked per (model, mode)."""
    bottom = [0.0] * len(bars)
    colors = harness.pyplot().get_cmap("tab10").colors
    for i, key in enumerate(PHASES):
        values = [max(table[b][key], 0.0) for b in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, label=PHASE_LABELS[key],
               color=colors[i % len(colors)], hatch="//" if key == "xla_compile_or_load" else None)
        bottom = [a + b for a, b in zip(bottom, values)]
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([f"{m}\n{mode}" for m, mode in bars])
    harness.label_axes(ax, None, "seconds from SIGKILL (median)",
                       "Restart: SIGKILL -> next finished step, 2 workers, jit_compile=True (CPU)",
                       legend={"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.0, 1.0)})


def main(argv):
    del argv
    if FLAGS.child:
        child()
        return
    started = time.time()
    rows, firsts = measure()
    write_report(rows, firsts)
    print(f"total {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
