"""tfdp.data: input sharding and batching, every example once per epoch across the cluster.

``distribute(strategy, source, global_batch_size)`` returns what
``strategy.distribute_datasets_from_function`` returns, plus ``set_epoch``, ``set_position``
and ``sharding_info``. The guide, with every rule and what was measured, is docs/data.md;
each module states its own rule:

* ``sources``: ``Files``, ``Service`` and what ``distribute`` accepts;
* ``errors``: ``DataShardingError`` (every refusal names the problem and the fix);
* ``plan``: how each input pipeline builds its stream, decided once per ``distribute`` call;
* ``policy``: the pure sharding policy (``choose_shard_policy``, ``steps_per_epoch``,
  ``per_replica_batch_size``, ``resume_is_exact``, ``unseeded_random_action``);
* ``graph``: reading a dataset's graph (files, FILE sharding, batching, unseeded shuffles);
* ``records``: the record-count index and TFRecord writing;
* ``position``: epoch and position state;
* ``service``: the tf.data service;
* ``pipeline``: one worker's stream, batched per replica;
* ``distributed``: ``distribute`` itself, in named stages;
* ``ray_data``: ``from_ray``, a Ray Train worker's Ray Data shard as input (sharded "off").

Example:

```python
train = tfdp.data.distribute(strategy, dataset, global_batch_size=4096, shuffle_buffer=10_000)
model.fit(train, epochs=3, callbacks=[tfdp.callbacks.DatasetEpoch(train)])
```
"""

from tfdp.data.distributed import distribute, latest_distributed
from tfdp.data.errors import DataShardingError
from tfdp.data.policy import (SHARD_POLICIES, choose_shard_policy, per_replica_batch_size,
                              resume_is_exact, steps_per_epoch)
from tfdp.data.records import (INDEX_FILENAME, count_records, record_counts, tfrecord_parser,
                               write_tfrecord_shards)
from tfdp.data.ray_data import from_ray
from tfdp.data.sources import Files, Service

__all__ = ["distribute", "Files", "Service", "DataShardingError", "per_replica_batch_size",
           "choose_shard_policy", "steps_per_epoch", "resume_is_exact", "latest_distributed",
           "write_tfrecord_shards", "tfrecord_parser", "count_records", "record_counts",
           "INDEX_FILENAME", "from_ray", "SHARD_POLICIES"]
