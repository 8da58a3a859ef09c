"""An unseeded shuffle in the user's source under tfdp.data.distribute: seeded by tfdp where the
sharding needs every worker to draw the same order (DATA sharding across workers), left alone
where it is safe (one worker, FILE sharding, no sharding, a tf.data service), refused naming the
fixes where tfdp cannot rebuild the dataset.

The policy is tested as a pure function and on dataset graphs; exactly-once on W "workers" in
one process (each builds its own pipeline from its InputContext, see data_helpers.py: an
unseeded shuffle draws new seeds per pipeline there too), and on 2 and 3 real worker processes
(slow). Guards show the checks can fail: with tfdp's seeding off, the same pipelines lose and
duplicate elements."""

import json

import pytest
import tensorflow as tf

from tfdp import data as tdata
from tfdp.data import graph as graph_lib, plan as plan_lib, policy
from data_helpers import FakeWorker, collect, fake_workers, flat
from launching import run_job, tfdp_run_command, worker_env, worker_script

N = 96
GLOBAL_BATCH = 12


def unseeded():
    return tf.data.Dataset.range(N).shuffle(N)


def ops_of(dataset):
    return graph_lib.random_ops(graph_lib.dataset_graph(dataset))


def epoch_ids(inputs):
    """All element ids the fake workers' pipelines yield in one epoch, sorted."""
    return sorted(i for ids in epoch_orders(inputs) for i in ids)


def epoch_orders(inputs):
    """Each fake worker's element ids of one epoch, in order. One iterator per worker: the
    source's seeded shuffle draws a new order per iterator, so every worker must start as many
    (as Keras's fit does on every worker of a job)."""
    return [[i for step in wi.local_steps() for ids in step for i in ids] for wi in inputs]


@pytest.fixture(autouse=True)
def no_global_seed():
    """No global seed, whatever the tests run before in this process did (Keras's
    set_random_seed sets TensorFlow's): "unseeded" means seeds (0, 0) only without one."""
    tf.random.set_seed(None)
    yield
    tf.random.set_seed(None)


@pytest.fixture
def seeding_off(monkeypatch):
    """tfdp's seeding of unseeded shuffles turned off (for the guards)."""
    monkeypatch.setattr(plan_lib, "_SEED_UNSEEDED", False)


@pytest.fixture
def global_seed():
    """``tf.random.set_seed``, undone after the test (other tests expect no global seed)."""
    yield tf.random.set_seed
    tf.random.set_seed(None)


# --- the policy, pure --------------------------------------------------------------------------

@pytest.mark.parametrize("shard_policy,workers,action", [
    ("data", 2, "seed"), ("data", 3, "seed"),
    ("data", 1, "keep"),      # one pipeline, split among the replicas
    ("off", 1, "keep"), ("off", 2, "keep"),  # every worker reads everything
    ("file", 2, "keep"),      # each worker shuffles only its own files
    ("service", 2, "keep"),   # the dispatcher hands each split to one service worker
])
def test_unseeded_random_action(shard_policy, workers, action):
    got, why = policy.unseeded_random_action(shard_policy, workers, ["shuffle(96)"])
    assert got == action, why
    assert policy.unseeded_random_matters(shard_policy, workers) is (action == "seed")
    assert policy.unseeded_random_action(shard_policy, workers, [])[0] == "keep"


def test_refusal_names_the_shuffle_why_and_the_fixes():
    message = policy.unseeded_random_error(["shuffle(96)"], 2, "rebuilding failed")
    for part in ("shuffle(96)", "without a seed", "each of the 2 workers draws its own order",
                 "twice", "never", "rebuilding failed", "shuffle(n, seed=S)",
                 "shuffle_buffer=n", "tf.random.set_seed(S) on every worker"):
        assert part in message, part


# --- reading the seeds from the graph ----------------------------------------------------------

def test_graph_seeds_unseeded_seeded_and_set_seed(global_seed):
    [op] = ops_of(unseeded())
    assert op.unseeded and op.seeds == (0, 0) and op.describe() == "shuffle(96)"
    [op] = ops_of(tf.data.Dataset.range(N).shuffle(N, seed=1))
    assert not op.unseeded and op.seeds[1] == 1
    # tf.random.set_seed: nonzero seeds, the same for every process that does the same.
    global_seed(7)
    first = ops_of(unseeded())[0].seeds
    global_seed(7)
    assert ops_of(unseeded())[0].seeds == first and 0 not in first


