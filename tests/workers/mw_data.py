"""Worker for the multi-worker exactly-once data tests: dumps the element ids each local
replica sees in one epoch, for each shard policy, to OUT/data-<rank>.json."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

import tfdp
from data_helpers import read_epoch_with_collectives

out, files_glob = os.environ["TFDP_TEST_OUT"], os.environ["TFDP_TEST_FILES"]
rank = int(os.environ["TFDP_RANK"])
strategy = tfdp.DataParallelStrategy()
spec = (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.float32))
sources = {
    "dataset": lambda: tf.data.Dataset.range(101).map(lambda i: (i, tf.cast(i, tf.float32))),
    "files": lambda: tfdp.data.Files(files_glob, parse_fn=tfdp.data.tfrecord_parser(spec)),
}
result = {}
for source_name, make in sources.items():
    for policy in ("auto", "data", "file", "off"):
        if source_name == "dataset" and policy == "file":
            continue
        dist = tfdp.data.distribute(strategy, make(), 8, shard_policy=policy, shuffle_buffer=16)
        seen, steps = read_epoch_with_collectives(strategy, dist)
        result[f"{source_name}/{policy}"] = {"ids": seen, "steps": steps,
                                             "cardinality": int(dist.cardinality)}
with open(os.path.join(out, f"data-{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank}: data done", flush=True)
