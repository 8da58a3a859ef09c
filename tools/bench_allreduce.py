"""Collective bandwidth: all-reduce, reduce-scatter and all-gather from 4 KiB to 256 MiB.

Reports time, algorithm bandwidth and bus bandwidth with the nccl-tests definitions
(S = bytes of the full buffer, n = replicas):
    algbw = S / t
    all-reduce busbw = algbw * 2(n-1)/n;  reduce-scatter / all-gather busbw = algbw * (n-1)/n
for tfdp's collectives and TensorFlow's default cross-device ops (MirroredStrategy), next to
this host's measured memory-copy bandwidth as the ceiling; plus gradient reduction of many
tensors with and without buckets and compression.

    python tools/bench_allreduce.py          # ~4 min; writes docs/benchmarks/bench_allreduce.{md,csv,png}
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging as absl_logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from collective_math import bus_factor  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 4, "Logical CPU replicas.")
flags.DEFINE_integer("min_kib", 4, "Smallest message, KiB.")
flags.DEFINE_integer("max_mib", 256, "Largest message, MiB.")
flags.DEFINE_integer("repeats", 5, "Timed repetitions per point (median reported).")
flags.DEFINE_string("out", "docs/benchmarks/bench_allreduce", "Output prefix ('' to skip).")


def memcpy_bandwidth(nbytes=256 << 20):
    import numpy as np
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times))


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    import numpy as np
    import tensorflow as tf

    import tfdp
    from tfdp.strategy import collectives, replica_ops

    n = FLAGS.replicas
    tfdp.configure_cpu_replicas(n)
    devices = [f"/device:CPU:{i}" for i in range(n)]
    ours = tfdp.DataParallelStrategy(devices=devices)
    theirs = tf.distribute.MirroredStrategy(devices)
    ceiling = memcpy_bandwidth()
    print(f"memory-copy bandwidth (numpy, 256 MiB): {ceiling / 1e9:.2f} GB/s", flush=True)

    def timed(fn, *args):
        fn(*args)  # trace + warm up
        times = []
        for _ in range(FLAGS.repeats):
            t = time.perf_counter()
            out = fn(*args)
            for part in tf.nest.flatten(out):
                part.numpy() if hasattr(part, "numpy") else None
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    def per_replica(strategy, elements):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.fill([elements], tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)))

    def make(strategy, op):
        @tf.function
        def run(x):
            def step(v):
                if op == "all_reduce":
                    return collectives.all_reduce(v)
                if op == "reduce_scatter":
                    return replica_ops.reduce_scatter(tf.reshape(v, [n, -1]))
                if op == "all_gather":
                    return replica_ops.all_gather(v[: tf.size(v) // n])
                return tf.distribute.get_replica_context().all_reduce("SUM", v)  # TF default
            return strategy.run(step, args=(x,))
        return run

    rows = []
    size = FLAGS.min_kib * 1024
    sizes = []
    while size <= FLAGS.max_mib * (1 << 20):
        sizes.append(size)
        size *= 4
    started = time.time()
    for nbytes in sizes:
        elements = nbytes // 4
        elements -= elements % n
        for impl, strategy, op in (("tfdp", ours, "all_reduce"), ("tf-mirrored", theirs, "tf_all_reduce"),
                                   ("tfdp", ours, "reduce_scatter"), ("tfdp", ours, "all_gather")):
            x = per_replica(strategy, elements)
            t = timed(make(strategy, op), x)
            algbw = elements * 4 / t
            rows.append({"impl": impl, "op": op.replace("tf_", ""), "bytes": elements * 4,
                         "time_s": t, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * bus_factor(op, n) / 1e9})
            print(f"[{time.time() - started:5.0f}s] {impl:11s} {op:15s} {elements * 4 / 1024:>9,.0f} KiB: "
                  f"{t * 1e3:9.3f} ms  algbw {algbw / 1e9:6.2f} GB/s  busbw "
                  f"{algbw * bus_factor(op, n) / 1e9:6.2f} GB/s", flush=True)

    # Gradient reduction of 64 tensors: buckets and compression.
    grad_rows = []
    for total_mib in (1, 64):
        shapes = [(total_mib * (1 << 20) // 4 // 64,)] * 64
        for bucket_bytes, compression in ((0, None), (None, None), (None, "fp16"), (None, "bf16")):
            s = tfdp.DataParallelStrategy(devices=devices, bucket_bytes=bucket_bytes, compression=compression)
            xs = [per_replica(s, shape[0]) for shape in shapes]

            @tf.function
            def reduce_all(*values, s=s):
                return s.run(lambda *g: collectives.all_reduce_gradients(list(g), s), args=values)

            t = timed(reduce_all, *xs)
            label = f"bucket={'per-tensor' if bucket_bytes == 0 else '32MiB'} compression={compression}"
            grad_rows.append((total_mib, label, t))
            print(f"gradients {total_mib} MiB in 64 tensors, {label}: {t * 1e3:.2f} ms", flush=True)

    lines = [f"Host memory-copy bandwidth (the ceiling): **{ceiling / 1e9:.2f} GB/s**. {n} logical CPU "
             "replicas on 2 physical cores: every byte moved is a memory copy.", "",
             "| op | implementation | size | time (ms) | algbw (GB/s) | busbw (GB/s) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['impl']} | {r['bytes'] / 1024:,.0f} KiB | {r['time_s'] * 1e3:.3f} | "
                     f"{r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} |")
    lines += ["", "| gradients | reduction | time (ms) |", "|---|---|---:|"]
    lines += [f"| {m} MiB in 64 tensors | {label} | {t * 1e3:.2f} |" for m, label, t in grad_rows]
    text = "\n".join(lines)
    print("\n" + text)
    if not FLAGS.out:
        return
    report.write_csv(FLAGS.out + ".csv", rows)
    report.write_text(FLAGS.out + ".md", "# Collective bandwidth (tools/bench_allreduce.py)\n\n" + text)
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (impl, op), style in ((("tfdp", "all_reduce"), "o-"), (("tf-mirrored", "all_reduce"), "s--"),
                              (("tfdp", "reduce_scatter"), "^-"), (("tfdp", "all_gather"), "v-")):
        pts = [(r["bytes"], r["busbw_GBps"]) for r in rows if r["impl"] == impl and r["op"] == op]
        ax.plot(*zip(*pts), style, label=f"{op} ({impl})")
    ax.axhline(ceiling / 1e9, color="gray", ls=":", label="memcpy ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{n} logical CPU replicas, 2 cores")
    ax.legend(fontsize=8)
    report.save_figure(fig, FLAGS.out + ".png")
    print(f"wrote {FLAGS.out}.md/.csv/.png")


if __name__ == "__main__":
    app.run(main)