def test_graph_finds_shuffles_in_functions_and_random_sources():
    nested = tf.data.Dataset.range(4).flat_map(lambda x: tf.data.Dataset.range(3).shuffle(3))
    [op] = ops_of(nested)
    assert op.unseeded and op.function and "inside the function" in op.describe()
    sampled = tf.data.Dataset.sample_from_datasets([tf.data.Dataset.range(3)] * 2)
    assert [op.unseeded for op in ops_of(sampled)] == [True]
    two = unseeded().map(lambda x: x * 2).shuffle(8, seed=3)
    assert [(op.buffer_size, op.unseeded) for op in ops_of(two)] == [(8, False), (N, True)]


def test_with_seeds_fixes_the_order_and_keeps_the_elements():
    first, seeded = graph_lib.with_seeds(unseeded(), seed=5)
    second, _ = graph_lib.with_seeds(unseeded(), seed=5)
    assert seeded == ("shuffle(96)",)
    orders = [list(first.as_numpy_iterator()), list(second.as_numpy_iterator())]
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(N))
    assert list(first.as_numpy_iterator()) != orders[0]  # still reshuffles per iterator
    other, _ = graph_lib.with_seeds(unseeded(), seed=6)
    assert list(other.as_numpy_iterator()) != orders[0]  # a function of tfdp's seed
    assert not any(op.unseeded for op in ops_of(first))
    # Guard: without the rewrite two builds draw two orders.
    assert list(unseeded().as_numpy_iterator()) != list(unseeded().as_numpy_iterator())


# --- distribute on W workers in one process ----------------------------------------------------

@pytest.mark.parametrize("workers", [2, 3])
def test_unseeded_shuffle_is_seeded_and_exactly_once(workers):
    inputs = fake_workers(workers, 1, unseeded, GLOBAL_BATCH)
    assert {wi.sharding_info["policy"] for wi in inputs} == {"data"}
    assert all(wi.sharding_info["seeded_shuffles"] == ["shuffle(96)"] for wi in inputs)
    orders = [epoch_orders(inputs) for _ in range(2)]
    for order in orders:  # every epoch exactly once, in a new order
        assert sorted(i for ids in order for i in ids) == list(range(N))
    assert orders[0] != orders[1]


@pytest.mark.parametrize("workers", [2, 3])
def test_guard_without_seeding_elements_are_lost_and_duplicated(seeding_off, workers):
    ids = epoch_ids(fake_workers(workers, 1, unseeded, GLOBAL_BATCH))
    assert len(ids) == N and len(set(ids)) < N  # some twice, some never


@pytest.mark.parametrize("make", [
    lambda: tf.data.Dataset.range(N).shuffle(N, seed=1),                   # seeded by the user
    lambda: tf.data.Dataset.range(N),                                      # shuffle_buffer only
], ids=["seeded", "shuffle_buffer"])
def test_seeded_sources_are_unchanged(make):
    inputs = fake_workers(2, 2, make, GLOBAL_BATCH, shuffle_buffer=16)
    assert inputs[0].sharding_info["seeded_shuffles"] == []
    assert epoch_ids(inputs) == list(range(N))


def test_set_seed_on_every_worker_is_unchanged_and_exactly_once(global_seed):
    def make():
        global_seed(7)  # what every worker process does before building its pipeline
        return unseeded()
    inputs = fake_workers(2, 1, make, GLOBAL_BATCH)
    assert inputs[0].sharding_info["seeded_shuffles"] == []
    assert epoch_ids(inputs) == list(range(N))


def test_one_worker_keeps_the_source_as_it_is(strategy4):
    source = unseeded()
    dist = tdata.distribute(strategy4, source, GLOBAL_BATCH)
    assert dist.sharding_info["policy"] == "off" and dist.sharding_info["seeded_shuffles"] == []
    assert flat(collect(strategy4, dist)) == list(range(N))


