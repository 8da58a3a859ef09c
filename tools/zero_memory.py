"""ZeRO-1/2 memory and step time: tfdp.ShardedOptimizer against the unsharded optimizer.

Memory: for N = 1, 2, 4, 8 logical CPU replicas, the bytes each replica holds of model
weights, optimizer slots, gradient accumulators and EMA copies, read from the variables on
each device (``optimizer.variables``), for

* unsharded Adam (Keras's own, under tfdp.DataParallelStrategy),
* ZeRO-1: ShardedOptimizer(Adam) without accumulation,
* ZeRO-1 + local accumulation: ShardedOptimizer(Adam(k), accumulation="local"),
* ZeRO-2: ShardedOptimizer(Adam(k)) (sharded accumulators),

with and without accumulation/EMA, next to the ZeRO paper's per-replica formulas
(Rajbhandari et al. 2019, sec. 5.1) in mixed precision and their float32 analogue.

Step time on --time_replicas replicas, each variant in its own process, interleaved in
rounds: unsharded and ZeRO-1 without accumulation, and with k-step accumulation unsharded
Keras, ZeRO-2 "sharded" (a reduce-scatter every micro-batch) and ZeRO-2 "local" (one
reduce-scatter per update); plus the bytes each replica sends per update.

Peak memory (``--sections=peak``): what a user sees. Each configuration in a fresh process:
an MLP (``--peak_model``, default 6 hidden layers of 2048 on 1024 inputs: 23.1M parameters),
Adam, ``--peak_steps`` steps of ``fit``; the growth of the process's peak resident memory
(``VmHWM`` in /proc/self/status) from just before the model is built, for unsharded Adam under
tfdp.DataParallelStrategy, under tf.distribute.MirroredStrategy, and ShardedOptimizer(Adam)
(ZeRO-2; without accumulation its gradients are transient, as in ZeRO-1), on
``--peak_replicas`` logical CPU replicas (one process holds every replica, so the growth is
the sum over replicas). Also TensorFlow's allocator peak (``get_memory_info``), which leaves
out what the allocator's free lists and the traced graphs hold.

    python tools/zero_memory.py   # ~6 min; docs/benchmarks/zero_memory.{md,csv,png}, docs/benchmarks/zero_memory_times.csv
    python tools/zero_memory.py --sections=peak   # ~12 min; docs/benchmarks/zero_memory_peak.{md,csv,png}

Importing this module defines no flags (the formulas are tested without running the tool).
"""

from __future__ import annotations

import csv
import os
import time

import harness

# Bytes per parameter of the ZeRO paper's model states: (parameters, gradients, optimizer
# states K). Mixed-precision Adam: fp16 parameters and gradients, fp32 master parameters +
# momentum + variance (K = 12). The float32 analogue (what Keras holds, also under
# mixed_float16, whose variables stay float32): float32 parameters and gradients, K = 8.
PRECISIONS = {"mixed": (2, 2, 12), "float32": (4, 4, 8)}


