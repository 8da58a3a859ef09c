"""Worker for test_data_files.py: native file pipelines (5 uneven files) and already-batched
datasets through tfdp.data.distribute on real workers; dumps, per pipeline and policy, the ids
this worker's replicas saw in one epoch, the steps and the cardinality to OUT/files-<rank>.json.

Env: TFDP_TEST_OUT, TFDP_TEST_DATA (the directory test_data_files.py's fixture wrote)."""

import json
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from data_helpers import read_epoch_with_collectives  # noqa: E402

out, data = os.environ["TFDP_TEST_OUT"], pathlib.Path(os.environ["TFDP_TEST_DATA"])
rank = int(os.environ["TFDP_RANK"])
strategy = tfdp.DataParallelStrategy()
tfrecords = sorted(str(p) for p in (data / "tfrecord").glob("*.tfrecord"))
texts = sorted(str(p) for p in (data / "text").glob("*.txt"))
parse = tfdp.data.tfrecord_parser(tf.TensorSpec([], tf.int64))
pipelines = {  # name -> (make, number of elements)
    "tfrecord_list": (lambda: tf.data.TFRecordDataset(tfrecords).map(parse), 70),
    "list_files": (lambda: tf.data.Dataset.list_files(str(data / "tfrecord" / "*.tfrecord"))
                   .interleave(tf.data.TFRecordDataset, cycle_length=2).map(parse), 70),
    "slices_interleave": (lambda: tf.data.Dataset.from_tensor_slices(tfrecords).interleave(
        lambda f: tf.data.TFRecordDataset(f).map(parse), cycle_length=3,
        num_parallel_calls=tf.data.AUTOTUNE), 70),
    "text_lines": (lambda: tf.data.TextLineDataset(texts).map(
        lambda s: tf.strings.to_number(s, tf.int64)), 70),
    "batched_files": (lambda: tf.data.TFRecordDataset(tfrecords).map(parse).batch(8), 70),
    "batched_range": (lambda: tf.data.Dataset.range(101).batch(8), 101),
}


result = {}
for name, (make, n) in pipelines.items():
    for policy in ("auto", "file"):
        if name == "batched_range" and policy == "file":
            continue
        dist = tfdp.data.distribute(strategy, make(), 8, shard_policy=policy, shuffle_buffer=16)
        seen, steps = read_epoch_with_collectives(strategy, dist)
        result[f"{name}/{policy}"] = {"ids": seen, "steps": steps, "n": n,
                                      "cardinality": int(dist.cardinality),
                                      "policy": dist.sharding_info["policy"]}
with open(os.path.join(out, f"files-{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank}: files done", flush=True)
