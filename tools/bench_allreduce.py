"""Collective bandwidth: all-reduce, reduce-scatter and all-gather from 4 KiB to 256 MiB.

Reports time, algorithm bandwidth and bus bandwidth with the nccl-tests definitions
(S = bytes of the full buffer, n = replicas):
    algbw = S / t
    all-reduce busbw = algbw * 2(n-1)/n;  reduce-scatter / all-gather busbw = algbw * (n-1)/n
for tfdp's collectives and TensorFlow's default cross-device ops (MirroredStrategy), next to
this host's measured memory-copy bandwidth as the ceiling; plus gradient reduction of many
tensors with and without buckets and compression.

    python tools/bench_allreduce.py          # ~4 min; writes docs/benchmarks/bench_allreduce.{md,csv,png}

Multi-worker mode (``--workers N``): N worker processes on 127.0.0.1 (TF_CONFIG, free ports,
one replica each, each pinned to its own core where the host has as many), the same sizes
over gRPC collectives: tfdp's all-reduce, reduce-scatter and all-gather, and
MultiWorkerMirroredStrategy's all-reduce and all-gather (it has no public reduce-scatter).
Each implementation runs as its own job (a process keeps one collective server), in
interleaved rounds (``--rounds``); rank 0's median per point is kept, then the median over
rounds:

    python tools/bench_allreduce.py --workers 2 --rounds 2   # writes ..._multiworker.{md,csv,png}
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from absl import app, flags, logging as absl_logging

import harness
from collective_math import bus_factor

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 4, "Logical CPU replicas.")
flags.DEFINE_integer("min_kib", 4, "Smallest message, KiB.")
flags.DEFINE_integer("max_mib", 256, "Largest message, MiB.")
flags.DEFINE_integer("repeats", 5, "Timed repetitions per point (median reported).")
flags.DEFINE_string("out", "docs/benchmarks/bench_allreduce", "Output prefix ('' to skip); "
                    "the multi-worker mode adds '_multiworker'.")
flags.DEFINE_integer("workers", 0, "Worker processes on 127.0.0.1 (0: one process with "
                     "--replicas logical CPU replicas).")
flags.DEFINE_list("impls", ["tfdp", "mwms"], "Multi-worker mode: tfdp and/or mwms "
                  "(MultiWorkerMirroredStrategy, ring).")
flags.DEFINE_integer("rounds", 1, "Multi-worker mode: interleaved rounds of every implementation.")
flags.DEFINE_integer("job_timeout", 900, "Multi-worker mode: seconds one job may take.")
flags.DEFINE_bool("pin", True, "Multi-worker mode: pin each worker process to its own core "
                  "(where the host has as many).")
flags.DEFINE_string("child", "", "Internal: 'impl,rank,port0,port1,...' of a worker process.")


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


def message_sizes():
    """Bytes of every point: --min_kib, then x4 up to --max_mib."""
    sizes, size = [], FLAGS.min_kib * 1024
    while size <= FLAGS.max_mib * (1 << 20):
        sizes.append(size)
        size *= 4
    return sizes


def timed(fn, *args, cpu=None):
    """Median seconds of --repeats calls of ``fn`` after one call that traces and warms up.

    ``cpu``, a dict, receives this process's CPU seconds per call over the timed calls
    (``"process"``) and per thread group (:func:`thread_cpu`)."""
    import numpy as np
    import tensorflow as tf

    fn(*args)
    times = []
    threads_before, process_before = thread_cpu(), os.times()
    for _ in range(FLAGS.repeats):
        t = time.perf_counter()
        out = fn(*args)
        for part in tf.nest.flatten(out):
            part.numpy() if hasattr(part, "numpy") else None
        times.append(time.perf_counter() - t)
    if cpu is not None:
        process_after, threads_after = os.times(), thread_cpu()
        cpu["process"] = ((process_after.user + process_after.system)
                          - (process_before.user + process_before.system)) / FLAGS.repeats
        for group, seconds in threads_after.items():
            spent = (seconds - threads_before.get(group, 0.0)) / FLAGS.repeats
            if spent > 0:
                cpu[group] = spent
    return float(np.median(times))


def thread_group(name: str) -> str:
    """A thread's group from its name (``/proc/.../comm``, 15 characters): digits and the
    instance suffixes dropped, so TensorFlow's pools and gRPC's pollers add up."""
    return re.sub(r"[\d_-]+$", "", re.sub(r"\d+", "", name)) or name


def thread_cpu() -> dict:
    """CPU seconds so far of this process's live threads, summed by :func:`thread_group` (a
    thread that ended between two reads takes its seconds out of its group's difference,
    which the process total still counts)."""
    with open("/proc/self/comm") as f:
        process_name = f.read().strip()
    groups = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        seconds = harness.cpu_seconds(f"/proc/self/task/{tid}/stat")
        if seconds is None:
            continue
        # The main thread carries the process's name; it runs the function's executor inline.
        # Threads that never named themselves keep it too: "unnamed".
        group = ("main" if int(tid) == os.getpid() else
                 "unnamed" if name == process_name else thread_group(name))
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


MULTIWORKER_OPS = {"tfdp": ("all_reduce", "reduce_scatter", "all_gather"),
                   "mwms": ("all_reduce", "all_gather")}


def worker_child():
    """One worker of a multi-worker job: times every op and size; rank 0 prints JSON lines."""
    impl, rank, *ports = FLAGS.child.split(",")
    rank = int(rank)
    if FLAGS.pin and len(os.sched_getaffinity(0)) >= len(ports) and hasattr(
            os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # one core each
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    import tfdp
    from tfdp.strategy import collectives, replica_ops

    if impl == "tfdp":
        strategy = tfdp.DataParallelStrategy()
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    n = strategy.num_replicas_in_sync

    def make(op):
        @tf.function
        def run(x):
            def step(v):
                ctx = tf.distribute.get_replica_context()
                # An identity under the replica's device scope: with one local replica the input
                # is a plain tensor without a device, which MWMS's reduction cannot place
                # ("destinations can not be empty"). It forwards the buffer (no copy).
                v = tf.identity(v)
                if op == "all_gather":
                    part = v[: tf.size(v) // n]
                    return (replica_ops.all_gather(part) if impl == "tfdp"
                            else ctx.all_gather(part, axis=0))
                if op == "reduce_scatter":
                    return replica_ops.reduce_scatter(tf.reshape(v, [n, -1]))
                return collectives.all_reduce(v) if impl == "tfdp" else ctx.all_reduce("SUM", v)
            return strategy.run(step, args=(x,))
        return run

    for nbytes in message_sizes():
        elements = nbytes // 4 - (nbytes // 4) % n
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx, e=elements: tf.fill([e], tf.cast(ctx.replica_id_in_sync_group + 1,
                                                         tf.float32)))
        for op in MULTIWORKER_OPS[impl]:
            cpu = {}
            t = timed(make(op), x, cpu=cpu)
            if rank == 0:
                print(json.dumps({"impl": impl, "op": op, "bytes": elements * 4, "time_s": t,
                                  "workers": len(ports), "cpu": cpu}), flush=True)


def run_job(impl):
    """One job of --workers processes of ``impl``; rank 0's rows, or an error naming the rank."""
    from tfdp.launcher.processes import free_ports

    ports = [str(p) for p in free_ports(FLAGS.workers)]
    flags_passed = harness.forward(FLAGS, "min_kib", "max_mib", "repeats", "pin")
    procs = [subprocess.Popen(harness.command(__file__, *flags_passed,
                                              f"--child={impl},{rank}," + ",".join(ports)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(FLAGS.workers)]
    outputs = []
    deadline = time.monotonic() + FLAGS.job_timeout
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
            if proc.returncode != 0:
                raise RuntimeError(f"{impl} worker {rank} exited with {proc.returncode}:\n"
                                   + "\n".join(out.splitlines()[-15:]))
    finally:
        for proc in procs:  # only the processes this job started
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return harness.results(outputs[0], prefix="")


def multiworker_main():
    """--workers N: every implementation's job in interleaved rounds; tables, CSV and plot."""
    n = FLAGS.workers
    runs, cpus = {}, {}
    started = time.time()
    for round_index in range(FLAGS.rounds):
        for impl in FLAGS.impls:
            for row in run_job(impl):
                key = (row["impl"], row["op"], row["bytes"])
                runs.setdefault(key, []).append(row["time_s"])
                cpus.setdefault(key, []).append(row.get("cpu", {}))
                algbw = row["bytes"] / row["time_s"]
                print(f"[{time.time() - started:5.0f}s] round {round_index + 1} {impl:5s} "
                      f"{row['op']:15s} {row['bytes'] / 1024:>9,.0f} KiB: "
                      f"{row['time_s'] * 1e3:9.3f} ms  algbw {algbw / 1e9:6.3f} GB/s", flush=True)
    rows = []
    for (impl, op, nbytes), times in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                          kv[0][0])):
        t = statistics.median(times)
        algbw = nbytes / t
        rows.append({"impl": impl, "op": op, "bytes": nbytes, "workers": n, "time_s": t,
                     "time_min_s": min(times), "time_max_s": max(times), "rounds": len(times),
                     "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * bus_factor(op, n) / 1e9,
                     "process_cpu_s": statistics.median(
                         c.get("process", 0.0) for c in cpus[(impl, op, nbytes)])})
    by = {(r["impl"], r["op"], r["bytes"]): r for r in rows}
    lines = [f"{n} worker processes on 127.0.0.1, one replica each (gRPC collectives over "
             f"loopback), {FLAGS.rounds} interleaved round(s), median of {FLAGS.repeats} "
             f"repeats per point; memory-copy bandwidth of this host "
             f"{memcpy_bandwidth() / 1e9:.2f} GB/s.", "",
             "| op | size | tfdp (ms) | MWMS (ms) | tfdp busbw (GB/s) | MWMS busbw (GB/s) | "
             "MWMS time / tfdp |", "|---|---:|---:|---:|---:|---:|---:|"]
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        for nbytes in sorted({r["bytes"] for r in rows if r["op"] == op}):
            ours, theirs = by.get(("tfdp", op, nbytes)), by.get(("mwms", op, nbytes))

            def cell(r, key, scale=1.0, fmt="{:.3f}"):
                return fmt.format(r[key] * scale) if r else "—"
            ratio = f"{theirs['time_s'] / ours['time_s']:.2f}" if ours and theirs else "—"
            lines.append(f"| {op} | {nbytes / 1024:,.0f} KiB | {cell(ours, 'time_s', 1e3)} | "
                         f"{cell(theirs, 'time_s', 1e3)} | {cell(ours, 'busbw_GBps')} | "
                         f"{cell(theirs, 'busbw_GBps')} | {ratio} |")
    lines += ["", *cpu_table(rows, cpus)]
    text = "\n".join(lines)
    print("\n" + text)
    if not FLAGS.out:
        return
    out = FLAGS.out + "_multiworker"
    harness.write_csv(out + ".csv", rows)
    command = "python tools/bench_allreduce.py " + " ".join(sys.argv[1:])
    harness.write_text(out + ".md", "# Collective bandwidth between worker processes "
                      f"(tools/bench_allreduce.py)\n\nCommand: `{command}`\n\n" + text)
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {("tfdp", "all_reduce"): "o-", ("mwms", "all_reduce"): "s--",
              ("tfdp", "reduce_scatter"): "^-", ("tfdp", "all_gather"): "v-",
              ("mwms", "all_gather"): "x--"}
    for (impl, op), style in styles.items():
        pts = [(r["bytes"], r["busbw_GBps"]) for r in rows if (r["impl"], r["op"]) == (impl, op)]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{op} ({impl})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{n} worker processes, gRPC on loopback")
    ax.legend(fontsize=8)
    harness.save_figure(fig, out + ".png")
    print(f"wrote {out}.md/.csv/.png")


