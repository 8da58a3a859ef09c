"""ZeRO-3's headline: a model bigger than what unsharded data parallelism or ZeRO-2 fits trains
with ``shard_parameters=True``, on this host, under the same memory bound.

Each configuration runs in a fresh child process held to ``--memory_limit_gb`` of memory by a
memory cgroup of its own (Linux cgroup v1 ``memory.limit_in_bytes``, as root; the kernel ends
a child that goes over with SIGKILL, so the machine never runs out), or, where no cgroup can
be made, by ``RLIMIT_DATA`` (which counts reserved address space too, and under which an
allocation failure can leave TensorFlow waiting forever: a child whose CPU time stops
advancing for a minute at the limit is ended and reported as out of memory): an MLP
of ``--depth`` Dense layers of ``--width`` units (default 240 x 2048: 1.0 billion parameters),
Adam, ``--steps`` steps of ``fit`` on ``--replicas`` logical CPU replicas (one process holds
every replica). A child reports its parameters, the peak resident memory (VmHWM) and each
step's time, or how it failed.

    python tools/zero3_headline.py            # ~10 min; docs/benchmarks/zero3_headline.{md,csv}
    python tools/zero3_headline.py --configs=zero3 --depth=2   # a quick look

Configurations: ``zero3`` (``DataParallelStrategy(shard_parameters=True)``), ``zero2``
(``tfdp.ShardedOptimizer(Adam)``: optimizer state sharded, parameters whole on every replica)
and ``unsharded`` (Keras's Adam under ``DataParallelStrategy``).
"""

from __future__ import annotations

import csv
import json
import os
import resource
import subprocess
import threading
import time

from absl import app, flags

import harness  # tools/: the script's directory, or pytest's pythonpath

CONFIGS = ("zero3", "zero2", "unsharded")
LABELS = {"zero3": "ZeRO-3 (shard_parameters=True)", "zero2": "ZeRO-2 (ShardedOptimizer)",
          "unsharded": "unsharded (tfdp)"}
# What a child's output says when it ran out of its memory bound.
OUT_OF_MEMORY_SIGNS = ("ResourceExhaustedError", "MemoryError", "bad_alloc", "OOM",
                       "Cannot allocate memory", "failed to allocate")

FLAGS = flags.FLAGS


def define_flags():
    """The tool's flags (defined when it runs, so that importing it defines none)."""
    flags.DEFINE_integer("width", 2048, "Units of every Dense layer (and the input width).")
    flags.DEFINE_integer("depth", 240, "Dense layers of width x width.")
    flags.DEFINE_integer("replicas", 8, "Logical CPU replicas.")
    flags.DEFINE_integer("steps", 3, "fit steps.")
    flags.DEFINE_integer("batch_per_replica", 8, "Examples per replica per step.")
    flags.DEFINE_list("configs", list(CONFIGS), f"Configurations, of {CONFIGS}.")
    flags.DEFINE_float("memory_limit_gb", 20.0, "Memory bound of each child, GiB.")
    flags.DEFINE_integer("timeout", 1500, "Seconds a child may run.")
    flags.DEFINE_string("out", "docs/benchmarks/zero3_headline", "Output prefix ('' to skip).")
    flags.DEFINE_string("child", "", "Internal: the configuration to run in this process.")


def out_of_memory(text: str) -> bool:
    """Whether a child's output shows it ran out of its memory bound. Pure."""
    return any(sign in text for sign in OUT_OF_MEMORY_SIGNS)


def _child():
    import numpy as np
    import keras
    import tensorflow as tf

    import tfdp

    n = FLAGS.replicas
    tfdp.configure_cpu_replicas(n)
    devices = [f"/device:CPU:{i}" for i in range(n)]
    strategy = tfdp.DataParallelStrategy(devices=devices,
                                         shard_parameters=FLAGS.child == "zero3")
    batch = FLAGS.batch_per_replica * n
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, FLAGS.width)).astype("float32")
    y = rng.integers(0, 10, size=batch).astype("int32")
    data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)).repeat(),
                                global_batch_size=batch)
    start = time.perf_counter()
    with strategy.scope():
        model = keras.Sequential([keras.Input((FLAGS.width,))] + [
            keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth)]
            + [keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-4)
        if FLAGS.child == "zero2":
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    print(f"built {model.count_params() / 1e9:.3f}B parameters in "
          f"{time.perf_counter() - start:.0f} s, VmHWM {harness.vm_hwm_bytes() / 2**30:.1f} GiB",
          flush=True)

    times = []

    def show(batch, logs):
        print(f"step {batch + 1}: {times[-1]:.1f} s, loss {logs['loss']:.4f}, "
              f"VmHWM {harness.vm_hwm_bytes() / 2**30:.1f} GiB", flush=True)

    history = model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0,
                        callbacks=[harness.timer(keras, times, after=show)])
    print("RESULT " + json.dumps(dict(
        config=FLAGS.child, replicas=n, params=model.count_params(), vm_hwm=harness.vm_hwm_bytes(),
        step_seconds=times, loss=history.history["loss"])), flush=True)


CGROUP_ROOT = "/sys/fs/cgroup/memory"


def make_cgroup(name, gib):
    """A memory cgroup (v1) limited to ``gib`` GiB, or None where none can be made."""
    path = os.path.join(CGROUP_ROOT, name)
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(int(gib * 2**30)))
        return path
    except OSError:
        return None


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _limit(gib, cgroup):
    def apply():
        if cgroup is not None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        else:
            limit = int(gib * 2**30)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    return apply


