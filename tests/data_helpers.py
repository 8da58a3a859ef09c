"""What the tfdp.data tests share (tests/test_data.py, test_data_files.py, test_data_service.py):
reading the element ids each step and replica got, and W "workers" in one process; and what the
per-device generator tests share (tests/test_tf_private.py on CPU replicas, the GPU tier's
tests/workers/gpu_worker.py on logical GPUs).

Each fake worker calls distribute() itself, as every process of a real job does, with a
strategy stand-in that builds the worker's pipeline from its InputContext. Steps are taken as
TensorFlow's distributed iterator takes them: L consecutive per-replica batches per worker.
(The real multi-process runs are in test_multiworker.py and test_data_files.py.)
"""

import types

import numpy as np
import tensorflow as tf

from tfdp import data as tdata


def collect(strategy, distributed):
    """All element ids per step and replica: [[ids of replica 0, ids of replica 1, ...], ...]."""
    steps = []
    for batch in distributed:
        ids = batch[0] if isinstance(batch, tuple) else batch
        steps.append([np.asarray(v).tolist() for v in strategy.experimental_local_results(ids)])
    return steps


def flat(steps):
    return sorted(i for step in steps for ids in step for i in ids)


class FakeWorker:
    """A strategy stand-in for one worker of ``num_workers``, each with ``local_replicas``."""

    def __init__(self, index, num_workers, local_replicas):
        self.index, self.local = index, local_replicas
        self.num_replicas_in_sync = num_workers * local_replicas
        self.cluster = types.SimpleNamespace(num_workers=num_workers)

    def distribute_datasets_from_function(self, dataset_fn):
        ctx = tf.distribute.InputContext(self.cluster.num_workers, self.index,
                                         self.num_replicas_in_sync)
        return FakeWorkerInput(dataset_fn(ctx), self.local)


class FakeWorkerInput:
    """One fake worker's input: its pipeline, read as ``local_steps``."""

    def __init__(self, dataset, local):
        self.dataset, self.local = dataset, local

    @property
    def cardinality(self):  # what tfdp sets, as on TensorFlow's distributed dataset
        return self._cardinality

    def local_steps(self):
        batches = []
        for b in self.dataset:
            ids = b[0] if isinstance(b, tuple) else b
            batches.append(np.asarray(ids).tolist())
        return [batches[i:i + self.local] for i in range(0, len(batches), self.local)]


def fake_workers(num_workers, local_replicas, make_source, global_batch, **kwargs):
    """One distribute() per worker; returns their inputs (FakeWorkerInput with set_epoch...)."""
    return [tdata.distribute(FakeWorker(w, num_workers, local_replicas), make_source(),
                             global_batch, **kwargs) for w in range(num_workers)]


def global_steps(worker_inputs):
    """Element ids of each global step (sorted), and each worker's ids, for one epoch."""
    per_worker = [wi.local_steps() for wi in worker_inputs]
    n = max(len(p) for p in per_worker)
    steps = [sorted(i for p in per_worker if s < len(p) for b in p[s] for i in b) for s in range(n)]
    return steps, [sorted(i for step in p for b in step for i in b) for p in per_worker]


def step_sets(strategy, distributed):
    """Element ids of each global step (sorted) from a real strategy's distributed dataset."""
    return [sorted(i for ids in step for i in ids) for step in collect(strategy, distributed)]


def read_epoch_with_collectives(strategy, distributed):
    """One epoch of ``distributed`` read as training reads it, with a collective per step (so
    the workers of a job must agree on the number of steps); returns (the element ids this
    worker's replicas got, in order, and the number of steps). For the worker scripts."""

    @tf.function
    def step(ids):
        return strategy.run(lambda i: (i, tf.distribute.get_replica_context().all_reduce(
            "SUM", tf.size(i))), args=(ids,))

    seen, steps = [], 0
    for batch in distributed:
        ids, _ = step(batch[0] if isinstance(batch, tuple) else batch)
        seen.extend(int(i) for part in strategy.experimental_local_results(ids)
                    for i in np.asarray(part))
        steps += 1
    return seen, steps


# Datasets for the per-device generators: plain, string and ragged components (the ragged ones
# travel as variants whose full type tells the remote call they hold host memory), shuffled.
PER_DEVICE_ELEMENTS = {
    "dense": lambda: tf.data.Dataset.range(48).map(
        lambda i: (tf.cast(tf.reshape(tf.range(3 * i, 3 * i + 3), [3]), tf.float32), i))
    .shuffle(20, seed=3).batch(8),
    "strings_and_ragged": lambda: tf.data.Dataset.range(24).map(
        lambda i: {"text": tf.strings.as_string(i), "ragged": tf.ragged.range(i % 4)})
    .batch(4),
}


def per_replica_values(strategy, dataset, epochs=2):
    """Every component of every batch of ``epochs`` epochs, as lists per replica."""
    dist = strategy.experimental_distribute_dataset(dataset)
    out = []
    for _ in range(epochs):
        for batch in dist:
            for part in tf.nest.flatten(batch, expand_composites=True):
                out.append([v.numpy().tolist() for v in strategy.experimental_local_results(
                    part)] if hasattr(part, "values") else part.numpy().tolist())
    return out


def generators_against_tensorflows(strategy, make_dataset):
    """Reads ``make_dataset()`` through ``strategy`` with tfdp's per-device generators twice
    and with TensorFlow's own once (the patch's original put back for the third read).
    Returns the functions the first read traced, those the second added, whether the three
    reads gave the same elements, and how many component lists were compared."""
    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

    generator_class = mdi._PerDeviceGenerator
    patched = vars(generator_class)["__init__"]
    assert getattr(patched, "_tfdp_patch", False), "tfdp's device_input feature is not installed"
    ours = per_replica_values(strategy, make_dataset())
    traced = len(patched.traced)
    again = per_replica_values(strategy, make_dataset())
    retraced = len(patched.traced) - traced
    generator_class.__init__ = patched.__wrapped__
    try:
        tensorflows = per_replica_values(strategy, make_dataset())
    finally:
        generator_class.__init__ = patched
    return {"traced": traced, "retraced": retraced, "equal": ours == again == tensorflows,
            "elements": len(ours)}