def zero_bytes_per_parameter(stage: int, num_replicas: int, precision: str = "mixed") -> float:
    """Model-state bytes per parameter on one replica (paper sec. 5.1). Pure.

    stage 0 (data parallel): (P + G + K); stage 1 (optimizer states sharded): P + G + K/N;
    stage 2 (gradients too): P + (G + K)/N.
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"stage={stage} must be 0, 1 or 2.")
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be >= 1.")
    p, g, k = PRECISIONS[precision]
    n = num_replicas
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n}[stage]


def bytes_sent_per_update(sizes, num_replicas, steps, variant, dtype_bytes=4) -> float:
    """Gradient/weight bytes one replica sends per optimizer update. Pure (but for the
    partition rule, imported from tfdp.optimizers.sharded).

    variant: ``"all_reduce"`` (ring all-reduce of every gradient once per update: 2(N-1)/N of
    the bytes), ``"zero"`` (ShardedOptimizer: the all-to-all reduce-scatter sends N-1 padded
    rows of the largest partition's width W, the all-gather forwards N-1 rows of W) or
    ``"zero2_sharded"`` (the reduce-scatter on each of the ``steps`` micro-batches, one
    all-gather).
    """
    from tfdp.optimizers.sharded import partition

    n = num_replicas
    if n == 1:
        return 0.0
    loads = [0] * n
    for size, owner in zip(sizes, partition(sizes, n)):
        loads[owner] += size
    rows = (n - 1) * max(loads) * dtype_bytes
    return {"all_reduce": 2 * (n - 1) / n * sum(sizes) * dtype_bytes,
            "zero": 2 * rows,
            "zero2_sharded": steps * rows + rows}[variant]


def define_flags():
    from absl import flags
    flags.DEFINE_list("replicas", ["1", "2", "4", "8"], "Replica counts for the memory table.")
    flags.DEFINE_integer("width", 256, "Hidden width of the model (a deep MLP with many variables).")
    flags.DEFINE_integer("depth", 12, "Hidden layers.")
    flags.DEFINE_integer("accumulation_steps", 4, "Micro-batches per update (k).")
    flags.DEFINE_integer("time_replicas", 4, "Replicas for the step-time comparison.")
    flags.DEFINE_list("time_models", ["12x256", "4x1024"],
                      "MLPs (hidden layers x width) for the step-time comparison.")
    flags.DEFINE_integer("rounds", 3, "Interleaved rounds; each times every variant once, "
                         "each variant in a fresh process.")
    flags.DEFINE_integer("steps", 80, "Timed micro-batches per process (a multiple of k).")
    flags.DEFINE_string("child", "", "Internal: the variant to time in this process.")
    flags.DEFINE_string("child_model", "", "Internal: the model (depth x width) for --child.")
    flags.DEFINE_string("out", "docs/benchmarks/zero_memory", "Output prefix for .md/.csv/.png ('' to skip).")
    flags.DEFINE_list("sections", ["memory", "time"], "What to run: memory (state bytes per "
                      "replica), time (step time), peak (peak resident memory).")
    flags.DEFINE_list("peak_replicas", ["2", "4", "8"], "Replica counts for the peak table.")
    flags.DEFINE_list("peak_configs", ["unsharded", "mirrored", "zero2"],
                      f"Configurations for the peak table, of {sorted(PEAK_CONFIGS)}.")
    flags.DEFINE_string("peak_model", "6x2048", "MLP for the peak table: hidden layers x width.")
    flags.DEFINE_integer("peak_steps", 3, "fit steps per peak measurement.")
    flags.DEFINE_integer("peak_rounds", 1, "Measurements of each configuration (fresh processes).")
    flags.DEFINE_string("peak_child", "", "Internal: the configuration to measure in this process.")
    flags.DEFINE_integer("peak_child_replicas", 8, "Internal: replicas for --peak_child.")


# (label, accumulation, use_ema, ShardedOptimizer accumulation mode or None = unsharded)
MEMORY_CONFIGS = [
    ("unsharded", False, False, None),
    ("unsharded + acc + EMA", True, True, None),
    ("ZeRO-1", False, False, "sharded"),
    ("ZeRO-1 + local acc + EMA", True, True, "local"),
    ("ZeRO-2 + EMA", True, True, "sharded"),
]
# The unsharded configuration with the same accumulation and EMA settings.
BASELINE = {label: next(b for b, a, e, m in MEMORY_CONFIGS if m is None and (a, e) == (acc, ema))
            for label, acc, ema, _ in MEMORY_CONFIGS}
TIME_CONFIGS = [  # (label, accumulation, sharded mode or None)
    ("unsharded", False, None),
    ("ZeRO-1", False, "sharded"),
    ("unsharded, k-step acc", True, None),
    ("ZeRO-2 sharded acc", True, "sharded"),
    ("ZeRO-2 local acc", True, "local"),
]
# Peak-memory configurations: (strategy, ShardedOptimizer?, gradient_accumulation_steps).
PEAK_CONFIGS = {
    "unsharded": ("tfdp", False, None),
    "mirrored": ("mirrored", False, None),
    "zero2": ("tfdp", True, None),
    "unsharded_acc4": ("tfdp", False, 4),
    "zero2_acc4": ("tfdp", True, 4),
    "zero3": ("zero3", False, None),
    "zero3_keep": ("zero3_keep", False, None),
}
# Each also under XLA (compile(jit_compile=True)): "<config>_xla".
PEAK_CONFIGS.update({f"{name}_xla": spec for name, spec in list(PEAK_CONFIGS.items())
                     if name in ("unsharded", "zero3", "zero3_keep")})
PEAK_LABELS = {"unsharded": "unsharded (tfdp)", "mirrored": "MirroredStrategy",
               "zero2": "ZeRO-2 (ShardedOptimizer)", "unsharded_acc4": "unsharded (tfdp), k=4",
               "zero2_acc4": "ZeRO-2, k=4 sharded accumulation",
               "zero3": "ZeRO-3 (shard_parameters=True)",
               "zero3_keep": "ZeRO-3, reshard_after_forward=False"}
PEAK_LABELS.update({f"{name}_xla": f"{PEAK_LABELS[name]}, XLA" for name in
                    ("unsharded", "zero3", "zero3_keep")})
TRAFFIC = {"unsharded": "all_reduce", "ZeRO-1": "zero", "unsharded, k-step acc": "all_reduce",
           "ZeRO-2 sharded acc": "zero2_sharded", "ZeRO-2 local acc": "zero"}


def zero3_theory_bytes(params: int, unit_params, num_replicas: int) -> float:
    """ZeRO-3's model state per replica in theory: 16/N bytes per parameter (float32
    parameters, gradients and Adam's two moments, each 1/N) plus the two largest units'
    parameters gathered whole (float32); activations not included. Pure."""
    two = sorted(unit_params, reverse=True)[:2]
    return 16.0 * params / num_replicas + 4.0 * sum(two)


def peak_command(config, replicas, model="6x2048", steps=3):
    """The command that measures one configuration's peak in a fresh process."""
    return harness.command(__file__, f"--peak_child={config}", f"--peak_child_replicas={replicas}",
                           f"--peak_model={model}", f"--peak_steps={steps}")


def parse_peak(config, returncode, stdout, stderr) -> dict:
    """The PEAK result a child printed (see _peak_child), or a RuntimeError with its output."""
    found = harness.results(stdout, prefix="PEAK ")
    if found:
        return found[0]
    raise RuntimeError(f"peak child {config} failed (exit {returncode}):\n"
                       f"{stdout[-2000:]}\n{stderr[-4000:]}")


def measure_peaks(configs, replicas, model="6x2048", steps=3, parallel=False, timeout=900):
    """``{config: result}`` for one replica count, each configuration in a fresh process.

    ``parallel``: the processes run at once (VmHWM is per process, so the numbers do not
    change; only the wall time does). A result has ``growth`` (VmHWM growth in bytes from just
    before the model is built), ``allocator_peak`` (TensorFlow's CPU allocator, bytes),
    ``params``, ``seconds``.
    """
    results = measure_peak_jobs([(c, replicas) for c in configs], model, steps, parallel, timeout)
    return dict(zip(configs, results))


def measure_peak_jobs(jobs, model="6x2048", steps=3, parallel=False, timeout=900):
    """``measure_peaks`` for a list of ``(config, replicas)``; the results in that order."""
    import subprocess
    if not parallel:
        out = []
        for config, replicas in jobs:
            proc = harness.run(peak_command(config, replicas, model, steps),
                               env=harness.child_env(), timeout=timeout)
            out.append(parse_peak(config, proc.returncode, proc.stdout, proc.stderr))
        return out
    procs = [(config, subprocess.Popen(peak_command(config, replicas, model, steps),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=harness.child_env()))
             for config, replicas in jobs]
    out = []
    for config, proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        out.append(parse_peak(config, proc.returncode, stdout, stderr))
    return out


def _peak_child(FLAGS):
    """One configuration's peak: VmHWM growth over build + fit; prints one PEAK line."""
    import json

    import numpy as np
    import keras
    import tensorflow as tf

    import tfdp

    kind, sharded, steps = PEAK_CONFIGS[FLAGS.peak_child]
    n = FLAGS.peak_child_replicas
    depth, width = (int(v) for v in FLAGS.peak_model.split("x"))
    tfdp.configure_cpu_replicas(n)
    devices = [f"/device:CPU:{i}" for i in range(n)]
    batch = 64 * n
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * batch, 1024)).astype("float32")
    y = rng.integers(0, 10, size=4 * batch).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    if kind == "mirrored":
        strategy = tf.distribute.MirroredStrategy(devices)
        data = dataset.batch(batch)
    else:
        strategy = tfdp.DataParallelStrategy(
            devices=devices, shard_parameters=kind.startswith("zero3"),
            reshard_after_forward=kind != "zero3_keep")
        data = tfdp.data.distribute(strategy, dataset, global_batch_size=batch)
    start, before = time.perf_counter(), harness.vm_hwm_bytes()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1024,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(depth)] + [
            keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=steps)
        if sharded:
            optimizer = tfdp.ShardedOptimizer(optimizer)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=FLAGS.peak_child.endswith("_xla"))
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.peak_steps * (steps or 1), verbose=0)
    growth = harness.vm_hwm_bytes() - before
    try:
        allocator_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except (ValueError, tf.errors.OpError):
        allocator_peak = None
    print("PEAK " + json.dumps(dict(
        config=FLAGS.peak_child, replicas=n, model=FLAGS.peak_model, params=model.count_params(),
        growth=growth, allocator_peak=allocator_peak,
        units=[layer.count_params() for layer in model.layers],
        seconds=time.perf_counter() - start)), flush=True)


