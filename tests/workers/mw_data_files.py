"""Worker for test_data_files.py: native file pipelines (5 uneven files) and already-batched
datasets through tfdp.data.distribute on real workers; dumps, per pipeline and policy, the ids
this worker's replicas saw in one epoch, the steps and the cardinality to OUT/files-<rank>.json.
Then, as Keras trains (next(iterator) inside a tf.function), the end-of-data agreement cases:
per case the collective ops in a traced get_next and in a traced training step, the ids and
steps of one epoch, and sharding_info's end_of_data_agreement.

Env: TFDP_TEST_OUT, TFDP_TEST_DATA (the directory test_data_files.py's fixture wrote)."""

import json
import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf

import tfdp
from data_helpers import read_epoch_with_collectives

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


def collective_ops(concrete_function):
    """Collective ops in a traced function, its nested functions included."""
    graph_def = concrete_function.graph.as_graph_def()
    ops = [n.op for n in graph_def.node]
    ops += [n.op for f in graph_def.library.function for n in f.node_def]
    return sorted(op for op in ops if op.startswith(("Collective", "Nccl")))


def step_functions():
    """A fresh (get_next, train_step) pair. One per distributed dataset: TensorFlow's iterator
    type ignores whether the end-of-data agreement runs, so a function traced for one dataset
    would run another's steps without (or with) it (docs/limits.md)."""

    def replica_step(i):
        # The count waits for the batch. tf.size of a static-shaped batch (drop_remainder,
        # no end-of-data agreement) is a constant, and an all-reduce of a constant starts
        # before next(): in the call that finds the end of the data one worker then cancelled
        # a ring it had started while the other never started it, and both hung (seen once
        # in CI, 2026-11-29; docs/data.md).
        with tf.control_dependencies([i]):
            count = tf.identity(tf.size(i))
        return i, tf.distribute.get_replica_context().all_reduce("SUM", count)

    @tf.function
    def train_step(iterator):
        batch = next(iterator)  # as Keras's train function: the batch is taken inside the step
        return strategy.run(replica_step, args=(batch,))

    return tf.function(lambda iterator: next(iterator)), train_step


agreement = {}
agreement_cases = {  # name -> (make, distribute kwargs)
    "file_indexed": (pipelines["tfrecord_list"][0], {"shard_policy": "file"}),
    "file_indexed_drop": (pipelines["tfrecord_list"][0], {"shard_policy": "file",
                                                          "drop_remainder": True}),
    "data_known": (lambda: tf.data.Dataset.range(101), {"shard_policy": "data"}),
    "file_unknown": (pipelines["text_lines"][0], {"shard_policy": "file"}),
    "data_user_count": (lambda: tf.data.Dataset.range(101).filter(lambda i: i >= 0),
                        {"shard_policy": "data", "num_examples": 101}),
}
for name, (make, kwargs) in agreement_cases.items():
    dist = tfdp.data.distribute(strategy, make(), 8, shuffle_buffer=16, **kwargs)
    iterator = iter(dist)
    get_next, train_step = step_functions()
    record = {"get_next_collectives": collective_ops(get_next.get_concrete_function(iterator)),
              "step_collectives": collective_ops(train_step.get_concrete_function(iterator)),
              "agreement": dist.sharding_info["end_of_data_agreement"],
              "cardinality": int(dist.cardinality), "ids": [], "steps": 0}
    while True:
        try:
            ids, _ = train_step(iterator)
        except tf.errors.OutOfRangeError:
            break
        record["ids"].extend(int(i) for part in strategy.experimental_local_results(ids)
                             for i in np.asarray(part))
        record["steps"] += 1
    agreement[name] = record
with open(os.path.join(out, f"agreement-{rank}.json"), "w") as f:
    json.dump(agreement, f)
print(f"rank {rank}: agreement done", flush=True)


# Keras: one model fits a dataset without the agreement, then one with it, then the first
# again. Keras keeps one train function per model; tfdp traces it once per kind of input, so
# the second fit agrees on the end of data (worker 0 has fewer batches: without the
# agreement it would wait forever for worker 1's all-reduce).
import keras  # noqa: E402  (the Keras half of the script starts here)

with strategy.scope():
    model = keras.Sequential([keras.Input(()), keras.layers.Reshape((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")


def as_pairs(ds):
    return ds.map(lambda i: (tf.cast(i, tf.float32) / 100.0, tf.cast(i, tf.float32) / 100.0))

exact = tfdp.data.distribute(strategy, as_pairs(pipelines["tfrecord_list"][0]()), 8,
                             shard_policy="file")
agreeing = tfdp.data.distribute(strategy, as_pairs(pipelines["text_lines"][0]()), 8,
                                shard_policy="file")
keras_fits = []
for dist in (exact, agreeing, exact):
    history = model.fit(dist, epochs=1, verbose=0)
    keras_fits.append({"agreement": dist.sharding_info["end_of_data_agreement"],
                       "loss": history.history["loss"][-1]})
with open(os.path.join(out, f"keras-{rank}.json"), "w") as f:
    json.dump(keras_fits, f)
print(f"rank {rank}: keras done", flush=True)