def cpu_table(rows, cpus, min_bytes=1 << 20):
    """Where one call's time goes on rank 0, for messages of ``min_bytes`` and more: its wall
    time beside the CPU seconds the whole process spent per call (every thread), their ratio
    (1.0 on a pinned worker: the collective kept its one core busy all along, so it is bound
    by that core's work, not by waiting), and the thread groups that spent it."""
    lines = ["Where the time goes on rank 0 (CPU per call over the timed repeats, median over "
             "rounds; 'CPU / wall' 1.0 on a pinned worker = its one core busy for the whole "
             "call):", "",
             "| impl | op | size | wall (ms) | process CPU (ms) | CPU / wall | "
             "threads (CPU ms) |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        key = (r["impl"], r["op"], r["bytes"])
        if r["bytes"] < min_bytes or not any(cpus.get(key, [])):
            continue
        process = r["process_cpu_s"]
        groups = {}
        for c in cpus[key]:
            for group, seconds in c.items():
                if group != "process":
                    groups.setdefault(group, []).append(seconds)
        top = sorted(((statistics.median(v + [0.0] * (len(cpus[key]) - len(v))), g)
                      for g, v in groups.items()), reverse=True)[:4]
        threads = ", ".join(f"{g} {s * 1e3:.0f}" for s, g in top if s * 1e3 >= 0.5)
        lines.append(f"| {r['impl']} | {r['op']} | {r['bytes'] / 2**20:,.0f} MiB | "
                     f"{r['time_s'] * 1e3:.1f} | {process * 1e3:.1f} | "
                     f"{process / r['time_s']:.2f} | {threads} |")
    return lines


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    if FLAGS.child:
        worker_child()
        return
    if FLAGS.workers:
        multiworker_main()
        return
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
    sizes = message_sizes()
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
    harness.write_report(FLAGS.out, "# Collective bandwidth (tools/bench_allreduce.py)\n\n" + text,
                         rows, lambda ax: plot_bandwidth(ax, rows, ceiling, n), figsize=(7, 4))
    print(f"wrote {FLAGS.out}.md/.csv/.png")


def plot_bandwidth(ax, rows, ceiling, n):
    for (impl, op), style in ((("tfdp", "all_reduce"), "o-"), (("tf-mirrored", "all_reduce"), "s--"),
                              (("tfdp", "reduce_scatter"), "^-"), (("tfdp", "all_gather"), "v-")):
        pts = [(r["bytes"], r["busbw_GBps"]) for r in rows if r["impl"] == impl and r["op"] == op]
        ax.plot(*zip(*pts), style, label=f"{op} ({impl})")
    ax.axhline(ceiling / 1e9, color="gray", ls=":", label="memcpy ceiling")
    harness.label_axes(ax, "message size (bytes)", "bus bandwidth (GB/s)",
                       f"{n} logical CPU replicas, 2 cores", log2_x=True, legend={"fontsize": 8})


if __name__ == "__main__":
    app.run(main)