def _peak_section(FLAGS):
    """Runs the peak table and writes {out}_peak.{csv,md,png}."""
    results = []
    for r in range(FLAGS.peak_rounds):
        for n in [int(v) for v in FLAGS.peak_replicas]:
            for config in FLAGS.peak_configs:
                result = measure_peaks([config], n, FLAGS.peak_model, FLAGS.peak_steps)[config]
                result["round"] = r
                results.append(result)
                print(f"peak round {r + 1}/{FLAGS.peak_rounds} N={n} {PEAK_LABELS[config]:34s} "
                      f"VmHWM growth {result['growth'] / 1e6:8.1f} MB, allocator peak "
                      f"{(result['allocator_peak'] or 0) / 1e6:8.1f} MB "
                      f"({result['seconds']:.0f} s)", flush=True)
    if FLAGS.out:
        _write_peak(FLAGS.out, results)
        print(f"wrote {FLAGS.out}_peak.md, .csv, .png")
    return results


def main(argv):
    del argv
    from absl import flags, logging as absl_logging
    FLAGS = flags.FLAGS
    absl_logging.set_verbosity(absl_logging.WARNING)
    if FLAGS.child:
        return _child(FLAGS)
    if FLAGS.peak_child:
        return _peak_child(FLAGS)
    unknown = set(FLAGS.sections) - {"memory", "time", "peak"}
    if unknown:
        raise ValueError(f"--sections: unknown {sorted(unknown)}; use memory, time, peak.")
    if "peak" in FLAGS.sections:
        _peak_section(FLAGS)
    if {"memory", "time"} & set(FLAGS.sections):
        _memory_and_time(FLAGS)


