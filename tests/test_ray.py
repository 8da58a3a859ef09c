"""tfdp under Ray Train (Ray 2.60: ``ray.train.tensorflow.TensorflowTrainer``, Train V2), on a
real local Ray started on loopback, as docs/clusters.md's recipe runs it.

One Ray head for the module (``ray.init(_node_ip_address="127.0.0.1")``), shut down at the end;
two jobs on it, each 2 Ray workers running tests/workers/ray_train.py:

* ``two_sources``: 2 replicas per worker; a model trained on a tf.data source with
  ``tfdp.callbacks.RayReport`` (metrics and checkpoint in the ``Result``), then a model trained
  on each worker's Ray Data shard through ``tfdp.data.from_ray``;
* ``killed``: 1 replica per worker; the Ray Data shard with ``BackupAndRestore(save_freq=3)``;
  rank 1 SIGKILLs itself after global step 8 and Ray restarts the group
  (``FailureConfig(max_failures=1)``).

Both train like one device on the same global batches. The Ray Data shard has no known length,
and Keras counts one more optimizer iteration at the end of an epoch of unknown length (one
device too; docs/clusters.md), so the one-device reference of the Ray Data runs reads its
batches from a dataset of unknown length as well: the same computation.
"""

import importlib.util
import json
import os
import signal
import sys

import numpy as np
import pytest

from launching import ROOT, TESTS, WORKERS

pytestmark = [
    pytest.mark.slow, pytest.mark.multiworker,
    # A job takes 30-100 s on a loaded 2-core host; a hung collective ends here, not at 600 s.
    pytest.mark.timeout(400),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="Ray is not installed (pip install 'ray[train]', in tfdp's test "
                              "extra)"),
]

ROWS, GLOBAL_BATCH, EPOCHS = 192, 16, 2   # 12 steps per epoch
SAVE_FREQ, KILL_AFTER = 3, 8              # backups after steps 3 and 6; killed after step 8
RTOL = 1e-5


@pytest.fixture(scope="module")
def ray_on_loopback():
    """A local Ray head on 127.0.0.1 for the module; its workers import tests/ and
    tests/workers/ (PYTHONPATH, inherited from this process when Ray starts)."""
    import ray

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "TF_CONFIG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [TESTS, WORKERS, ROOT] + ([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else []))
    os.environ.pop("TF_CONFIG", None)
    try:
        ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
                 object_store_memory=256 * 2**20, log_to_driver=False)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        yield ray
    finally:
        ray.shutdown()
        for s, handler in handlers.items():  # ray.init installs its own SIGTERM handler
            if handler is not None:  # None: set outside Python, nothing of ours to put back
                signal.signal(s, handler)


def ray_dataset(ray):
    from helpers import classification_data

    x, y = classification_data(n=ROWS)
    return ray.data.from_items([{"id": i, "x": x[i], "y": int(y[i])} for i in range(ROWS)],
                               override_num_blocks=8)


def fit(ray, train_fn, out, name, replicas, failure_config=None, **config):
    """Runs ``train_fn`` on 2 Ray workers with the Ray Data dataset as "train"; the Result."""
    from ray.data import ExecutionOptions
    from ray.train import DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    sys.path.insert(0, WORKERS)
    try:
        import ray_train  # pickled by reference: the workers import it from PYTHONPATH
    finally:
        sys.path.remove(WORKERS)
    os.makedirs(out, exist_ok=True)
    trainer = TensorflowTrainer(
        getattr(ray_train, train_fn),
        train_loop_config=dict(out=str(out), rows=ROWS, global_batch=GLOBAL_BATCH,
                               epochs=EPOCHS, replicas=replicas, **config),
        scaling_config=ScalingConfig(num_workers=2),
        datasets={"train": ray_dataset(ray)},
        # The rows reach each worker in the same order on every run: a mid-epoch resume is exact.
        dataset_config=DataConfig(execution_options=ExecutionOptions(preserve_order=True)),
        run_config=RunConfig(storage_path=str(out / "storage"), name=name,
                             failure_config=failure_config or FailureConfig()))
    return trainer.fit()


