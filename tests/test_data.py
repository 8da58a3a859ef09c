"""tfdp.data in one process: batching, exactly-once, files, policies and errors.
(Multi-worker exactly-once runs in test_multiworker.py.)"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import data as tdata
from helpers import cpu_devices


def collect(strategy, distributed):
    """All element ids per step and replica: [[ids of replica 0, ids of replica 1, ...], ...]."""
    steps = []
    for batch in distributed:
        ids = batch[0] if isinstance(batch, tuple) else batch
        steps.append([np.asarray(v).tolist() for v in strategy.experimental_local_results(ids)])
    return steps


def flat(steps):
    return sorted(i for step in steps for ids in step for i in ids)


@pytest.fixture(scope="module")
def strategy():
    return tfdp.DataParallelStrategy(devices=cpu_devices(2))


@pytest.mark.parametrize("n", [64, 70, 3])
@pytest.mark.parametrize("policy", ["auto", "data", "off"])
def test_every_element_exactly_once(strategy, n, policy):
    ds = tf.data.Dataset.range(n)
    dist = tdata.distribute(strategy, ds, 16, shard_policy=policy)
    steps = collect(strategy, dist)
    assert flat(steps) == list(range(n))
    assert len(steps) == dist.cardinality == -(-n // 16)


def test_one_worker_step_equals_one_global_batch(strategy):
    steps = collect(strategy, tdata.distribute(strategy, tf.data.Dataset.range(64), 16))
    for k, (r0, r1) in enumerate(steps):
        assert r0 == list(range(16 * k, 16 * k + 8)) and r1 == list(range(16 * k + 8, 16 * k + 16))


def test_drop_remainder_gives_full_batches_only(strategy):
    dist = tdata.distribute(strategy, tf.data.Dataset.range(70), 16, drop_remainder=True)
    steps = collect(strategy, dist)
    assert len(steps) == dist.cardinality == 4
    assert all(len(ids) == 8 for step in steps for ids in step)


def test_shuffle_is_seeded_and_changes_per_epoch(strategy):
    dist = tdata.distribute(strategy, tf.data.Dataset.range(64), 16, shuffle_buffer=64, seed=7)
    e1, e2 = collect(strategy, dist), collect(strategy, dist)
    assert flat(e1) == flat(e2) == list(range(64))
    assert e1 != e2  # new order each epoch
    again = collect(strategy, tdata.distribute(strategy, tf.data.Dataset.range(64), 16,
                                               shuffle_buffer=64, seed=7))
    assert again == e1  # same seed, same first epoch: what every worker computes


def test_files_round_trip_with_uneven_sizes(strategy, tmp_path):
    source = tf.data.Dataset.range(50).map(lambda i: (i, tf.cast(i, tf.float32) * 2.0))
    sizes = [5, 30, 15]
    bounds = np.cumsum(sizes)
    paths = tdata.write_tfrecord_shards(source, tmp_path, 3,
                                        assign=lambda i: int(np.searchsorted(bounds, i, side="right")))
    counts = [sum(1 for _ in tf.data.TFRecordDataset(p)) for p in paths]
    assert counts == sizes
    files = tdata.Files(str(tmp_path / "*.tfrecord"), parse_fn=tdata.tfrecord_parser(source.element_spec))
    for policy in ("auto", "file", "data"):
        dist = tdata.distribute(strategy, files, 8, shard_policy=policy, shuffle_buffer=10)
        steps = collect(strategy, dist)
        assert flat(steps) == list(range(50)), policy
        assert len(steps) == dist.cardinality
    # A plain list of files with a parse function works the same way.
    dist = tdata.distribute(strategy, paths, 8, parse_fn=tdata.tfrecord_parser(source.element_spec))
    assert flat(collect(strategy, dist)) == list(range(50))


def test_input_function_gets_the_context(strategy):
    contexts = []

    def fn(ctx):
        contexts.append(ctx)
        return tf.data.Dataset.range(32)

    steps = collect(strategy, tdata.distribute(strategy, fn, 8))
    assert flat(steps) == list(range(32))
    assert contexts[0].num_input_pipelines == 1 and contexts[0].num_replicas_in_sync == 2


def test_choose_shard_policy():
    assert tdata.choose_shard_policy("auto", 2, 4)[0] == "file"
    assert tdata.choose_shard_policy("auto", 4, 2)[0] == "data"
    assert tdata.choose_shard_policy("auto", 2, None)[0] == "data"
    assert tdata.choose_shard_policy("auto", 1, None)[0] == "off"
    with pytest.raises(tdata.DataShardingError, match="fewer|leave workers without data"):
        tdata.choose_shard_policy("file", 4, 2)
    with pytest.raises(tdata.DataShardingError, match="needs a file source"):
        tdata.choose_shard_policy("file", 2, None)
    with pytest.raises(tdata.DataShardingError, match="not one of"):
        tdata.choose_shard_policy("row", 2, None)


def test_steps_per_epoch():
    assert tdata.steps_per_epoch([35, 35], 8, 2, False) == 3
    assert tdata.steps_per_epoch([35, 35], 8, 2, True) == 2
    assert tdata.steps_per_epoch([5, 30], 8, 1, False) == 4
    assert tdata.steps_per_epoch([5, 30], 8, 1, True) == 0


def test_errors_name_the_problem(strategy, tmp_path):
    with pytest.raises(tdata.DataShardingError, match="not divisible by the 2 replicas"):
        tdata.distribute(strategy, tf.data.Dataset.range(10), 15)
    with pytest.raises(tdata.DataShardingError, match="positive integer"):
        tdata.distribute(strategy, tf.data.Dataset.range(10), 0)
    with pytest.raises(tdata.DataShardingError, match="matches no file"):
        tdata.distribute(strategy, tdata.Files(str(tmp_path / "none-*")), 4)
    with pytest.raises(tdata.DataShardingError, match="cannot distribute a list"):
        tdata.distribute(strategy, [1, 2, 3], 4)
    with pytest.raises(tdata.DataShardingError, match="parse_fn applies to file sources"):
        tdata.distribute(strategy, tf.data.Dataset.range(4), 4, parse_fn=lambda r: r)
    with pytest.raises(tdata.DataShardingError, match="must shard itself"):
        tdata.distribute(strategy, lambda ctx: tf.data.Dataset.range(4), 4, shard_policy="data")
    assert issubclass(tdata.DataShardingError, ValueError)


def test_set_epoch_makes_the_order_a_function_of_seed_and_epoch(strategy):
    make = lambda: tdata.distribute(strategy, tf.data.Dataset.range(64), 16, shuffle_buffer=64, seed=3)  # noqa: E731
    a, b = make(), make()
    a.set_epoch(5)
    first = collect(strategy, a)
    assert collect(strategy, a) == first  # fixed within epoch 5, however often iterated
    b.set_epoch(5)
    assert collect(strategy, b) == first  # another process/worker: same order
    b.set_epoch(6)
    other = collect(strategy, b)
    assert other != first and flat(other) == list(range(64))
