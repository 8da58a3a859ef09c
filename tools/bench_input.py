"""Time to the first batch of tfdp.data.distribute: in fresh processes against
MirroredStrategy's ``experimental_distribute_dataset``, and in one process against one full
read of the files.

Writes a synthetic file set (default 64 TFRecord files x 20,000 records of one int64
feature), then:

Fresh processes (--rounds, default 15; 0 skips): each round starts one new Python process per
variant, in an order that rotates from round to round, and each process times only
"distribute + first batch" (after importing TensorFlow and building its strategy, 2 logical
CPU replicas): ``tf.distribute.MirroredStrategy.experimental_distribute_dataset(
TFRecordDataset(files).map(parse).batch(B))``, ``tfdp.data.distribute`` of the same native
pipeline unbatched, of ``tfdp.data.Files`` with the same parse, and (--before DIR: a checkout of
tfdp before a change, e.g. ``git worktree add /tmp/before <commit>``) the native pipeline
through that tfdp. Reported: median and spread (min-max, and the middle half) of the per-round
ratios tfdp / Mirrored, since this host's noise between processes is +-25%.

Warm (--warm), each the median of --repeats runs in this process (warm page cache):

* one full read: every raw record of every file through ``TFRecordDataset(files)``;
* the previous tfdp: the up-front record count it ran before the first step;
* ``distribute()`` + first batch for a ``tfdp.data.Files`` and for a native pipeline
  (``TFRecordDataset(files).map(parse)``), with the record-count index next to the files, without
  it (unknown steps), and without it but with ``num_examples``;
* the opt-in counting pass ``tfdp.data.count_records`` (parallel, no parsing).

    python tools/bench_input.py     # ~6 min on 2 cores; writes docs/benchmarks/data_input.{csv,png}
                                    # and docs/benchmarks/data_first_batch.{csv,png}
    python tools/bench_input.py --nowarm --rounds 15 --before /tmp/before   # fresh only
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

from absl import app, flags, logging as absl_logging

import harness

FLAGS = flags.FLAGS
flags.DEFINE_integer("files", 64, "Number of TFRecord files.")
flags.DEFINE_integer("records", 20_000, "Records per file.")
flags.DEFINE_string("dir", "/tmp/tfdp_bench_input", "Where the synthetic files go (reused).")
flags.DEFINE_integer("replicas", 2, "Logical CPU replicas.")
flags.DEFINE_integer("global_batch", 256, "Global batch size.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions per measurement (median reported).")
flags.DEFINE_bool("previous", True, "Also time the previous tfdp's up-front count (~1 min).")
flags.DEFINE_string("out", "docs/benchmarks/data_input",
                    "Output prefix of the warm measurements ('' to skip).")
flags.DEFINE_integer("rounds", 15, "Fresh-process rounds (0: skip).")
flags.DEFINE_string("before", "", "A checkout of tfdp before a change, also timed fresh.")
flags.DEFINE_bool("warm", True, "Also run the warm in-process measurements.")
flags.DEFINE_string("fresh_out", "docs/benchmarks/data_first_batch",
                    "Output prefix of the fresh rounds.")
flags.DEFINE_enum("child", "", ["", "mirrored", "native", "files"],
                  "Internal: time one variant in this (fresh) process and print it.")

FRESH_VARIANTS = ("mirrored", "native", "files")


def write_files(tf, directory, num_files, records):
    """One int64 feature "id" per record; ids 0..N-1 in file order."""
    from tfdp import data as tdata
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"part-{k:05d}.tfrecord") for k in range(num_files)]
    if tdata.record_counts(paths) == [records] * num_files:
        return paths
    for k, path in enumerate(paths):
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(k * records, (k + 1) * records):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))})
                ).SerializeToString())
        print(f"  wrote {k + 1}/{num_files} files", end="\r", flush=True)
    print()
    tdata.count_records(paths)  # the index, so the next run can skip writing
    return paths


def time_one_variant(variant):
    """In this fresh process: seconds of distribute + first batch for ``variant`` (printed)."""
    import tensorflow as tf

    import tfdp
    from tfdp import data as tdata

    tfdp.configure_cpu_replicas(FLAGS.replicas)
    devices = [f"/device:CPU:{i}" for i in range(FLAGS.replicas)]
    paths = [os.path.join(FLAGS.dir, f"part-{k:05d}.tfrecord") for k in range(FLAGS.files)]
    description = {"id": tf.io.FixedLenFeature([], tf.int64)}
    def parse(r):
        return tf.io.parse_single_example(r, description)["id"]

    if variant == "mirrored":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tfdp.DataParallelStrategy(devices=devices)
    start = time.perf_counter()
    if variant == "mirrored":
        dist = strategy.experimental_distribute_dataset(
            tf.data.TFRecordDataset(paths).map(parse).batch(FLAGS.global_batch))
    elif variant == "native":
        dist = tdata.distribute(strategy, tf.data.TFRecordDataset(paths).map(parse),
                                FLAGS.global_batch)
    else:
        dist = tdata.distribute(strategy, tdata.Files(paths, parse_fn=parse), FLAGS.global_batch)
    batch = next(iter(dist))
    seconds = time.perf_counter() - start
    ids = tf.concat(strategy.experimental_local_results(batch), 0)
    assert int(tf.size(ids)) == FLAGS.global_batch, ids
    print(f"RESULT {variant} {seconds:.4f} {tdata.__file__}", flush=True)


def fresh_rounds(before):
    """Rounds of fresh processes, one per variant, in a rotating order; returns rows."""
    variants = [(v, "") for v in FRESH_VARIANTS] + ([("native", before)] if before else [])
    names = {("mirrored", ""): "Mirrored experimental_distribute_dataset",
             ("native", ""): "tfdp native TFRecordDataset(files).map",
             ("files", ""): "tfdp Files"}
    if before:  # "" would overwrite this tree's native variant
        names[("native", before)] = "tfdp before, native"
    rows = []
    for r in range(FLAGS.rounds):
        shift = r % len(variants)
        for variant, tree in variants[shift:] + variants[:shift]:
            env = harness.child_env(*([tree] if tree else []))
            argv = harness.command(__file__, f"--child={variant}", *harness.forward(
                FLAGS, "dir", "files", "replicas", "global_batch"))
            out = harness.run(argv, env=env, timeout=300, cwd="/" if tree else None)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise RuntimeError(f"{variant} ({tree or 'this tree'}) failed:\n{out.stderr[-3000:]}")
            _, _, seconds, module = line[0].split(" ", 3)
            if tree and not module.startswith(os.path.abspath(tree)):
                raise RuntimeError(f"--before {tree} did not load its tfdp (got {module}).")
            rows.append({"round": r, "variant": names[(variant, tree)], "seconds": float(seconds)})
            print(f"  round {r + 1}/{FLAGS.rounds} {names[(variant, tree)]:45s} {float(seconds):.3f} s",
                  flush=True)
    return rows


def summarise_fresh(rows):
    """Per variant: median seconds; per tfdp variant: per-round ratio to Mirrored."""
    mirrored = {r["round"]: r["seconds"] for r in rows if r["variant"].startswith("Mirrored")}
    summary = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        seconds = [r["seconds"] for r in rows if r["variant"] == variant]
        ratios = sorted(r["seconds"] / mirrored[r["round"]] for r in rows if r["variant"] == variant)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        summary.append({"variant": variant, "rounds": len(seconds),
                        "median_seconds": round(statistics.median(seconds), 4),
                        "median_ratio_to_mirrored": round(statistics.median(ratios), 3),
                        "ratio_q1": round(q[0], 3), "ratio_q3": round(q[2], 3),
                        "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3)})
        print(f"  {variant:45s} median {summary[-1]['median_seconds']:.3f} s, ratio to Mirrored "
              f"median {summary[-1]['median_ratio_to_mirrored']:.2f} (middle half "
              f"{q[0]:.2f}-{q[2]:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)
    return summary


def plot_fresh(rows, summary, prefix):
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    variants = [s["variant"] for s in summary]
    ax.boxplot([[r["seconds"] for r in rows if r["variant"] == v] for v in variants],
               orientation="horizontal")
    ax.set_yticks(range(1, len(variants) + 1), variants)
    ax.set_xlabel("seconds: distribute + first batch, fresh process")
    ax.set_title(f"tfdp.data vs MirroredStrategy, {FLAGS.files} files, {FLAGS.replicas} CPU "
                 f"replicas, {FLAGS.rounds} interleaved rounds", fontsize=10)
    for y, s in enumerate(summary, start=1):
        ax.text(s["median_seconds"], y + 0.3, f"{s['median_ratio_to_mirrored']:.2f}x",
                fontsize=8, ha="center")
    harness.save_figure(fig, prefix + ".png")


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    if FLAGS.child:
        return time_one_variant(FLAGS.child)
    import tensorflow as tf

    total = FLAGS.files * FLAGS.records
    print(f"{FLAGS.files} files x {FLAGS.records} records = {total} records in {FLAGS.dir}", flush=True)
    paths = write_files(tf, FLAGS.dir, FLAGS.files, FLAGS.records)
    if FLAGS.rounds:
        print("distribute + first batch, fresh processes:", flush=True)
        rows = fresh_rounds(FLAGS.before)
        summary = summarise_fresh(rows)
        if FLAGS.fresh_out:
            harness.write_csv(FLAGS.fresh_out + ".csv", summary)
            harness.write_csv(FLAGS.fresh_out + "-rounds.csv", rows)
            plot_fresh(rows, summary, FLAGS.fresh_out)
            print(f"wrote {FLAGS.fresh_out}.csv/-rounds.csv/.png")
    if FLAGS.warm:
        warm_measurements(tf, paths, total)


def warm_measurements(tf, paths, total):
    import numpy as np

    import tfdp
    from tfdp import data as tdata

    tfdp.configure_cpu_replicas(FLAGS.replicas)
    strategy = tfdp.DataParallelStrategy(devices=[f"/device:CPU:{i}" for i in range(FLAGS.replicas)])
    index = os.path.join(FLAGS.dir, tdata.INDEX_FILENAME)
    aside = index + ".aside"
    description = {"id": tf.io.FixedLenFeature([], tf.int64)}
    def parse(r):
        return tf.io.parse_single_example(r, description)["id"]


    def timed(fn, repeats=FLAGS.repeats):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times)), fn()

    def full_read():
        n = 0
        for batch in tf.data.TFRecordDataset(paths, num_parallel_reads=tf.data.AUTOTUNE).batch(4096):
            n += int(tf.size(batch))
        assert n == total, n
        return n

    def previous_count():  # what tfdp.data did before the first step until this change
        files = tdata.Files(paths)
        return sum(int(files.open(tf.data.Dataset.from_tensor_slices([f])).reduce(
            tf.constant(0, tf.int64), lambda n, _: n + 1)) for f in paths)

    def first_batch(make_source, **kwargs):
        def run():
            dist = tdata.distribute(strategy, make_source(), FLAGS.global_batch, **kwargs)
            next(iter(dist))
            return int(dist.cardinality)
        return run

    def files_source():
        return tdata.Files(paths, parse_fn=parse)

    def native_source():
        return tf.data.TFRecordDataset(paths).map(parse)

    steps = -(-total // FLAGS.global_batch)
    rows = []

    def record(name, seconds, steps_known):
        rows.append({"measurement": name, "seconds": round(seconds, 4),
                     "steps_per_epoch_known": steps_known})
        print(f"  {name:58s} {seconds:8.3f} s", flush=True)

    print("measuring (warm page cache after the first read):", flush=True)
    first_batch(files_source)()  # warm-up: traces, thread pools, page cache
    seconds, n = timed(full_read)
    record("one full read (TFRecordDataset, raw records)", seconds, "")
    if FLAGS.previous:
        seconds, n = timed(previous_count, repeats=1)
        assert n == total
        record("previous tfdp: up-front count before the first step", seconds, True)
    for name, make, kwargs in [("Files + index", files_source, {}),
                               ("native TFRecordDataset(files).map + index", native_source, {})]:
        seconds, card = timed(first_batch(make, **kwargs))
        assert card == steps, (name, card)
        record(f"distribute() + first batch: {name}", seconds, True)
    os.replace(index, aside)
    try:
        for name, make, kwargs, known in [
                ("Files, no index", files_source, {}, False),
                ("native, no index", native_source, {}, False),
                ("native, no index, num_examples=", native_source, {"num_examples": total}, True)]:
            seconds, card = timed(first_batch(make, **kwargs))
            assert (card == steps) if known else card == tf.data.UNKNOWN_CARDINALITY, (name, card)
            record(f"distribute() + first batch: {name}", seconds, known)
        seconds, counts = timed(lambda: tdata.count_records(paths, write_index=False))
        assert sum(counts) == total
        record("opt-in tfdp.data.count_records (parallel, no parsing)", seconds, True)
    finally:
        if os.path.exists(aside):
            shutil.move(aside, index)

    if not FLAGS.out:
        return
    harness.write_csv(FLAGS.out + ".csv", rows)
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [r["measurement"] for r in rows][::-1]
    values = [r["seconds"] for r in rows][::-1]
    colors = ["tab:gray" if "full read" in label else "tab:red" if "previous" in label else
              "tab:purple" if "count_records" in label else "tab:blue" for label in labels]
    ax.barh(labels, values, color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log scale)")
    ax.set_title(f"tfdp.data: time to the first batch\n{FLAGS.files} files x {FLAGS.records} "
                 f"records, {FLAGS.replicas} CPU replicas, warm page cache", fontsize=10)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f} s", va="center", fontsize=8)
    harness.save_figure(fig, FLAGS.out + ".png")
    print(f"wrote {FLAGS.out}.csv/.png")


if __name__ == "__main__":
    app.run(main)
