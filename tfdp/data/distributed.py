"""``distribute``: the named stages that turn a source into a ``DistributedDataset``.

Rule: every element is seen once per epoch across the whole cluster. ``distribute`` checks its
arguments, plans the sharding (on every worker alike, before any collective), builds one
pipeline per worker (stream, per-replica batches, prefetch), hands them to
``strategy.distribute_datasets_from_function``, tells Keras the steps per epoch (or unknown,
never TensorFlow's per-worker count of batches) and attaches ``set_epoch``, ``set_position``
and ``sharding_info``. Where every worker's pipeline has exactly the same number of batches
(exact counts, see pipeline.py) the workers' per-step end-of-data all-reduce is turned off;
``sharding_info["end_of_data_agreement"]`` says whether it runs.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tfdp import process_state
from tfdp import _tf_private
from tfdp.strategy import randomness
from tfdp.data import pipeline, service as service_lib
from tfdp.data.errors import DataShardingError, log_once
from tfdp.data.plan import make_plan, service_plan
from tfdp.data.policy import batches_per_pipeline, per_replica_batch_size, steps_per_epoch
from tfdp.data.position import EpochState
from tfdp.data.sources import normalise_service, normalise_source

_latest = None  # weakref to the most recent distribute() result


def distribute(strategy, dataset_or_fn, global_batch_size, shard_policy="auto", *,
               shuffle_buffer=None, seed=0, drop_remainder=False, prefetch=True, parse_fn=None,
               num_examples=None, service=None):
    """Shards, batches per replica and prefetches an input pipeline for ``strategy``.

    Args:
        strategy: a ``tf.distribute.Strategy`` (``tfdp.DataParallelStrategy`` or any other).
        dataset_or_fn: a ``tf.data.Dataset`` (unbatched elements, or batches of
            ``global_batch_size``; datasets reading a list of files shard by file), a
            ``tfdp.data.Files``, a file pattern or list of files (read with ``parse_fn``), or a
            function of ``tf.distribute.InputContext`` returning this worker's elements or
            per-replica batches.
        global_batch_size: examples per step across all replicas of all workers.
        shard_policy: ``"auto"``, ``"file"``, ``"data"`` or ``"off"`` (docs/data.md).
        shuffle_buffer: shuffle elements with this buffer (None: no shuffling); the order
            is the same on every worker and changes every epoch (``set_epoch``).
        seed: the shuffle seed, shared by all workers; under DATA sharding across workers it
            also seeds the source's own unseeded shuffles (docs/data.md, "Unseeded shuffles").
        drop_remainder: drop the last partial global batch. Without it the final step is
            smaller and may give some replicas an empty batch.
        prefetch: ``prefetch(AUTOTUNE)`` per replica.
        parse_fn: for a pattern or list of files: maps one record to one element.
        num_examples: elements in one epoch of the source (after unbatching), when neither
            TensorFlow nor the record-count index knows it; gives Keras exact steps per epoch
            for "data"/"off" sharding. A contradiction with a known count raises.
        service: a ``tfdp.data.Service`` or its address ``"grpc://host:port"``: run the
            pipeline on that tf.data service.

    Returns:
        A ``tf.distribute.DistributedDataset`` for ``model.fit`` or a custom loop, with
        ``set_epoch(epoch)``, ``set_position(epoch, step)`` and ``sharding_info`` (a JSON-ready
        dict: policy, workers, replicas, batch, seed, shuffle, steps per epoch, ...).

    Raises:
        DataShardingError: the batch does not divide over the replicas, too few files for FILE
            sharding, a source tfdp cannot shard, batch or seed as needed, an unreachable
            service. Raised on every worker before any collective starts.

    Example:

    ```python
    train = tfdp.data.distribute(strategy, tfdp.data.Files("data/*.tfrecord", parse),
                                 global_batch_size=256, shuffle_buffer=10_000)
    model.fit(train, epochs=3, callbacks=[tfdp.callbacks.DatasetEpoch(train)])
    ```
    """
    source = normalise_source(dataset_or_fn, parse_fn)
    layout = _Layout.of(strategy, global_batch_size)
    _check_counts(num_examples, shuffle_buffer)
    if service is not None:
        service = normalise_service(service, source)
    plan = _plan(source, shard_policy, service, layout, num_examples, seed)
    state = EpochState(seed, global_batch_size if plan.policy in ("data", "service")
                       else layout.local_replicas * layout.per_replica)
    shuffle_buffer = shuffle_buffer or None
    job_name, worker_stream = None, None
    if plan.policy == "service":
        stream, job_name = service_lib.service_stream(
            plan, service, strategy, layout.num_workers, shuffle_buffer, seed)
    else:
        stream = worker_stream = pipeline.WorkerStream(
            plan, state, shuffle_buffer, global_batch_size, layout.per_replica,
            batches_per_epoch=_batches_per_pipeline(plan, layout, drop_remainder),
            drop_remainder=drop_remainder)
    distributed = strategy.distribute_datasets_from_function(
        pipeline.make_dataset_fn(stream, plan, layout.per_replica, drop_remainder, prefetch))
    counts, steps = _epoch_steps(plan, worker_stream, layout, drop_remainder)
    _tf_private.set_distributed_dataset_cardinality(
        distributed, steps if steps is not None else int(tf.data.UNKNOWN_CARDINALITY))
    agreement = layout.num_workers > 1 and not (
        worker_stream is not None and worker_stream.ends_together
        and _tf_private.skip_end_of_data_agreement(distributed))
    # PyTorch's DistributedSampler.set_epoch, for tf.data: see EpochState.
    distributed.set_epoch = state.set_epoch
    distributed.set_position = _position_setter(plan, state, steps)
    distributed.sharding_info = _sharding_info(
        plan, layout, seed=seed, shuffle_buffer=shuffle_buffer, drop_remainder=drop_remainder,
        steps=steps, counts=counts, service=service, job_name=job_name, agreement=agreement)
    _remember(distributed, strategy, plan.policy, layout.num_workers)
    return distributed


def _remember(distributed, strategy, policy, num_workers):
    """Notes the newest result, and tells the strategy how its elements are dealt to the
    replicas (its random draws follow one device's rows: tfdp.strategy.randomness)."""
    global _latest
    _latest = weakref.ref(distributed)
    randomness.deal_rows(strategy, num_workers if policy == "data" else 1)


def latest_distributed():
    """The most recent ``distribute`` result in this process that is still alive, else None.

    For callbacks that need the dataset ``model.fit`` trains on without being given it.
    """
    return _latest() if _latest is not None else None


class _Layout:
    """Workers, replicas and batch sizes of one ``distribute`` call."""

    def __init__(self, num_workers, num_replicas, per_replica):
        self.num_workers, self.num_replicas, self.per_replica = (
            num_workers, num_replicas, per_replica)
        self.local_replicas = max(1, num_replicas // num_workers)

    @classmethod
    def of(cls, strategy, global_batch_size):
        num_replicas = strategy.num_replicas_in_sync
        return cls(num_workers(strategy), num_replicas,
                   per_replica_batch_size(global_batch_size, num_replicas))


def num_workers(strategy) -> int:
    """Workers in ``strategy``'s cluster (``strategy.cluster``, else its cluster resolver)."""
    cluster = getattr(strategy, "cluster", None)
    if cluster is not None:
        return cluster.num_workers
    resolver = getattr(strategy, "cluster_resolver", None)
    try:
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    except Exception:  # resolvers without a spec mean one worker
        spec = {}
    return max(1, sum(len(v) for k, v in spec.items() if k in ("chief", "worker")))


def _check_counts(num_examples, shuffle_buffer):
    if num_examples is not None and (isinstance(num_examples, bool)
                                     or not isinstance(num_examples, int) or num_examples < 0):
        raise DataShardingError(f"num_examples={num_examples!r} must be a non-negative integer.")
    if shuffle_buffer is not None and (isinstance(shuffle_buffer, bool)
                                       or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0):
        raise DataShardingError(f"shuffle_buffer={shuffle_buffer!r} must be None or an integer >= 0.")


def _plan(source, shard_policy, service, layout: _Layout, num_examples, seed):
    """The plan, the same on every worker; "auto" logs its choice once."""
    global_batch_size = layout.per_replica * layout.num_replicas
    if service is not None:
        if shard_policy != "auto":
            raise DataShardingError(
                f"shard_policy={shard_policy!r} with service=: the tf.data service assigns "
                "elements to trainers itself (distributed_epoch); use shard_policy='auto'.")
        plan = service_plan(source, service, layout.num_workers, global_batch_size,
                            layout.per_replica, num_examples, seed)
    else:
        plan = make_plan(source, shard_policy, layout.num_workers, global_batch_size,
                         layout.per_replica, num_examples, seed)
    if shard_policy == "auto":
        log_once("tfdp.data: shard_policy='auto' chose %r: %s", plan.policy, plan.reason)
    return plan


def _batches_per_pipeline(plan, layout: _Layout, drop_remainder):
    """Per-replica batches each pipeline yields per epoch when the workers can end together
    without agreeing (exact counts, several workers), else None."""
    if plan.counts is None:
        return None
    steps = steps_per_epoch(plan.counts, layout.per_replica, layout.local_replicas,
                            drop_remainder)
    return batches_per_pipeline(steps, plan.counts_exact, layout.num_workers,
                                layout.local_replicas)


def _epoch_steps(plan, worker_stream, layout: _Layout, drop_remainder):
    """(elements per worker, global steps per epoch), each None when unknown; logs unknown."""
    counts, steps = plan.counts, None
    fn_counts = worker_stream.function_counts if worker_stream is not None else []
    # An input function may say how many elements every worker's call yields (from_ray with
    # dataset_rows=); the pipelines check it (assert_cardinality), so the count is exact.
    declared = getattr(plan.source, "elements_per_worker", None) if plan.kind == "function" else None
    if callable(declared) and not plan.batched_per_replica:
        counts = declared(layout.num_workers)
    if (counts is None and plan.kind == "function" and layout.num_workers == 1 and fn_counts
            and fn_counts[0] is not None):
        if plan.batched_per_replica:  # the function's own per-replica batches, L per step
            batches, local = fn_counts[0], layout.local_replicas
            steps = batches // local if drop_remainder else -(-batches // local)
        else:
            counts = [fn_counts[0]]
    if steps is None and counts is not None:
        steps = steps_per_epoch(counts, layout.per_replica, layout.local_replicas,
                                drop_remainder)
    if steps is None:
        log_once("tfdp.data: steps per epoch unknown (%s); Keras ends each epoch when the "
                 "data ends. For an exact count pass num_examples= or run "
                 "tfdp.data.count_records(files) once.", plan.count_note)
    return counts, steps


def _sharding_info(plan, layout: _Layout, *, seed, shuffle_buffer, drop_remainder, steps, counts,
                   service, job_name, agreement) -> dict:
    """What this input computes, JSON-ready (``resume_is_exact`` compares two of them)."""
    return {
        "policy": plan.policy, "reason": plan.reason, "source": plan.kind,
        "num_workers": layout.num_workers, "num_replicas": layout.num_replicas,
        "local_replicas": layout.local_replicas,
        "global_batch_size": layout.per_replica * layout.num_replicas,
        "per_replica_batch_size": layout.per_replica, "seed": int(seed),
        "shuffle": bool(shuffle_buffer), "shuffle_buffer": shuffle_buffer,
        "drop_remainder": bool(drop_remainder), "steps_per_epoch": steps,
        "elements_per_worker": list(counts) if counts is not None else None,
        "num_files": len(plan.files) if plan.files else None,
        "service": service.address if service is not None else None,
        "service_job": job_name,
        # Whether the workers all-reduce "who still has data" at every step (module docstring).
        "end_of_data_agreement": agreement,
        # The source's unseeded shuffles tfdp seeded with `seed` (plan.seed_unseeded).
        "seeded_shuffles": list(plan.seeded),
    }


def _position_setter(plan, state: EpochState, steps):
    def set_position(epoch, step):
        """The next iterator yields epoch ``epoch``'s order from global step ``step``."""
        if plan.policy == "service" and step:
            raise DataShardingError(
                f"set_position({epoch}, {step}) on a tf.data service input: the service assigns "
                "elements to trainers at run time, so which elements the first steps consumed is "
                "not reproducible. Resume at an epoch boundary (step 0) or use shard_policy="
                "'data' without service= for step-exact resumes.")
        if steps is not None and step > steps:
            raise DataShardingError(f"set_position({epoch}, {step}): an epoch has only {steps} "
                                    "steps.")
        state.set_position(epoch, step)

    return set_position


def _forget_latest() -> None:
    global _latest
    _latest = None


process_state.register("latest distributed input", __name__, lambda: _latest is not None,
                       _forget_latest)
