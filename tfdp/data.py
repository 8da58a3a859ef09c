"""Input sharding and batching: every example once per epoch across the whole cluster.

``distribute(strategy, source, global_batch_size)`` returns what
``strategy.distribute_datasets_from_function`` returns. Sources:

* a ``tf.data.Dataset`` of unbatched elements;
* a ``tfdp.data.Files`` (file patterns or TFRecord files plus a parse function);
* a function of ``tf.distribute.InputContext`` returning a dataset of unbatched elements
  for that input pipeline (tfdp then batches per replica; it does not shard again).

Sharding across workers (``shard_policy``):

* ``"file"``: worker w reads files w, w+W, ... (needs at least W files);
* ``"data"``: every worker reads everything and keeps elements w, w+W, ...;
* ``"auto"``: FILE when the source is files and there are at least W of them, else DATA;
  the choice and its reason are logged once;
* ``"off"``: no sharding (each worker sees all data; for sources already split per worker).

Within a worker, each local replica takes consecutive batches of
``global_batch_size / num_replicas`` elements, so with one worker a step trains on exactly
the elements a single device would see in one global batch.

Shuffling (``shuffle_buffer``) uses the same seed on every worker and a new order every
epoch, and happens before sharding, so the workers partition one global permutation. With
``set_epoch`` (or the ``tfdp.callbacks.DatasetEpoch`` callback) epoch e's order is a function
of (seed, e) alone, so a job resumed from a backup sees exactly the uninterrupted order.

Last partial batch: ``drop_remainder=False`` (default) keeps every example; the final
step is smaller and may give some replicas an empty batch, which TensorFlow's
``get_next_as_optional`` handling synchronises across workers (no hang). Dense layers
handle empty batches; TensorFlow's CPU convolution kernels reject them ("input depth must
be evenly divisible by filter depth"), so ConvNets on CPU replicas want
``drop_remainder=True`` or a dataset size divisible by the global batch. With
``drop_remainder=True`` every step has full batches and up to ``global_batch_size - 1``
examples per epoch are skipped (a different set each epoch when shuffling).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Sequence

import tensorflow as tf

from tfdp import _tf_private

__all__ = ["distribute", "Files", "per_replica_batch_size", "choose_shard_policy",
           "write_tfrecord_shards", "tfrecord_parser", "DataShardingError"]

log = logging.getLogger("tfdp")
SHARD_POLICIES = ("auto", "file", "data", "off")
_logged_choices: set = set()


class DataShardingError(ValueError):
    """The input cannot be split across workers/replicas as requested."""


@dataclasses.dataclass(frozen=True)
class Files:
    """A file-based source: file patterns (globbed, sorted) and a parse function.

    Args:
        patterns: a pattern or list of patterns/paths (``tf.io.gfile.glob`` syntax).
        parse_fn: maps one serialized record to one element; None yields raw records.
        reader: ``"tfrecord"`` or ``"text"``; or a callable ``filename -> Dataset``.
        compression_type: passed to the reader (``""``, ``"GZIP"``, ``"ZLIB"``).

    ``distribute`` counts the records of every file once, up front, to report the true
    steps per epoch (otherwise Keras runs an extra empty step each epoch); for very large
    data sets that first read costs one pass over the files.
    """

    patterns: Sequence[str] | str
    parse_fn: Callable | None = None
    reader: str | Callable = "tfrecord"
    compression_type: str = ""

    def filenames(self) -> list[str]:
        patterns = [self.patterns] if isinstance(self.patterns, (str, os.PathLike)) else self.patterns
        names = []
        for p in patterns:
            matched = tf.io.gfile.glob(os.fspath(p))
            if not matched:
                raise DataShardingError(f"file pattern {os.fspath(p)!r} matches no file.")
            names.extend(matched)
        return sorted(set(names))

    def open(self, filenames) -> tf.data.Dataset:
        if callable(self.reader):
            return filenames.interleave(self.reader, num_parallel_calls=tf.data.AUTOTUNE,
                                        deterministic=True)
        cls = {"tfrecord": tf.data.TFRecordDataset, "text": tf.data.TextLineDataset}[self.reader]
        return filenames.interleave(lambda f: cls(f, compression_type=self.compression_type),
                                    cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE,
                                    deterministic=True)


class _ShuffleSeeds:
    """Per-epoch shuffle seeds, the same on every worker.

    The order of epoch e is a pure function of (seed, e). Until ``set_epoch`` is called,
    e counts the iterations of the dataset in this process (a new order each epoch, as
    tf.data's reshuffling); once it is called (``tfdp.callbacks.DatasetEpoch`` does it from
    Keras's epoch counter), e is the training epoch, so a job resumed at epoch e replays
    exactly the order the uninterrupted job would have used.
    """

    def __init__(self, seed):
        self.seed = int(seed)
        self.epoch = None
        self.iterations = 0

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def _next(self):
        if self.epoch is None:
            epoch, self.iterations = self.iterations, self.iterations + 1
        else:
            epoch = self.epoch
        return self.seed * 1_000_003 + epoch

    def seed_tensor(self):
        """A tensor holding this iteration's seed (evaluated once per new iterator)."""
        return tf.py_function(lambda: tf.constant(self._next(), tf.int64), [], tf.int64)


def _shuffled(ds, buffer_size, seeds, salt):
    # range(1).flat_map re-runs its function for every new iterator, so the seed is read
    # at the start of each epoch; within the epoch the order is fixed by it.
    return tf.data.Dataset.range(1).flat_map(
        lambda _: ds.shuffle(buffer_size, seed=seeds.seed_tensor() + salt,
                             reshuffle_each_iteration=False))


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """``global_batch_size / num_replicas``, or an error naming both when it is not whole."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise DataShardingError(f"global_batch_size={global_batch_size!r} must be a positive integer.")
    if global_batch_size % num_replicas:
        lower = global_batch_size // num_replicas * num_replicas
        raise DataShardingError(
            f"global_batch_size={global_batch_size} is not divisible by the "
            f"{num_replicas} replicas in sync; use a multiple of {num_replicas}, e.g. "
            f"{lower or num_replicas} or {lower + num_replicas}.")
    return global_batch_size // num_replicas


def choose_shard_policy(requested: str, num_workers: int, num_files: int | None) -> tuple[str, str]:
    """Returns (policy, reason). ``num_files`` is None for non-file sources. Pure."""
    if requested not in SHARD_POLICIES:
        raise DataShardingError(f"shard_policy={requested!r} is not one of {SHARD_POLICIES}.")
    if requested == "file":
        if num_files is None:
            raise DataShardingError(
                "shard_policy='file' needs a file source (tfdp.data.Files); this source is a "
                "dataset of elements. Use shard_policy='data' or 'auto'.")
        if num_files < num_workers:
            raise DataShardingError(
                f"shard_policy='file' with {num_files} file(s) for {num_workers} workers would "
                f"leave workers without data. Write at least {num_workers} files "
                "(tfdp.data.write_tfrecord_shards) or use shard_policy='data'.")
        return "file", f"{num_files} files for {num_workers} workers"
    if requested in ("data", "off"):
        return requested, "requested"
    if num_workers == 1:
        return "off", "one worker: nothing to shard across workers"
    if num_files is None:
        return "data", ("the source is a dataset of elements, whose files tfdp cannot see: "
                        "every worker reads it and keeps 1/%d" % num_workers)
    if num_files >= num_workers:
        return "file", f"{num_files} files >= {num_workers} workers"
    return "data", (f"only {num_files} file(s) for {num_workers} workers: every worker reads "
                    "all files and keeps 1/%d of the records" % num_workers)


def distribute(strategy, dataset_or_fn, global_batch_size, shard_policy="auto", *,
               shuffle_buffer=None, seed=0, drop_remainder=False, prefetch=True, parse_fn=None):
    """Shards, batches per replica and prefetches an input pipeline for ``strategy``.

    Args:
        strategy: a ``tf.distribute.Strategy`` (``tfdp.DataParallelStrategy`` or any other).
        dataset_or_fn: a dataset of unbatched elements, a ``tfdp.data.Files``, a file
            pattern or list of TFRecord files/patterns (read with ``parse_fn``), or a
            function of ``tf.distribute.InputContext`` returning unbatched elements.
        global_batch_size: examples per step across all replicas of all workers.
        shard_policy: ``"auto"``, ``"file"``, ``"data"`` or ``"off"`` (module docstring).
        shuffle_buffer: shuffle elements with this buffer (None: no shuffling); the order
            is the same on every worker and changes every epoch. The result has
            ``set_epoch(e)`` (as PyTorch's DistributedSampler): the order of epoch e then
            depends only on (seed, e); ``tfdp.callbacks.DatasetEpoch`` calls it from
            ``model.fit``, so resumed jobs replay the same order.
        seed: the shuffle seed, shared by all workers.
        drop_remainder: drop the last partial global batch (see module docstring).
        prefetch: ``prefetch(AUTOTUNE)`` per replica.
        parse_fn: for a pattern or list of files: maps one record to one element.

    Returns:
        A ``tf.distribute.DistributedDataset`` for ``model.fit`` or a custom loop.

    Raises:
        DataShardingError: the batch does not divide over the replicas, too few files for
            FILE sharding, or a source that cannot be sharded the requested way. Raised on
            every worker before any collective starts.
    """
    if isinstance(dataset_or_fn, (str, os.PathLike)) or (
            isinstance(dataset_or_fn, (list, tuple)) and dataset_or_fn
            and all(isinstance(p, (str, os.PathLike)) for p in dataset_or_fn)):
        dataset_or_fn = Files(dataset_or_fn, parse_fn=parse_fn)
    elif parse_fn is not None:
        raise DataShardingError("parse_fn applies to file sources only; map the dataset yourself "
                                "or pass tfdp.data.Files(patterns, parse_fn).")
    num_replicas = strategy.num_replicas_in_sync
    per_replica = per_replica_batch_size(global_batch_size, num_replicas)
    num_workers = _num_workers(strategy)
    if callable(dataset_or_fn) and not isinstance(dataset_or_fn, (tf.data.Dataset, Files)):
        if shard_policy not in ("auto", "off"):
            raise DataShardingError(
                f"shard_policy={shard_policy!r} with an input function: the function receives "
                "the InputContext and must shard itself; use shard_policy='auto' or 'off'.")
        policy, reason = "off", "the input function shards with its InputContext"
        files = None
    elif isinstance(dataset_or_fn, Files):
        files = dataset_or_fn.filenames()
        policy, reason = choose_shard_policy(shard_policy, num_workers, len(files))
    elif isinstance(dataset_or_fn, tf.data.Dataset):
        files = None
        policy, reason = choose_shard_policy(shard_policy, num_workers, None)
    else:
        raise DataShardingError(
            f"cannot distribute a {type(dataset_or_fn).__name__}; pass a tf.data.Dataset of "
            "unbatched elements, a tfdp.data.Files, or a function of InputContext.")
    if shard_policy == "auto" and (policy, reason) not in _logged_choices:
        _logged_choices.add((policy, reason))
        log.warning("tfdp.data: shard_policy='auto' chose %r: %s", policy, reason)

    seeds = _ShuffleSeeds(seed)

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        w, num_pipelines = ctx.input_pipeline_id, ctx.num_input_pipelines
        if files is not None:
            names = tf.data.Dataset.from_tensor_slices(files)
            if policy == "file":
                # Shard first: a fixed file->worker assignment keeps the steps per epoch
                # fixed; the order of a worker's files still changes every epoch.
                names = names.shard(num_pipelines, w)
                if shuffle_buffer:
                    names = _shuffled(names, len(files), seeds, 0)
            ds = dataset_or_fn.open(names)
            if shuffle_buffer:
                ds = _shuffled(ds, shuffle_buffer, seeds, 1)
            if policy == "data":
                ds = ds.shard(num_pipelines, w)
            if dataset_or_fn.parse_fn is not None:
                ds = ds.map(dataset_or_fn.parse_fn, num_parallel_calls=tf.data.AUTOTUNE,
                            deterministic=True)
        elif isinstance(dataset_or_fn, tf.data.Dataset):
            ds = dataset_or_fn
            if shuffle_buffer:
                ds = _shuffled(ds, shuffle_buffer, seeds, 0)
            if policy == "data":
                ds = ds.shard(num_pipelines, w)
        else:
            ds = dataset_or_fn(ctx)
            if not isinstance(ds, tf.data.Dataset):
                raise DataShardingError(
                    f"the input function returned a {type(ds).__name__}, not a tf.data.Dataset.")
            if shuffle_buffer:
                ds = _shuffled(ds, shuffle_buffer, seeds, 0)
        if drop_remainder:
            # Only whole local steps: L full per-replica batches at a time.
            local = max(1, ctx.num_replicas_in_sync // num_pipelines)
            ds = ds.batch(per_replica, drop_remainder=True).batch(
                local, drop_remainder=True).unbatch()
        else:
            ds = ds.batch(per_replica, drop_remainder=False)
        options = tf.data.Options()
        # tfdp shards by itself; TensorFlow must not shard again (or fail trying).
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(options)
        return ds.prefetch(tf.data.AUTOTUNE) if prefetch else ds

    distributed = strategy.distribute_datasets_from_function(dataset_fn)
    # PyTorch's DistributedSampler.set_epoch, for tf.data: see _ShuffleSeeds.
    distributed.set_epoch = seeds.set_epoch
    counts = _elements_per_worker(dataset_or_fn, files, policy, num_workers)
    if counts is not None:
        steps = steps_per_epoch(counts, per_replica, num_replicas // num_workers, drop_remainder)
        _tf_private.set_distributed_dataset_cardinality(distributed, steps)
    return distributed


def steps_per_epoch(elements_per_worker: Sequence[int], per_replica: int, local_replicas: int,
                    drop_remainder: bool) -> int:
    """Global steps in one epoch when worker w holds ``elements_per_worker[w]`` elements.

    Without ``drop_remainder`` the epoch lasts while any worker has data (the others get
    empty batches); with it, only steps where every replica has a full batch count.
    """
    steps = []
    for n in elements_per_worker:
        if drop_remainder:
            steps.append(n // per_replica // local_replicas)
        else:
            steps.append(-(-(-(-n // per_replica)) // local_replicas))
    return min(steps) if drop_remainder else max(steps)


def _elements_per_worker(source, files, policy, num_workers):
    """Element count of each worker's shard, or None when it cannot be known up front."""
    if isinstance(source, tf.data.Dataset):
        n = int(source.cardinality())
        if n < 0:  # unknown or infinite
            return None
        if policy == "data":
            return [len(range(w, n, num_workers)) for w in range(num_workers)]
        return [n] * num_workers
    if files is not None:
        per_file = [_count_records(source, f) for f in files]
        if policy == "file":
            return [sum(per_file[w::num_workers]) for w in range(num_workers)]
        n = sum(per_file)
        if policy == "data":
            return [len(range(w, n, num_workers)) for w in range(num_workers)]
        return [n] * num_workers
    return None


def _count_records(source, filename):
    ds = source.open(tf.data.Dataset.from_tensor_slices([filename]))
    return int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def _num_workers(strategy) -> int:
    cluster = getattr(strategy, "cluster", None)
    if cluster is not None:
        return cluster.num_workers
    resolver = getattr(strategy, "cluster_resolver", None)
    try:
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    except Exception:  # noqa: BLE001  resolvers without a spec mean one worker
        spec = {}
    return max(1, sum(len(v) for k, v in spec.items() if k in ("chief", "worker")))


# --- files ------------------------------------------------------------------------------

def write_tfrecord_shards(dataset: tf.data.Dataset, directory, num_shards: int, *,
                          prefix: str = "shard", assign: Callable[[int], int] | None = None) -> list[str]:
    """Writes a dataset of (nests of) tensors to ``num_shards`` TFRecord files.

    Each element becomes one ``tf.train.Example`` with one bytes feature per component
    (``tf.io.serialize_tensor``); read it back with ``tfrecord_parser(dataset.element_spec)``.

    Args:
        dataset: unbatched elements.
        directory: created if missing.
        num_shards: number of files.
        prefix: file name prefix; files are ``{prefix}-00000-of-00004.tfrecord``.
        assign: element index -> shard index (default round-robin ``i % num_shards``), e.g.
            to make files of uneven sizes.

    Returns:
        The file paths, in shard order.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1.")
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"{prefix}-{i:05d}-of-{num_shards:05d}.tfrecord")
             for i in range(num_shards)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    try:
        for i, element in enumerate(dataset):
            shard = (assign or (lambda k: k % num_shards))(i)
            features = {
                f"c{j}": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[tf.io.serialize_tensor(t).numpy()]))
                for j, t in enumerate(tf.nest.flatten(element))}
            writers[shard].write(tf.train.Example(
                features=tf.train.Features(feature=features)).SerializeToString())
    finally:
        for w in writers:
            w.close()
    return paths


def tfrecord_parser(element_spec):
    """The parse function for files written by ``write_tfrecord_shards``."""
    flat = tf.nest.flatten(element_spec)
    description = {f"c{j}": tf.io.FixedLenFeature([], tf.string) for j in range(len(flat))}

    def parse(record):
        parsed = tf.io.parse_single_example(record, description)
        tensors = [tf.ensure_shape(tf.io.parse_tensor(parsed[f"c{j}"], spec.dtype), spec.shape)
                   for j, spec in enumerate(flat)]
        return tf.nest.pack_sequence_as(element_spec, tensors)

    return parse