@pytest.fixture(scope="module")
def two_sources(ray_on_loopback, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray-two-sources")
    return fit(ray_on_loopback, "train_two_sources", out, "two-sources", replicas=2), out


@pytest.fixture(scope="module")
def killed(ray_on_loopback, tmp_path_factory):
    from ray.train import FailureConfig

    out = tmp_path_factory.mktemp("ray-killed")
    result = fit(ray_on_loopback, "train_with_backups", out, "killed", replicas=1,
                 failure_config=FailureConfig(max_failures=1), backup_dir=str(out / "backup"),
                 save_freq=SAVE_FREQ, kill_rank=1, kill_after_step=KILL_AFTER)
    return result, out


# --- helpers ---------------------------------------------------------------------------------

def read(out, name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def weights(out, name, rank):
    with np.load(os.path.join(out, f"weights-{name}-{rank}.npz")) as w:
        return [w[f"arr_{i}"] for i in range(len(w.files))]


def max_relative_difference(a, b):
    return max(float(np.abs(u - v).max() / max(np.abs(v).max(), 1e-12)) for u, v in zip(a, b))


def one_device(order, unknown_length):
    """One device, no strategy, Adam, on the rows in ``order`` in global batches."""
    import keras
    import tensorflow as tf
    from helpers import classification_data, initial_weights, mlp

    x, y = classification_data(n=ROWS)
    ds = tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(GLOBAL_BATCH)
    if unknown_length:
        ds = ds.filter(lambda *_: True)
    model = mlp()
    model.set_weights(initial_weights(mlp))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(ds, epochs=EPOCHS, verbose=0)
    return model.get_weights()


def global_order(shards):
    """One device's row order: step s takes the next GLOBAL_BATCH / 2 rows of each shard."""
    per_worker = GLOBAL_BATCH // len(shards)
    steps = len(shards[0]) // per_worker
    return np.array([i for s in range(steps) for shard in shards
                     for i in shard[s * per_worker:(s + 1) * per_worker]])


def assert_every_row_once(shards):
    rows = [i for shard in shards for i in shard]
    assert sorted(rows) == list(range(ROWS)), "Ray's split lost or repeated rows"
    assert len({len(shard) for shard in shards}) == 1


# --- addresses --------------------------------------------------------------------------------

def test_ray_workers_address_each_other_on_loopback(two_sources):
    _, out = two_sources
    clusters = [read(out, f"cluster-{rank}.json") for rank in range(2)]
    for rank, c in enumerate(clusters):
        ray_addresses = c["tf_config"]["cluster"]["worker"]
        assert c["tf_config"]["task"] == {"type": "worker", "index": rank}
        assert c["source"] == "TF_CONFIG" and c["replicas"] == 4
        assert c["workers"] == [f"127.0.0.1:{a.rpartition(':')[2]}" for a in ray_addresses]
        # The guard: Ray itself names its node IP, which is not loopback although Ray was
        # started on 127.0.0.1 (Ray resolves a loopback node address to the host's).
        if c["node_ip"] not in ("127.0.0.1", "::1"):
            assert {a.rpartition(":")[0].strip("[]") for a in ray_addresses} == {c["node_ip"]}
            assert any("Ray Train: every worker on this node" in n for n in c["notes"])


def test_workers_on_several_nodes_keep_ray_addresses():
    from tfdp.cluster import ray_train
    from tfdp.cluster.tf_config import parse_dict

    def layout(*hosts):
        return parse_dict({"cluster": {"worker": [f"{h}:{4000 + i}" for i, h in enumerate(hosts)]},
                           "task": {"type": "worker", "index": 0}})

    one_node = ray_train.on_loopback(layout("10.0.0.5", "10.0.0.5"), "10.0.0.5")
    assert one_node.workers == ("127.0.0.1:4000", "127.0.0.1:4001")
    assert ray_train.on_loopback(layout("10.0.0.5", "10.0.0.6"), "10.0.0.5").workers == \
        ("10.0.0.5:4000", "10.0.0.6:4001")
    assert ray_train.on_loopback(layout("10.0.0.5", "10.0.0.5"), None).workers == \
        ("10.0.0.5:4000", "10.0.0.5:4001")                            # not in Ray
    with_chief = parse_dict({"cluster": {"chief": ["10.0.0.5:1"], "worker": ["10.0.0.5:2"]},
                             "task": {"type": "chief", "index": 0}})
    assert ray_train.on_loopback(with_chief, "10.0.0.5") == with_chief  # not Ray's layout


# --- training like one device -------------------------------------------------------------

def test_tf_data_source_trains_like_one_device(two_sources):
    from helpers import classification_data

    _, out = two_sources
    x, _ = classification_data(n=ROWS)
    reference = one_device(np.arange(len(x)), unknown_length=False)
    differences = [max_relative_difference(weights(out, "tfdata", rank), reference)
                   for rank in range(2)]
    print(f"tf.data, 2 workers x 2 replicas: max relative difference {max(differences):.1e}")
    assert max(differences) <= RTOL
    assert read(out, "cluster-0.json")["sharding"]["tf_data"]["policy"] == "data"


def test_ray_data_shard_trains_like_one_device_every_row_once(two_sources):
    _, out = two_sources
    shards = [read(out, f"ids-{rank}-1.json") for rank in range(2)]
    assert_every_row_once(shards)
    reference = one_device(global_order(shards), unknown_length=True)
    differences = [max_relative_difference(weights(out, "raydata", rank), reference)
                   for rank in range(2)]
    print(f"Ray Data, 2 workers x 2 replicas: max relative difference {max(differences):.1e}")
    assert max(differences) <= RTOL
    # The guard on the reference: one device on a dataset of known length ends elsewhere, by
    # Keras's extra iteration count at the end of the first epoch of unknown length.
    known = max_relative_difference(weights(out, "raydata", 0),
                                    one_device(global_order(shards), unknown_length=False))
    print(f"Ray Data against one device on a dataset of known length: {known:.1e}")
    assert known > 100 * RTOL
    # With the dataset's row count (from_ray(dataset_rows=)) the epochs have a known length:
    # one device on a dataset of known length, the reference above that the shard missed.
    counted = [max_relative_difference(weights(out, "raydata_counted", rank),
                                       one_device(global_order(shards), unknown_length=False))
               for rank in range(2)]
    print(f"Ray Data with dataset_rows against one device, known length: {max(counted):.1e}")
    assert max(counted) <= RTOL
    sharding = read(out, "cluster-0.json")["sharding"]
    assert sharding["counted"]["steps_per_epoch"] == ROWS // GLOBAL_BATCH
    assert sharding["ray_data"]["steps_per_epoch"] is None
    assert sharding["ray_data"]["policy"] == "off"          # chosen by "auto"
    # The guard: the same rows as a plain dataset get DATA sharding, which would keep half of
    # each worker's rows (every worker keeps 1/2 of what it reads) and lose the rest.
    assert sharding["plain"]["policy"] == "data"


def test_result_holds_the_chiefs_metrics_and_checkpoint(two_sources):
    import keras

    result, out = two_sources
    history = read(out, "history-tfdata-0.json")
    assert result.metrics == pytest.approx({"loss": history["loss"][-1],
                                            "acc": history["accuracy"][-1]})
    assert len(result.metrics_dataframe) == EPOCHS
    with result.checkpoint.as_directory() as directory:
        assert os.listdir(directory) == ["model.keras"]
        saved = keras.models.load_model(os.path.join(directory, "model.keras")).get_weights()
    assert max_relative_difference(saved, weights(out, "tfdata", 0)) == 0.0


# --- a worker killed mid-epoch ----------------------------------------------------------------

def test_sigkilled_worker_restarts_and_resumes_from_the_last_backup(killed):
    _, out = killed
    steps = {(rank, attempt): [int(s) for s in open(out / f"steps-{rank}-{attempt}.txt")]
             for rank in range(2) for attempt in (1, 2)}
    per_epoch = ROWS // GLOBAL_BATCH
    last_backup = KILL_AFTER // SAVE_FREQ * SAVE_FREQ
    assert steps[1, 1] == list(range(1, KILL_AFTER + 1))
    for rank in range(2):
        assert not os.path.exists(out / f"start-{rank}-3")     # one restart
        # The restart resumes after the last backup: at most one backup interval redone.
        assert steps[rank, 2] == list(range(last_backup + 1, EPOCHS * per_epoch + 1))
        redone = KILL_AFTER - (steps[rank, 2][0] - 1)
        assert 0 < redone <= SAVE_FREQ
    # Ray Data hands each worker the same rows in the same order on the restarted run, so the
    # resumed epoch's rows are the uninterrupted ones (the test reads them once per attempt).
    shards = [read(out, f"ids-{rank}-1.json") for rank in range(2)]
    assert shards == [read(out, f"ids-{rank}-2.json") for rank in range(2)]
    assert_every_row_once(shards)
    reference = one_device(global_order(shards), unknown_length=True)
    differences = [max_relative_difference(weights(out, "resumed", rank), reference)
                   for rank in range(2)]
    print(f"killed and resumed, 2 workers x 1 replica: max relative difference "
          f"{max(differences):.1e}")
    assert max(differences) <= RTOL


# --- the API's own checks (no Ray job) -------------------------------------------------------

def test_ray_report_and_from_ray_refuse_what_they_cannot_do():
    import keras
    import tfdp

    with pytest.raises(ValueError, match="checkpoint='saved_model'"):
        tfdp.callbacks.RayReport(checkpoint="saved_model")
    with pytest.raises(ValueError, match="report_on='batch_end'"):
        tfdp.callbacks.RayReport(report_on="batch_end")
    for option, fix in (("batch_size", "read_batch_size"), ("local_shuffle_buffer_size",
                                                             "shuffle_buffer")):
        with pytest.raises(tfdp.data.DataShardingError, match=fix):
            tfdp.data.from_ray(object(), "x", "y", **{option: 8})
    for bad in (-1, 2.5, True):
        with pytest.raises(tfdp.data.DataShardingError, match="dataset_rows"):
            tfdp.data.from_ray(object(), "x", "y", dataset_rows=bad)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    with pytest.raises(RuntimeError, match="only inside the train function"):
        model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0,
                  callbacks=[tfdp.callbacks.RayReport()])


class _FakeShard:
    """What ``from_ray`` uses of a Ray ``DataIterator``: ``to_tf``, ``get_context`` and, for
    a shard Ray split among the workers, ``world_size``."""

    def __init__(self, rows, preserve_order=True, splits=None):
        from types import SimpleNamespace

        self.rows = rows
        self.context = SimpleNamespace(execution_options=SimpleNamespace(
            preserve_order=preserve_order))
        if splits is not None:
            self.world_size = lambda: splits

    def get_context(self):
        return self.context

    def to_tf(self, features, labels, batch_size):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(
            (np.arange(self.rows, dtype="float32"), np.arange(self.rows))).batch(batch_size)


def test_from_ray_keeps_a_split_shard_shards_an_unsplit_one_and_warns_where_unordered():
    import tensorflow as tf
    import tfdp

    def rows(shard, workers=2, worker=1):
        ctx = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=worker,
                                         num_replicas_in_sync=workers)
        return [int(x) for x, _ in tfdp.data.from_ray(shard, "x", "y", read_batch_size=4)(ctx)]

    assert rows(_FakeShard(10, splits=2)) == list(range(10))    # Ray's split: all of it
    assert rows(_FakeShard(10)) == [1, 3, 5, 7, 9]               # not split: rows w, w+W, ...
    with pytest.raises(tfdp.data.DataShardingError, match="one of 3 splits"):
        rows(_FakeShard(10, splits=3))
    with pytest.warns(UserWarning, match="preserve_order=True"):
        rows(_FakeShard(10, preserve_order=False, splits=2))


def test_dataset_rows_gives_each_worker_its_count_and_a_wrong_one_fails():
    import tensorflow as tf
    import tfdp

    def stream(shard, dataset_rows, worker=1):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker,
                                         num_replicas_in_sync=2)
        return tfdp.data.from_ray(shard, "x", "y", dataset_rows=dataset_rows)(ctx)

    split = tfdp.data.from_ray(_FakeShard(5, splits=2), "x", "y", dataset_rows=11)
    assert split.elements_per_worker(2) == [5, 5]  # Ray's equal split drops the odd row
    unsplit = tfdp.data.from_ray(_FakeShard(11), "x", "y", dataset_rows=11)
    assert unsplit.elements_per_worker(2) == [6, 5]  # rows w, w + 2, ...
    assert int(stream(_FakeShard(5, splits=2), 11).cardinality()) == 5
    assert len(list(stream(_FakeShard(5, splits=2), 11))) == 5
    # A count that does not match the shard fails at the end of the epoch, naming both.
    with pytest.raises(tf.errors.FailedPreconditionError, match="expected to contain 6"):
        list(stream(_FakeShard(5, splits=2), 12))
    assert tfdp.data.from_ray(_FakeShard(5), "x", "y").elements_per_worker(2) is None