def _memory_and_time(FLAGS):
    import numpy as np
    import keras

    import tfdp
    from tfdp.optimizers.sharded_state import variable_bytes_per_device

    counts = [int(n) for n in FLAGS.replicas]
    k = FLAGS.accumulation_steps
    tfdp.configure_cpu_replicas(max(counts + [FLAGS.time_replicas]))

    def make_model(depth=FLAGS.depth, width=FLAGS.width):
        layers = [keras.Input((64,))]
        layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        return keras.Sequential(layers + [keras.layers.Dense(10)])

    def make_optimizer(accumulate, ema, mode, lr=1e-3):
        inner = keras.optimizers.Adam(lr, gradient_accumulation_steps=k if accumulate else None,
                                      use_ema=ema)
        return inner if mode is None else tfdp.ShardedOptimizer(inner, accumulation=mode)

    def categories(opt):
        """Variables by kind: slots, accumulators, EMA copies (the counters go with slots)."""
        inner = getattr(opt, "inner_optimizer", opt)
        acc = {id(v) for v in getattr(inner, "_accumulated_gradients", []) or [] if v is not None}
        ema = {id(v) for v in getattr(inner, "_model_variables_moving_average", []) or []
               if v is not None}
        kinds = {"slots": [], "accumulators": [], "ema": []}
        for v in opt.variables:
            kinds["accumulators" if id(v) in acc else "ema" if id(v) in ema else "slots"].append(v)
        return kinds

    # --- memory ---------------------------------------------------------------------------
    rows = []
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        for n in counts if policy == "float32" else [max(counts)]:
            strategy = tfdp.DataParallelStrategy(devices=[f"/device:CPU:{i}" for i in range(n)])
            for label, accumulate, ema, mode in MEMORY_CONFIGS:
                with strategy.scope():
                    model = make_model()
                    opt = make_optimizer(accumulate, ema, mode)
                    opt.build(model.trainable_variables)
                weights = variable_bytes_per_device(model.weights, strategy)
                parts = {kind: variable_bytes_per_device(vs, strategy)
                         for kind, vs in categories(opt).items()}
                state = [sum(p[r] for p in parts.values()) for r in range(n)]
                # Every variable counted once: the per-kind split adds up to optimizer.variables.
                from_variables = variable_bytes_per_device(opt.variables, strategy)
                assert state == from_variables, (state, from_variables)
                if mode is not None:
                    assert from_variables == opt.state_bytes_per_replica()
                worst = int(np.argmax(state))
                row = dict(policy=policy, replicas=n, config=label, weights=weights[worst],
                           slots=parts["slots"][worst], accumulators=parts["accumulators"][worst],
                           ema=parts["ema"][worst], state=state[worst], state_min=min(state),
                           params=model.count_params())
                rows.append(row)
                print(f"[{policy}] N={n} {label:26s} weights {row['weights']:>10,} slots "
                      f"{row['slots']:>10,} acc {row['accumulators']:>10,} ema {row['ema']:>10,} "
                      f"state max {row['state']:>10,} min {row['state_min']:>10,}", flush=True)
    keras.mixed_precision.set_global_policy("float32")
    params = rows[0]["params"]

    # --- step time: every variant in its own process --------------------------------------
    # Steps are timed inside one long fit with batch-end callbacks: under any tf.distribute
    # strategy (MirroredStrategy too) every fit() call costs 0.2-1.2 s of set-up here, which
    # would swamp windows of a few steps. A fresh process per variant keeps them isolated.
    n = FLAGS.time_replicas
    timings = {}  # model -> (variable sizes, {variant: [result per round]})
    for r in range(FLAGS.rounds):
        for spec in FLAGS.time_models:
            for label, _, _ in TIME_CONFIGS:
                result = _run_child(FLAGS, label, spec)
                sizes, by_variant = timings.setdefault(spec, (result["sizes"], {}))
                by_variant.setdefault(label, []).append(result)
                print(f"round {r + 1}/{FLAGS.rounds} [{spec}] {label}: "
                      f"{result['mean_ms']:.1f} ms per micro-batch (mean over {FLAGS.steps}); "
                      f"median micro-batch {result['accumulate_ms']:.1f}, update "
                      f"{result['update_ms']:.1f}", flush=True)

    if not FLAGS.out:
        return
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(FLAGS.out + "_times.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "variant", "round", "micro_batch", "update_step", "ms"])
        for spec, (_, by_variant) in timings.items():
            for label, results in by_variant.items():
                for r, result in enumerate(results):
                    writer.writerows((spec, label, r, i, int(u), f"{ms:.3f}") for i, (ms, u) in
                                     enumerate(zip(result["steps_ms"], result["is_update"])))
    _write_markdown(FLAGS, rows, timings, params, n, k)
    _plot(FLAGS.out + ".png", rows, timings, n)
    print(f"wrote {FLAGS.out}.md, .csv, .png")


def _run_child(FLAGS, label, spec):
    """Times one variant in a fresh process; returns its RESULT dict."""
    cmd = harness.command(__file__, f"--child={label}", f"--child_model={spec}",
                          *harness.forward(FLAGS, "time_replicas", "accumulation_steps", "steps"))
    proc = harness.run(cmd, env=harness.child_env(), timeout=900)
    found = harness.results(proc.stdout)
    if found:
        return found[0]
    raise RuntimeError(f"timing child {label} [{spec}] failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _child(FLAGS):
    """Times one variant: per-micro-batch wall times of one fit; prints one RESULT line."""
    import json

    import numpy as np
    import keras
    import tensorflow as tf

    import tfdp

    k, n, steps = FLAGS.accumulation_steps, FLAGS.time_replicas, FLAGS.steps
    if steps % k:
        raise ValueError(f"--steps={steps} must be a multiple of --accumulation_steps={k}.")
    tfdp.configure_cpu_replicas(n)
    label, accumulate, mode = next(c for c in TIME_CONFIGS if c[0] == FLAGS.child)
    depth, width = (int(v) for v in FLAGS.child_model.split("x"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = rng.integers(0, 10, size=4096).astype("int32")
    strategy = tfdp.DataParallelStrategy(devices=[f"/device:CPU:{i}" for i in range(n)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(depth)] + [keras.layers.Dense(10)])
        opt = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k if accumulate else None)
        if mode is not None:
            opt = tfdp.ShardedOptimizer(opt, accumulation=mode)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)).repeat(),
                                global_batch_size=64 * n)
    warmup = 2 * k  # trace, warm up, and end on an update boundary
    model.fit(data, epochs=1, steps_per_epoch=warmup, verbose=0)
    stamps = []
    clock = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: stamps.append(time.perf_counter()))
    model.fit(data, epochs=1, steps_per_epoch=steps + 1, verbose=0, callbacks=[clock])
    steps_ms = list(np.diff(stamps) * 1e3)  # batch b = 1..steps: its own wall time
    is_update = [not accumulate or (warmup + b + 1) % k == 0 for b in range(1, steps + 1)]
    between = [t for t, u in zip(steps_ms, is_update) if not u] or steps_ms
    updates = [t for t, u in zip(steps_ms, is_update) if u]
    print("RESULT " + json.dumps(dict(
        sizes=[int(np.prod(v.shape)) for v in model.trainable_variables], steps_ms=steps_ms,
        is_update=is_update, mean_ms=float(np.mean(steps_ms)),
        accumulate_ms=float(np.median(between)), update_ms=float(np.median(updates)))), flush=True)


