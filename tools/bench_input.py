"""Time to the first batch of tfdp.data.distribute against one full read of the files.

Writes a synthetic file set (default 64 TFRecord files x 20,000 records of one int64
feature), then measures, each the median of --repeats runs in this process (warm page cache):

* one full read: every raw record of every file through ``TFRecordDataset(files)``;
* the previous tfdp: the up-front record count it ran before the first step;
* ``distribute()`` + first batch for a ``tfdp.data.Files`` and for a native pipeline
  (``TFRecordDataset(files).map(parse)``), with the record-count index next to the files, without
  it (unknown steps), and without it but with ``num_examples``;
* the opt-in counting pass ``tfdp.data.count_records`` (parallel, no parsing).

    python tools/bench_input.py     # ~3 min on 2 cores; writes docs/benchmarks/data_input.{csv,png}
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from absl import app, flags, logging as absl_logging

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("files", 64, "Number of TFRecord files.")
flags.DEFINE_integer("records", 20_000, "Records per file.")
flags.DEFINE_string("dir", "/tmp/tfdp_bench_input", "Where the synthetic files go (reused).")
flags.DEFINE_integer("replicas", 2, "Logical CPU replicas.")
flags.DEFINE_integer("global_batch", 256, "Global batch size.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions per measurement (median reported).")
flags.DEFINE_bool("previous", True, "Also time the previous tfdp's up-front count (~1 min).")
flags.DEFINE_string("out", "docs/benchmarks/data_input", "Output prefix ('' to skip).")


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


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    import numpy as np
    import tensorflow as tf

    import tfdp
    from tfdp import data as tdata

    tfdp.configure_cpu_replicas(FLAGS.replicas)
    strategy = tfdp.DataParallelStrategy(devices=[f"/device:CPU:{i}" for i in range(FLAGS.replicas)])
    total = FLAGS.files * FLAGS.records
    print(f"{FLAGS.files} files x {FLAGS.records} records = {total} records in {FLAGS.dir}", flush=True)
    paths = write_files(tf, FLAGS.dir, FLAGS.files, FLAGS.records)
    index = os.path.join(FLAGS.dir, tdata.INDEX_FILENAME)
    aside = index + ".aside"
    description = {"id": tf.io.FixedLenFeature([], tf.int64)}
    parse = lambda r: tf.io.parse_single_example(r, description)["id"]  # noqa: E731

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

    files_source = lambda: tdata.Files(paths, parse_fn=parse)  # noqa: E731
    native_source = lambda: tf.data.TFRecordDataset(paths).map(parse)  # noqa: E731
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
    report.write_csv(FLAGS.out + ".csv", rows)
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [r["measurement"] for r in rows][::-1]
    values = [r["seconds"] for r in rows][::-1]
    colors = ["tab:gray" if "full read" in l else "tab:red" if "previous" in l else
              "tab:purple" if "count_records" in l else "tab:blue" for l in labels]
    ax.barh(labels, values, color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log scale)")
    ax.set_title(f"tfdp.data: time to the first batch\n{FLAGS.files} files x {FLAGS.records} "
                 f"records, {FLAGS.replicas} CPU replicas, warm page cache", fontsize=10)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f} s", va="center", fontsize=8)
    report.save_figure(fig, FLAGS.out + ".png")
    print(f"wrote {FLAGS.out}.csv/.png")


if __name__ == "__main__":
    app.run(main)
