"""``from_ray``: a Ray Data shard (``ray.train.get_dataset_shard``) as ``distribute``'s input.

Rule: Ray Train splits a dataset among its workers itself (``DataConfig``: ``streaming_split``
into equal shares), so the shard a worker gets is already its own and must not be split again:
``from_ray`` gives ``distribute`` an input function, for which ``shard_policy="auto"`` is
"off" (``"data"`` and ``"file"`` are refused by ``distribute``, naming the fix). Its elements
are the shard's rows, unbatched; tfdp batches them per replica. A worker's step therefore
trains on its next L*b rows, and the global step on every worker's next rows together, which
is one device's step on those rows. A shard Ray did not split (a dataset left out of
``DataConfig(datasets_to_split=...)``: every worker reads all of it) keeps rows w, w+W, ... on
worker w, so each row is still trained on once per epoch.

Every iterator over the result starts a new epoch of the shard (Ray Data's rule: every
iteration over a split starts an epoch, all workers together). A resume in the middle of an
epoch (``BackupAndRestore`` with an integer ``save_freq``) skips the rows the first steps
consumed, which is exact only when Ray Data hands each worker the same rows in the same order
again: ``DataConfig(execution_options=ExecutionOptions(preserve_order=True))`` and no
unseeded random transformation in the Ray dataset (shuffle in tfdp with ``shuffle_buffer=``
instead: its order is a function of (seed, epoch)). Without ``preserve_order`` tfdp warns
(a ``UserWarning``), since it cannot make such a resume exact.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from tfdp.data.errors import DataShardingError, log_once

__all__ = ["from_ray", "RayShard"]

# to_tf's options that would change which rows an element holds or their order.
_REFUSED = {
    "batch_size": "tfdp batches per replica itself; read_batch_size= sets how many rows Ray "
                  "hands over at once",
    "drop_last": "pass drop_remainder= to tfdp.data.distribute",
    "local_shuffle_buffer_size": "pass shuffle_buffer= to tfdp.data.distribute (an order that "
                                 "depends on (seed, epoch) only, so a resume is exact)",
    "local_shuffle_seed": "pass seed= to tfdp.data.distribute",
}


class RayShard:
    """This worker's Ray Data shard as an input function of ``tf.distribute.InputContext``.

    Made by :func:`from_ray`; ``tfdp.data.distribute`` calls it once per worker and treats it
    as an input function that shards itself (policy "off").
    """

    def __init__(self, shard, feature_columns, label_columns, read_batch_size, to_tf_options,
                 dataset_rows=None):
        self.shard = shard
        self.feature_columns, self.label_columns = feature_columns, label_columns
        self.read_batch_size = read_batch_size
        self.to_tf_options = dict(to_tf_options)
        self.dataset_rows = dataset_rows

    def elements_per_worker(self, workers: int) -> list | None:
        """Rows each worker's call yields per epoch, from ``dataset_rows`` (None: unknown).
        Ray's split is equal (``streaming_split(equal=True)``: up to W - 1 rows dropped); an
        unsplit dataset keeps rows w, w + W, ... on worker w."""
        if self.dataset_rows is None:
            return None
        if self.splits() is not None:
            return [self.dataset_rows // workers] * workers
        return [len(range(w, self.dataset_rows, workers)) for w in range(workers)]

    def __call__(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        workers, worker = ctx.num_input_pipelines, ctx.input_pipeline_id
        splits = self.splits()
        if splits is not None and splits != workers:
            raise DataShardingError(
                f"the Ray Data shard is one of {splits} splits, but the strategy has {workers} "
                "worker(s). Fix: build the strategy inside the Ray Train function, from the "
                "TF_CONFIG Ray sets (tfdp.DataParallelStrategy() with no cluster argument).")
        self._say_if_unordered()
        rows = self.shard.to_tf(self.feature_columns, self.label_columns,
                                batch_size=self.read_batch_size,
                                **self.to_tf_options).unbatch()
        if splits is None and workers > 1:
            log_once("tfdp.data: the Ray Data iterator is not split among the workers (every "
                     "worker reads the whole dataset): worker %d keeps rows %d, %d+%d, ...",
                     worker, worker, worker, workers)
            rows = rows.shard(workers, worker)
        if splits is not None:
            log_once("tfdp.data: the Ray Data shard is this worker's already (Ray Train split "
                     "the dataset %d ways): not sharded again", splits)
        expected = self.elements_per_worker(workers)
        if expected is not None:
            # Keras then knows the epoch's length, as with any dataset of known length; a
            # wrong dataset_rows fails at the epoch's end with the two counts.
            rows = rows.apply(tf.data.experimental.assert_cardinality(expected[worker]))
        return rows

    def splits(self) -> int | None:
        """How many workers Ray split the dataset among (None: not split)."""
        world_size = getattr(self.shard, "world_size", None)
        return int(world_size()) if callable(world_size) else None

    def _say_if_unordered(self):
        try:
            ordered = bool(self.shard.get_context().execution_options.preserve_order)
        except Exception:  # an iterator without Ray's context: nothing to say
            return
        if not ordered:
            warnings.warn(
                "tfdp.data.from_ray: Ray Data runs this dataset without preserve_order, so a "
                "restarted job may get its rows in another order or on another worker: a resume "
                "in the middle of an epoch (BackupAndRestore with an integer save_freq) would "
                "then train some rows of that epoch twice and others not at all. Fix: pass "
                "dataset_config=ray.train.DataConfig(execution_options=ray.data."
                "ExecutionOptions(preserve_order=True)) to the trainer, or back up per epoch.",
                stacklevel=2)

    def get_config(self):
        return {"feature_columns": self.feature_columns, "label_columns": self.label_columns,
                "read_batch_size": self.read_batch_size, "dataset_rows": self.dataset_rows,
                **self.to_tf_options}


def from_ray(shard, feature_columns, label_columns, *, read_batch_size=256, dataset_rows=None,
             **to_tf_options):
    """A Ray Data shard as the input of ``tfdp.data.distribute``, sharded "off".

    Args:
        shard: ``ray.train.get_dataset_shard("train")`` (a ``ray.data.DataIterator``), inside
            a Ray Train function.
        feature_columns: the model's inputs: a column name (one tensor) or a list of names (a
            dict of tensors), as for ``DataIterator.to_tf``.
        label_columns: the targets, the same way.
        read_batch_size: rows Ray converts to tensors at a time; it does not change which rows
            a step trains on.
        dataset_rows: the whole Ray dataset's row count (``ds.count()`` in the driver, passed
            through ``train_loop_config``). With it Keras knows each epoch's length, as with a
            dataset of known length; without it an epoch ends when the shard does, and Keras
            counts one more optimizer iteration at the end of the first epoch (Adam's bias
            correction and a decaying schedule then run one step ahead: not one device's run
            on a dataset of known length). A wrong count fails at the epoch's end.
        **to_tf_options: more ``DataIterator.to_tf`` arguments (``additional_columns``,
            ``feature_type_spec``, ``label_type_spec``, ``additional_type_spec``,
            ``prefetch_batches``). Its batching and shuffling options are refused, naming
            tfdp's own.

    Returns:
        An input function (a ``RayShard``) for ``distribute(strategy, ..., global_batch_size)``.

    Raises:
        DataShardingError: a batching or shuffling option of ``to_tf`` was given.

    Example:

    ```python
    def train_func(config):
        strategy = tfdp.DataParallelStrategy()
        shard = ray.train.get_dataset_shard("train")
        train = tfdp.data.distribute(strategy, tfdp.data.from_ray(shard, "x", "y"), 256)
        model.fit(train, epochs=3)
    ```
    """
    for name in to_tf_options:
        if name in _REFUSED:
            raise DataShardingError(f"from_ray({name}=...): {_REFUSED[name]}.")
    for name, value, least in (("read_batch_size", read_batch_size, 1),
                               ("dataset_rows", dataset_rows, 0)):
        if name == "dataset_rows" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DataShardingError(f"{name}={value!r} must be an integer >= {least}.")
    return RayShard(shard, feature_columns, label_columns, read_batch_size, to_tf_options,
                    dataset_rows)