def test_pipelines_tfdp_rebuilds_keep_their_elements():
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.range(N, dtype=tf.int64), tf.range(N, dtype=tf.int64)), -1)
    offset = tf.Variable(0, dtype=tf.int64)

    def generator():
        yield from range(N)

    makes = {
        "py_function": lambda: tf.data.Dataset.range(N).map(
            lambda x: tf.py_function(lambda y: y, [x], tf.int64)).shuffle(N),
        "generator": lambda: tf.data.Dataset.from_generator(
            generator, output_signature=tf.TensorSpec([], tf.int64)).shuffle(N),
        "table_and_variable": lambda: tf.data.Dataset.range(N).map(
            lambda x: table.lookup(x) + offset).shuffle(N),
        "nested": lambda: tf.data.Dataset.range(8).flat_map(
            lambda x: tf.data.Dataset.range(12).map(lambda y: 12 * x + y).shuffle(12)),
        "batched": lambda: unseeded().batch(GLOBAL_BATCH),
    }
    for name, make in makes.items():
        inputs = fake_workers(2, 1, make, GLOBAL_BATCH)
        assert inputs[0].sharding_info["seeded_shuffles"], name
        assert epoch_ids(inputs) == list(range(N)), name


def test_refused_naming_the_fixes_where_tfdp_cannot_rebuild(monkeypatch):
    def cannot(dataset, seed):
        raise tf.errors.UnimplementedError(None, None, "no rebuild here")
    monkeypatch.setattr(graph_lib, "with_seeds", cannot)
    for w in range(2):  # every worker refuses alike, in distribute (before any collective)
        with pytest.raises(tdata.DataShardingError, match=r"shuffle\(96\) without a seed.*"
                           r"no rebuild here.*shuffle\(n, seed=S\).*shuffle_buffer=n.*"
                           r"tf.random.set_seed\(S\)"):
            tdata.distribute(FakeWorker(w, 2, 1), unseeded(), GLOBAL_BATCH)


# --- file pipelines ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory):
    d = tmp_path_factory.mktemp("shuffle_files")
    tdata.write_tfrecord_shards(tf.data.Dataset.range(70), d, 5, assign=lambda i: i % 5)
    return sorted(str(p) for p in d.glob("*.tfrecord"))


def test_file_sharding_keeps_a_shuffle_after_the_reader(tfrecords):
    parse = tdata.tfrecord_parser(tf.TensorSpec([], tf.int64))
    def make():
        return tf.data.TFRecordDataset(tfrecords).map(parse).shuffle(20)
    assert [op.unseeded for op in ops_of(make())] == [True]
    inputs = fake_workers(2, 1, make, 4)
    assert inputs[0].sharding_info["policy"] == "file"
    assert inputs[0].sharding_info["seeded_shuffles"] == []  # a worker shuffles its own files
    assert epoch_ids(inputs) == list(range(70))


def test_a_file_pipeline_sharded_by_data_is_seeded(tfrecords):
    def names():  # shuffled, unseeded
        return tf.data.Dataset.list_files(tfrecords)
    parse = tdata.tfrecord_parser(tf.TensorSpec([], tf.int64))
    def make():
        return names().interleave(tf.data.TFRecordDataset).map(parse).shuffle(20)
    inputs = fake_workers(2, 1, make, 4, shard_policy="data")
    assert sorted(inputs[0].sharding_info["seeded_shuffles"]) == ["shuffle(20)", "shuffle(5)"]
    assert epoch_ids(inputs) == list(range(70))


# --- real workers -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("workers,cpu_replicas", [(2, 2), (3, 1)])
def test_real_workers_see_every_element_once(tmp_path, workers, cpu_replicas):
    env = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2)
    cmd = tfdp_run_command(worker_script("shuffle_worker.py"), workers=workers,
                           cpu_replicas=cpu_replicas)
    code, out = run_job(cmd, env, timeout=300)
    assert code == 0, out
    results = [json.loads((tmp_path / f"shuffle-{r}.json").read_text()) for r in range(workers)]

    def union(case, epoch=0):
        return sorted(i for r in results for i in r[case]["epochs"][epoch])

    for case in ("unseeded", "seeded", "shuffle_buffer", "set_seed"):
        assert all(r[case]["policy"] == "data" for r in results), case
        assert union(case) == list(range(N)), case  # every element once, none twice
    assert union("unseeded", 1) == list(range(N))
    assert results[0]["unseeded"]["epochs"][0] != results[0]["unseeded"]["epochs"][1]
    for r in results:
        assert r["unseeded"]["seeded_shuffles"] == ["shuffle(96)"]
        for case in ("seeded", "shuffle_buffer", "set_seed"):  # left as they are
            assert r[case]["seeded_shuffles"] == [], case
    # Guard: the same pipeline without tfdp's seeding loses and duplicates elements.
    assert len(union("guard")) == N and len(set(union("guard"))) < N