def _write_markdown(FLAGS, rows, timings, params, n_time, k):
    import numpy as np

    f32 = [r for r in rows if r["policy"] == "float32"]
    by = {(r["replicas"], r["config"]): r for r in f32}
    counts = sorted({r["replicas"] for r in f32})
    def mib(b):
        return f"{b / 2**20:.2f}"

    lines = [
        "# ZeRO-1/2 memory: optimizer slots, gradient accumulators, EMA (tools/zero_memory.py)", "",
        f"Model: MLP, {FLAGS.depth} hidden layers of {FLAGS.width} ({params:,} parameters Ψ, "
        f"{2 * FLAGS.depth + 2} variables, {4 * params / 2**20:.2f} MiB of float32 weights); "
        f"optimizer Adam (2 slots), gradient_accumulation_steps={k}, use_ema where marked. "
        "Bytes read from `optimizer.variables` on each device (equal to "
        "`state_bytes_per_replica()`, asserted by the tool); the replica holding the most "
        "state is shown. MiB per replica:", "",
        "| N | configuration | slots | accumulators | EMA | optimizer state | state min..max / unsharded |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n in counts:
        for label, *_ in MEMORY_CONFIGS:
            r = by[(n, label)]
            base = by[(n, BASELINE[label])]
            lines.append(
                f"| {n} | {label} | {mib(r['slots'])} | {mib(r['accumulators'])} | "
                f"{mib(r['ema'])} | {mib(r['state'])} | "
                f"{r['state_min'] / base['state']:.3f}..{r['state'] / base['state']:.3f} |")
    mixed = [r for r in rows if r["policy"] == "mixed_float16"]
    same = all(r["state"] == by[(r["replicas"], r["config"])]["state"] for r in mixed)
    lines += [
        "", f"Under the `mixed_float16` policy (N={max(counts)}) every number is "
        f"{'identical' if same else 'DIFFERENT (see csv)'}: Keras keeps float32 variables (the "
        "float32 master weights are the model weights) and casts to float16 per operation, so "
        "slots and accumulators stay float32.", "",
        "## Against the ZeRO paper's formulas", "",
        "Per-replica model-state bytes per parameter. Measured = model weights (float32, "
        "replicated) + accumulators + slots (EMA left out: the paper has none). The paper "
        "counts a persistent gradient buffer; in Keras the gradient is a transient unless "
        "accumulation keeps it, so ZeRO-1 *with local accumulation* is stage 1 and ZeRO-2 "
        "(sharded accumulators) is stage 2. Float32 formula: 4Ψ + 4Ψ + 8Ψ/N (stage 1), "
        "4Ψ + 12Ψ/N (stage 2); paper, mixed precision, K=12: 2Ψ + 2Ψ + 12Ψ/N and "
        "2Ψ + 14Ψ/N.", "",
        "| N | stage 0 measured | float32 formula | paper mixed | stage 1 measured | float32 "
        "formula | paper mixed | stage 2 measured | float32 formula | paper mixed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def no_ema(row):
        return (row["weights"] + row["slots"] + row["accumulators"]) / row["params"]
    for n in counts:
        cells = [str(n)]
        for stage, label in ((0, "unsharded + acc + EMA"), (1, "ZeRO-1 + local acc + EMA"),
                             (2, "ZeRO-2 + EMA")):
            cells += [f"{no_ema(by[(n, label)]):.2f}",
                      f"{zero_bytes_per_parameter(stage, n, 'float32'):.2f}",
                      f"{zero_bytes_per_parameter(stage, n, 'mixed'):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    top = max(counts)
    m0 = no_ema(by[(top, "unsharded + acc + EMA")])
    m1 = no_ema(by[(top, "ZeRO-1 + local acc + EMA")])
    m2 = no_ema(by[(top, "ZeRO-2 + EMA")])
    lines += [
        "", f"Reduction at N={top}, measured: stage 1 {m0 / m1:.2f}x, stage 2 {m0 / m2:.2f}x "
        f"(float32 formula {16 / zero_bytes_per_parameter(1, top, 'float32'):.2f}x and "
        f"{16 / zero_bytes_per_parameter(2, top, 'float32'):.2f}x; paper mixed precision "
        f"{16 / zero_bytes_per_parameter(1, top):.2f}x and {16 / zero_bytes_per_parameter(2, top):.2f}x, "
        "tending to 4x and 8x). The measured values sit above the formulas by the partition's "
        "granularity: whole variables, and 12 equal 256x256 kernels do not split evenly over "
        "8 replicas. The paper's 4x/8x need its mixed-precision layout (float16 parameters, "
        "float32 master copy sharded with the optimizer state); Keras keeps the float32 "
        "weights replicated, so its limits are 2x (stage 1) and 4x (stage 2).", "",
        "## Step time: where to reduce when accumulating", "",
        "ShardedOptimizer's default `accumulation=\"sharded\"` (ZeRO-2) reduce-scatters every "
        "micro-batch so that each replica accumulates only what it owns (1/N of a gradient "
        "copy); `accumulation=\"local\"` accumulates the full local gradient (one copy per "
        "replica) and reduce-scatters once per update. The tables price that choice.", "",
        f"{n_time} CPU replicas, per-replica batch 64, k={k}. Each variant runs in its own "
        f"process, {FLAGS.rounds} "
        f"interleaved rounds of {FLAGS.steps} timed micro-batches; wall time per micro-batch "
        "from Keras batch-end callbacks inside one fit (each fit() call under a strategy costs "
        "0.2-1.2 s of set-up on this host, so whole-fit windows of a few steps mislead; "
        "per-step times in zero_memory_times.csv). *Mean* "
        "covers whole accumulation cycles (median over rounds); *between updates* and *update "
        "step* are medians over the micro-batches of each kind. Gradient collectives per "
        f"update: unsharded 1 all-reduce; ZeRO-2 sharded {k} reduce-scatters + 1 all-gather; "
        "ZeRO-2 local 1 reduce-scatter + 1 all-gather.", "",
    ]
    for spec, (sizes, by_variant) in timings.items():
        model_params = sum(sizes)
        mean = {label: float(np.median([r["mean_ms"] for r in rs])) for label, rs in by_variant.items()}

        def pooled(label, update):
            values = [t for r in by_variant[label] for t, u in zip(r["steps_ms"], r["is_update"])
                      if u == update]
            return float(np.median(values)) if values else float("nan")

        def ratio(a, b):
            return f"{mean[a] / mean[b]:.2f}"
        depth, width = spec.split("x")
        lines += [
            f"MLP {depth} x {width} ({model_params:,} parameters, "
            f"{4 * model_params / 2**20:.1f} MiB of gradients):", "",
            "| variant | ms per micro-batch (mean) | between updates | update step | "
            "ms per update | MiB sent per replica per update |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, accumulate, _ in TIME_CONFIGS:
            sent = bytes_sent_per_update(sizes, n_time, k, TRAFFIC[label]) / 2**20
            between = f"{pooled(label, False):.1f}" if accumulate else "-"
            lines.append(f"| {label} | {mean[label]:.1f} | {between} | {pooled(label, True):.1f} | "
                         f"{mean[label] * (k if accumulate else 1):.1f} | {sent:.1f} |")
        lines += [
            "", f"ZeRO-1 / unsharded = {ratio('ZeRO-1', 'unsharded')}; ZeRO-2 sharded / local = "
            f"{ratio('ZeRO-2 sharded acc', 'ZeRO-2 local acc')}; ZeRO-2 sharded / unsharded "
            f"accumulation = {ratio('ZeRO-2 sharded acc', 'unsharded, k-step acc')}.", ""]
    with open(FLAGS.out + ".md", "w") as f:
        f.write("\n".join(lines))


def _write_peak(out, results):
    """{out}_peak.csv (every measurement), .md (median per configuration) and .png."""
    import numpy as np

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fields = ["config", "replicas", "model", "params", "round", "growth", "allocator_peak",
              "seconds"]
    with open(out + "_peak.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    counts = sorted({r["replicas"] for r in results})
    configs = list(dict.fromkeys(r["config"] for r in results))

    def median(config, n, key):
        values = [r[key] for r in results if r["config"] == config and r["replicas"] == n
                  and r[key] is not None]
        return float(np.median(values)) if values else float("nan")
    params = results[0]["params"]
    base = "unsharded" if "unsharded" in configs else configs[0]
    lines = [
        "# Peak memory: " + ", ".join(PEAK_LABELS[c] for c in configs)
        + " (tools/zero_memory.py --sections=peak)", "",
        f"MLP {results[0]['model']} on 1024 inputs ({params:,} parameters, "
        f"{4 * params / 1e6:.1f} MB of float32 weights), Adam, 64 examples per replica, "
        "fit for a few steps; each configuration in a fresh process (all replicas of one "
        "process: the growth is their sum). *VmHWM growth*: the process's peak resident memory "
        "minus its value just before the model is built (MB); *allocator peak*: TensorFlow's "
        "CPU allocator's own peak (MB), which leaves out its free lists and the traced graphs; "
        f"*/ {base}*: VmHWM growth over that of {PEAK_LABELS[base]} at the same N. Median of "
        f"{max(r['round'] for r in results) + 1} measurement(s).", "",
        "*Per replica*: the growth and the allocator peak divided by N (every replica is in "
        "this one process), against ZeRO-3's theory per replica, 16/N bytes per parameter "
        "(float32 parameters, gradients, Adam's two moments) plus the two largest units' "
        "parameters (float32), activations left out.", "",
        "| N | configuration | VmHWM growth (MB) | allocator peak (MB) | / " + base + " | "
        "per replica: growth, allocator peak (MB) | theory per replica (MB) | "
        "allocator peak / theory |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    units = results[0].get("units") or []
    for n in counts:
        theory = zero3_theory_bytes(params, units, n) if units else float("nan")
        for config in configs:
            growth = median(config, n, "growth")
            peak = median(config, n, "allocator_peak")
            lines.append(f"| {n} | {PEAK_LABELS[config]} | {growth / 1e6:,.0f} | "
                         f"{peak / 1e6:,.0f} | "
                         f"{growth / median(base, n, 'growth'):.2f} | "
                         f"{growth / n / 1e6:,.0f}, {peak / n / 1e6:,.0f} | "
                         f"{theory / 1e6:,.0f} | {peak / n / theory:.2f} |")
    with open(out + "_peak.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot_peak(out + "_peak.png", results, counts, configs, median, units, params)


def _plot_peak(path, results, counts, configs, median, units=(), params=0):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(configs))
    xs = np.arange(len(counts))
    for j, config in enumerate(configs):
        ax.bar(xs + j * width, [median(config, n, "allocator_peak") / n / 1e6 for n in counts],
               width, label=PEAK_LABELS[config], color=f"C{j}")
    if units:
        for k, n in enumerate(counts):
            theory = zero3_theory_bytes(params, units, n) / 1e6
            ax.hlines(theory, xs[k] - width / 2, xs[k] + width * (len(configs) - 0.5),
                      colors="black", linestyles="dashed",
                      label="ZeRO-3 theory: 16/N B/param + two largest units" if k == 0 else None)
    ax.set_xticks(xs + width * (len(configs) - 1) / 2, [f"N={n}" for n in counts])
    ax.set_ylabel("TensorFlow allocator peak per replica (MB)")
    ax.set_title(f"Peak resident memory, MLP {results[0]['model']} "
                 f"({results[0]['params'] / 1e6:.1f}M parameters), Adam")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot(path, rows, timings, n_time):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    f32 = [r for r in rows if r["policy"] == "float32"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, style in (("unsharded + acc + EMA", "o-"), ("ZeRO-1", "s-"),
                         ("ZeRO-1 + local acc + EMA", "^-"), ("ZeRO-2 + EMA", "D-")):
        pts = sorted((r["replicas"], (r["weights"] + r["slots"] + r["accumulators"]) / r["params"])
                     for r in f32 if r["config"] == label)
        left.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"measured: {label}")
    grid = [1, 2, 4, 8, 16]
    for stage, color in ((0, "C0"), (1, "C2"), (2, "C3")):
        left.plot(grid, [zero_bytes_per_parameter(stage, n, "float32") for n in grid], "--",
                  color=color, alpha=0.7, label=f"float32 formula, stage {stage}")
        left.plot(grid, [zero_bytes_per_parameter(stage, n, "mixed") for n in grid], ":",
                  color=color, alpha=0.7, label=f"paper mixed precision, stage {stage}")
    left.set_xscale("log", base=2)
    left.set_xticks(grid, [str(g) for g in grid])
    left.set_xlabel("replicas N")
    left.set_ylabel("bytes per parameter per replica\n(weights + accumulators + slots)")
    left.set_title("ZeRO memory, Adam (EMA excluded)")
    left.legend(fontsize=6.5)
    labels = [label for label, _, _ in TIME_CONFIGS]
    height = 0.8 / max(1, len(timings))
    for j, (spec, (_, by_variant)) in enumerate(timings.items()):
        mean = {label: np.median([r["mean_ms"] for r in rs]) for label, rs in by_variant.items()}
        ys = np.arange(len(labels)) + j * height
        right.barh(ys, [mean[label] / mean["unsharded"] for label in labels], height=height,
                   color=f"C{j + 4}", label=f"MLP {spec}")
    right.set_yticks(np.arange(len(labels)) + 0.4 - height / 2, labels)
    right.axvline(1.0, color="grey", lw=0.8)
    right.set_xlabel(f"mean time per micro-batch / unsharded ({n_time} replicas)")
    right.set_title("step time, accumulation variants")
    right.invert_yaxis()
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    from absl import app
    define_flags()
    app.run(main)
