"""One input pipeline: the worker's stream of elements for an epoch, batched per replica.

Rules:

* FILE (a ``Files``): worker w opens files w, w+W, ... (shuffled per epoch after the shard,
  so the file->worker assignment and the steps per epoch stay fixed); FILE (a native
  pipeline): TensorFlow's FILE rewrite for pipeline w; DATA: shuffle with the shared seed, skip,
  then keep elements w, w+W, ...; records are skipped before they are parsed.
* Within a worker each of the L local replicas takes consecutive batches of b elements; with
  ``drop_remainder`` only whole local steps (L full batches) are kept. An input function's
  per-replica batches are not batched again.
* With several workers whose element counts are exact, each pipeline yields exactly
  ``batches_per_epoch`` per-replica batches (less L per step a ``set_position`` skips): cut,
  or without ``drop_remainder`` padded with empty batches, the ones TensorFlow's end-of-data
  agreement would substitute. Every worker then runs out at the same step and the agreement
  (a cross-worker all-reduce per step) is turned off. Components other than dense tensors
  (ragged, sparse) cannot be padded here; such pipelines keep the agreement.
* tfdp shards by itself, so TensorFlow's auto-shard is turned off for every pipeline.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private
from tfdp.data import graph as graph_lib
from tfdp.data.errors import DataShardingError, log_once


class WorkerStream:
    """``stream(ctx)``: this input pipeline's elements of one epoch, re-planned per iterator.

    Args:
        plan: the ``Plan``.
        state: the ``EpochState`` (seed of the epoch and elements to skip).
        shuffle_buffer: the shuffle buffer, None for no shuffling.
        global_batch_size: examples per global step.
        per_replica: examples per replica per step.
        batches_per_epoch: per-replica batches each pipeline yields per epoch
            (``policy.batches_per_pipeline``); None: the workers agree on the end at run time.
            When set, the stream comes batched per replica.
        drop_remainder: as ``distribute``'s (used when ``batches_per_epoch`` is set).
    """

    def __init__(self, plan, state, shuffle_buffer, global_batch_size, per_replica,
                 batches_per_epoch=None, drop_remainder=False):
        self.plan, self.state, self.shuffle_buffer = plan, state, shuffle_buffer
        self.global_batch_size, self.per_replica = global_batch_size, per_replica
        self.batches_per_epoch, self.drop_remainder = batches_per_epoch, drop_remainder
        self.function_counts = []   # the input function's cardinality per pipeline
        self.ends_together = batches_per_epoch is not None  # every pipeline: exact length
        self._native_shards = {}

    @property
    def batched(self) -> bool:
        return self.batches_per_epoch is not None

    def __call__(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        w, num_pipelines = ctx.input_pipeline_id, ctx.num_input_pipelines
        local = max(1, ctx.num_replicas_in_sync // num_pipelines)
        source_ds = self._source(ctx)

        # tfdp's own pipeline code needs no AutoGraph (no Python control flow on tensors), and
        # converting it was most of distribute()'s set-up; user functions traced beneath keep it.
        @tf.autograph.experimental.do_not_convert
        def per_iterator(_):
            state = self.state.tensor()
            ds = self._epoch(state, source_ds, w, num_pipelines)
            if not self.batched:
                return ds
            ds = batch_per_replica(ds, self.plan, self.per_replica, local, self.drop_remainder)
            skipped_steps = state[1] // self.state.elements_per_step
            return self._exact_length(ds, self.batches_per_epoch - skipped_steps * local)

        # range(1).flat_map re-runs `per_iterator` for every new iterator, so the epoch's seed
        # and start step are read when the iterator starts; within the epoch they are fixed.
        return tf.data.Dataset.range(1).flat_map(per_iterator)

    def _exact_length(self, batches, num_batches):
        """Exactly ``num_batches`` batches: cut, or padded with empty batches."""
        if self.drop_remainder:  # every worker holds at least this many full batches
            return batches.take(num_batches)
        if not paddable(batches.element_spec):
            self.ends_together = False
            log_once("tfdp.data: the workers agree on the end of the data at every step: "
                     "its elements hold ragged or sparse components, which tfdp does not pad.")
            return batches
        return batches.concatenate(empty_batches(batches.element_spec)).take(num_batches)

    def _source(self, ctx):
        """What this pipeline reads: a dataset, or the ``Files`` (opened per epoch)."""
        plan = self.plan
        if plan.kind == "function":
            source_ds = plan.source(ctx)
            if not isinstance(source_ds, tf.data.Dataset):
                raise DataShardingError(f"the input function returned a "
                                        f"{type(source_ds).__name__}, not a tf.data.Dataset.")
            plan.batched_per_replica = graph_lib.returns_per_replica_batches(
                source_ds, self.global_batch_size, self.per_replica)
            if plan.batched_per_replica:  # a step takes L of the function's batches
                self.state.elements_per_step = max(
                    1, ctx.num_replicas_in_sync // ctx.num_input_pipelines)
            card = int(source_ds.cardinality())
            self.function_counts.append(card if card >= 0 else None)
            return source_ds
        w, num_pipelines = ctx.input_pipeline_id, ctx.num_input_pipelines
        if plan.native_files and num_pipelines > 1:
            if w not in self._native_shards:  # the rewrite runs here, eagerly: errors surface now
                self._native_shards[w] = graph_lib.file_shard(plan.source, num_pipelines, w)
            return self._native_shards[w]
        return plan.source

    def _epoch(self, state_tensor, source_ds, w, num_pipelines):
        plan, shuffle_buffer = self.plan, self.shuffle_buffer
        epoch_seed, skip = state_tensor[0], state_tensor[1]
        if plan.kind == "files":
            names = tf.data.Dataset.from_tensor_slices(plan.files)
            if plan.policy == "file":
                # Shard first: a fixed file->worker assignment keeps the steps per epoch
                # fixed; the order of a worker's files still changes per epoch.
                names = names.shard(num_pipelines, w)
                if shuffle_buffer:
                    names = shuffle_with_seed(names, len(plan.files), epoch_seed)
            ds, salt = plan.source.open(names), 1
        else:
            ds, salt = source_ds, 0
        if shuffle_buffer:
            ds = shuffle_with_seed(ds, shuffle_buffer, epoch_seed + salt)
        ds = ds.skip(skip)  # raw records: the skip never parses
        if plan.policy == "data":
            ds = ds.shard(num_pipelines, w)
        if plan.kind == "files" and plan.source.parse_fn is not None:
            ds = ds.map(_tf_private.autograph_user_function(plan.source.parse_fn),
                        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds


def shuffle_with_seed(ds, buffer_size, seed) -> tf.data.Dataset:
    """``ds.shuffle(buffer_size, seed)``, once per iterator, for a seed tensor (epoch-dependent):
    the order is a function of ``seed`` alone, whatever the user's global seed.

    Why the graph seed is cleared while the shuffle is built: TensorFlow pairs an op seed with
    the global seed and compares the pair with (0, 0) in Python, which raises for a tensor op
    seed when the global seed is 0 (``tf.random.set_seed(0)``, ``keras.utils.set_random_seed(0)``,
    measured); and an order that also depended on the global seed would differ between a job and
    its resumption under another global seed. ``tf.Graph.seed`` is public.
    """
    graph = tf.compat.v1.get_default_graph()
    saved = graph.seed
    graph.seed = None
    try:
        return ds.shuffle(buffer_size, seed=seed, reshuffle_each_iteration=False)
    finally:
        graph.seed = saved


def paddable(spec) -> bool:
    """Whether ``empty_batches`` can make batches of ``spec``: dense tensors with a batch axis."""
    flat = tf.nest.flatten(spec)
    return bool(flat) and all(type(s) is tf.TensorSpec and s.shape.rank not in (None, 0)
                              for s in flat)


def empty_batches(spec) -> tf.data.Dataset:
    """Endless batches of no element for ``spec`` (unknown inner dimensions become 0), as
    TensorFlow's partial-batch handling gives a replica without data."""

    def empty(s):
        shape = [0] + [d if d is not None else 0 for d in s.shape.as_list()[1:]]
        return tf.reshape(tf.constant([], dtype=s.dtype), shape)

    return tf.data.Dataset.from_tensors(tf.nest.map_structure(empty, spec)).repeat()


def batch_per_replica(ds, plan, per_replica, local_replicas, drop_remainder):
    """Per-replica batches of ``per_replica`` elements; ``drop_remainder``: whole local steps."""
    if plan.batched_per_replica:
        if drop_remainder:
            return ds.batch(local_replicas, drop_remainder=True).unbatch()
        return ds
    if drop_remainder:
        # Only whole local steps: L full per-replica batches at a time.
        return ds.batch(per_replica, drop_remainder=True).batch(
            local_replicas, drop_remainder=True).unbatch()
    return ds.batch(per_replica, drop_remainder=False)


def make_dataset_fn(stream, plan, per_replica, drop_remainder, prefetch):
    """The function ``strategy.distribute_datasets_from_function`` calls per input pipeline."""

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        ds = stream(ctx)
        if not getattr(stream, "batched", False):
            local = max(1, ctx.num_replicas_in_sync // ctx.num_input_pipelines)
            ds = batch_per_replica(ds, plan, per_replica, local, drop_remainder)
        options = tf.data.Options()
        # tfdp shards by itself; TensorFlow must not shard again (or fail trying).
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(options)
        return ds.prefetch(tf.data.AUTOTUNE) if prefetch else ds

    return dataset_fn