def run_config(config) -> dict:
    """One configuration in a child under the memory bound: its RESULT, or how it failed."""
    argv = harness.command(__file__, f"--child={config}", *harness.forward(
        FLAGS, "width", "depth", "replicas", "steps", "batch_per_replica"))
    start = time.perf_counter()
    cgroup = make_cgroup(f"tfdp_headline_{os.getpid()}_{config}", FLAGS.memory_limit_gb)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_limit(FLAGS.memory_limit_gb, cgroup),
                            env=harness.child_env())
    lines, stalled = [], []
    reader = threading.Thread(target=_read_lines, args=(proc, config, lines), daemon=True)
    reader.start()
    last_cpu, last_change = None, time.monotonic()
    while proc.poll() is None:
        time.sleep(2)
        cpu = harness.cpu_seconds(f"/proc/{proc.pid}/stat")
        if cpu != last_cpu:
            last_cpu, last_change = cpu, time.monotonic()
        elif cgroup is None and time.monotonic() - last_change > 60:
            stalled.append(True)  # RLIMIT_DATA reached: an allocation failed, TF waits
            proc.kill()
        if time.perf_counter() - start > FLAGS.timeout:
            proc.kill()
    reader.join(timeout=10)
    peak = _read_int(os.path.join(cgroup, "memory.max_usage_in_bytes")) if cgroup else None
    if cgroup:
        os.rmdir(cgroup)
    text = "".join(lines)
    found = harness.results(text)
    if found:
        return dict(found[0], outcome="trained", cgroup_peak=peak,
                    seconds=time.perf_counter() - start)
    if cgroup and proc.returncode == -9:
        reason = (f"killed by the kernel at the {FLAGS.memory_limit_gb:g} GiB bound "
                  "(out of memory)")
    elif stalled or out_of_memory(text):
        reason = "out of memory under the bound"
    else:
        reason = f"failed (exit {proc.returncode})"
    tail = [ln.strip() for ln in lines if ln.strip()][-3:]
    return dict(config=config, outcome=reason, returncode=proc.returncode, tail=tail,
                cgroup_peak=peak, seconds=time.perf_counter() - start)


def _read_lines(proc, config, lines):
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(("built", "step", "RESULT")):
            print(f"  [{config}] {line.rstrip()}", flush=True)


def main(argv):
    del argv
    if FLAGS.child:
        return _child()
    unknown = set(FLAGS.configs) - set(CONFIGS)
    if unknown:
        raise ValueError(f"--configs: unknown {sorted(unknown)}; use {CONFIGS}.")
    params = FLAGS.depth * (FLAGS.width ** 2 + FLAGS.width) + FLAGS.width * 10 + 10
    print(f"{params / 1e9:.3f}B parameters, {FLAGS.replicas} replicas, Adam, {FLAGS.steps} "
          f"steps, {FLAGS.memory_limit_gb:g} GiB per child", flush=True)
    results = []
    for config in FLAGS.configs:
        print(f"{LABELS[config]} ...", flush=True)
        result = run_config(config)
        print(f"{LABELS[config]}: {result['outcome']}", flush=True)
        results.append(result)
    if FLAGS.out:
        _write(FLAGS.out, results, params)


def _write(out, results, params):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["config", "outcome", "params", "replicas", "vm_hwm_gib",
                         "median_step_s", "first_step_s"])
        for r in results:
            steps = r.get("step_seconds") or []
            writer.writerow([r["config"], r["outcome"], params, FLAGS.replicas,
                             f"{r['vm_hwm'] / 2**30:.2f}" if "vm_hwm" in r else "",
                             f"{sorted(steps[1:] or steps)[len(steps[1:] or steps) // 2]:.2f}"
                             if steps else "", f"{steps[0]:.2f}" if steps else ""])
    with open(out + ".md", "w") as f:
        f.write(f"# ZeRO-3 headline: {params / 1e9:.2f}B parameters on one 2-core, 24 GiB host\n\n")
        f.write(f"`python tools/zero3_headline.py --width={FLAGS.width} --depth={FLAGS.depth} "
                f"--replicas={FLAGS.replicas} --steps={FLAGS.steps} "
                f"--memory_limit_gb={FLAGS.memory_limit_gb:g}` ({time.strftime('%Y-%m-%d')}): "
                f"an MLP of {FLAGS.depth} Dense layers of {FLAGS.width}, Adam, "
                f"{FLAGS.replicas} logical CPU replicas in one process, each child process "
                f"held to {FLAGS.memory_limit_gb:g} GiB by a memory cgroup of its own "
                "(the kernel kills a child that goes over).\n\n")
        f.write("| configuration | outcome | peak resident (VmHWM) | cgroup peak | step time (median after the first) | first step |\n")
        f.write("|---|---|---|---|---|---|\n")
        for r in results:
            steps = r.get("step_seconds") or []
            later = steps[1:] or steps
            f.write(f"| {LABELS[r['config']]} | {r['outcome']} | "
                    + (f"{r['vm_hwm'] / 2**30:.1f} GiB" if "vm_hwm" in r else "-") + " | "
                    + (f"{r['cgroup_peak'] / 2**30:.1f} GiB" if r.get("cgroup_peak") else "-")
                    + " | "
                    + (f"{sorted(later)[len(later) // 2]:.1f} s" if steps else "-") + " | "
                    + (f"{steps[0]:.1f} s" if steps else "-") + " |\n")
        for r in results:
            if r.get("tail"):
                f.write(f"\n{LABELS[r['config']]}, the end of its output:\n\n```\n"
                        + "\n".join(r["tail"]) + "\n```\n")
    print(f"wrote {out}.md, {out}.csv")


if __name__ == "__main__":
    define_flags()
    app.run(main)
