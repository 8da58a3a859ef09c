"""tfdp.data on file pipelines written the TensorFlow way: TFRecordDataset(files),
Dataset.list_files, from_tensor_slices(files).interleave(reader), text and fixed-length
readers, over 5 files of uneven sizes. Exactly once on 1 worker x 4 replicas, on W workers in
one process (each "worker" builds its own pipeline from its InputContext, see data_helpers.py),
and on 2 real worker processes x 2 replicas (slow)."""

import json
import logging

import numpy as np
import pytest
import tensorflow as tf

from tfdp import data as tdata
from tfdp.data import graph as graph_lib
from tfdp import said_once
from data_helpers import collect, fake_workers, flat, global_steps
from launching import run_job, tfdp_run_command, worker_env, worker_script

SIZES = [3, 17, 8, 30, 12]  # uneven on purpose; 70 records, ids 0..69 in file order
ID_SPEC = tf.TensorSpec([], tf.int64)


def ids_of_file(k):
    start = sum(SIZES[:k])
    return list(range(start, start + SIZES[k]))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("five_files")
    bounds = np.cumsum(SIZES)
    tdata.write_tfrecord_shards(tf.data.Dataset.range(70), d / "tfrecord", 5,
                                assign=lambda i: int(np.searchsorted(bounds, i, side="right")))
    (d / "text").mkdir()
    (d / "fixed").mkdir()
    for k in range(5):
        (d / "text" / f"part-{k}.txt").write_text("".join(f"{i}\n" for i in ids_of_file(k)))
        (d / "fixed" / f"part-{k}.bin").write_bytes(
            np.asarray(ids_of_file(k), "<i8").tobytes())
    return d


def pipelines(d):
    """name -> function building a fresh dataset of int64 ids (every record once)."""
    tfrecords = sorted(str(p) for p in (d / "tfrecord").glob("*.tfrecord"))
    texts = sorted(str(p) for p in (d / "text").glob("*.txt"))
    fixed = sorted(str(p) for p in (d / "fixed").glob("*.bin"))
    parse = tdata.tfrecord_parser(ID_SPEC)
    return {
        "tfrecord_list": lambda: tf.data.TFRecordDataset(tfrecords).map(parse),
        "tfrecord_parallel_reads": lambda: tf.data.TFRecordDataset(
            tfrecords, num_parallel_reads=3).map(parse, num_parallel_calls=2),
        "list_files": lambda: tf.data.Dataset.list_files(str(d / "tfrecord" / "*.tfrecord")).interleave(
            tf.data.TFRecordDataset, cycle_length=2).map(parse),
        "slices_interleave": lambda: tf.data.Dataset.from_tensor_slices(tfrecords).interleave(
            lambda f: tf.data.TFRecordDataset(f).map(parse), cycle_length=3,
            num_parallel_calls=tf.data.AUTOTUNE),
        "text_lines": lambda: tf.data.TextLineDataset(texts).map(
            lambda s: tf.strings.to_number(s, tf.int64)),
        "fixed_length": lambda: tf.data.FixedLengthRecordDataset(fixed, 8).map(
            lambda r: tf.reshape(tf.io.decode_raw(r, tf.int64), [])),
    }


INDEXED = {"tfrecord_list", "tfrecord_parallel_reads", "list_files", "slices_interleave"}
PIPELINES = ["tfrecord_list", "tfrecord_parallel_reads", "list_files", "slices_interleave",
             "text_lines", "fixed_length"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("policy", ["auto", "file", "data"])
def test_native_pipeline_exactly_once_on_four_replicas(strategy4, data_dir, name, policy):
    dist = tdata.distribute(strategy4, pipelines(data_dir)[name](), 16, shard_policy=policy,
                            shuffle_buffer=20, seed=1)
    steps = collect(strategy4, dist)
    assert flat(steps) == list(range(70))
    if name in INDEXED:  # counts stored next to the files: exact steps, nothing read up front
        assert dist.cardinality == len(steps) == 5
    else:
        assert dist.cardinality == tf.data.UNKNOWN_CARDINALITY


@pytest.mark.parametrize("name", PIPELINES)
def test_two_workers_shard_native_pipelines_by_file(data_dir, name):
    make = pipelines(data_dir)[name]
    inputs = fake_workers(2, 2, make, 8, shuffle_buffer=10, seed=3)
    assert [wi.sharding_info["policy"] for wi in inputs] == ["file", "file"]
    steps, per_worker = global_steps(inputs)
    assert sorted(i for s in steps for i in s) == list(range(70))  # exactly once
    for w in range(2):  # worker w reads only files w, w+2, ... (in the list's sorted order)
        assert per_worker[w] == sorted(i for k in range(w, 5, 2) for i in ids_of_file(k))
    if name in INDEXED:
        # Worker 0 holds 3+8+12=23 records, worker 1 17+30=47: batches of 2 per replica,
        # 2 replicas per worker -> 12 steps for worker 1; worker 0 (6 steps of data) feeds
        # empty batches in the last 6, as TensorFlow's partial-batch handling does.
        assert inputs[0].cardinality == inputs[1].cardinality == len(steps) == 12


def test_batched_native_pipeline_is_sharded_by_file_and_rebatched(data_dir):
    def make():
        return pipelines(data_dir)["tfrecord_list"]().batch(8)
    inputs = fake_workers(2, 2, make, 8)
    assert inputs[0].sharding_info["policy"] == "file"
    steps, per_worker = global_steps(inputs)
    assert sorted(i for s in steps for i in s) == list(range(70))
    assert per_worker[1] == ids_of_file(1) + ids_of_file(3)
    assert inputs[0].cardinality == len(steps)


def test_too_few_files_raise_for_file_and_fall_back_for_auto(data_dir, caplog):
    make = pipelines(data_dir)["tfrecord_list"]
    with pytest.raises(tdata.DataShardingError, match=r"5 file\(s\) for 6 workers"):
        fake_workers(6, 1, make, 6, shard_policy="file")
    said_once.forget()  # the message may have been said by an earlier test
    with caplog.at_level(logging.INFO, logger="tfdp"):
        inputs = fake_workers(6, 1, make, 6)
    assert inputs[0].sharding_info["policy"] == "data"
    assert any("only 5 file(s) for 6 workers" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    steps, _ = global_steps(inputs)
    assert sorted(i for s in steps for i in s) == list(range(70))


@pytest.mark.parametrize("transform,name", [(lambda d: d.take(50), "take"),
                                            (lambda d: d.skip(5), "skip"),
                                            (lambda d: d.shard(2, 0), "shard")])
def test_positional_transformations_are_not_sharded_by_file(data_dir, transform, name):
    def make():
        return transform(pipelines(data_dir)["tfrecord_list"]())
    want = sorted(int(i) for i in make())
    inputs = fake_workers(2, 2, make, 8)
    assert inputs[0].sharding_info["policy"] == "data"
    assert name in inputs[0].sharding_info["reason"]
    steps, _ = global_steps(inputs)
    assert sorted(i for s in steps for i in s) == want  # the unsharded dataset's elements
    with pytest.raises(tdata.DataShardingError, match=f"{name}\\(\\)"):
        fake_workers(2, 2, make, 8, shard_policy="file")
    # Guard: TensorFlow's rewrite alone would apply it per worker and get another set.
    per_worker = [graph_lib.file_shard(make(), 2, w) for w in range(2)]
    assert sorted(int(i) for ds in per_worker for i in ds) != want


def test_distribute_reads_no_record_before_the_first_step(strategy4, data_dir):
    reads = []
    parse = tdata.tfrecord_parser(ID_SPEC)

    def counted(record):
        value = tf.py_function(lambda r: reads.append(1) or r, [record], tf.string)
        return parse(tf.ensure_shape(value, []))

    files = sorted(str(p) for p in (data_dir / "tfrecord").glob("*.tfrecord"))
    def make():
        return tf.data.Dataset.from_tensor_slices(files).interleave(
            lambda f: tf.data.TFRecordDataset(f).map(counted), cycle_length=2)
    dist = tdata.distribute(strategy4, make(), 16, shuffle_buffer=20)
    assert dist.cardinality == 5 and reads == []  # steps known, not one record read
    inputs = fake_workers(2, 2, make, 8)  # and with FILE sharding across two workers
    assert inputs[0].cardinality == 12 and reads == []
    iterator = iter(dist)
    next(iterator)  # guard: the counter does count reads once training starts
    assert len(reads) > 0


def test_files_source_reads_no_record_before_the_first_step(strategy4, data_dir):
    reads = []
    parse = tdata.tfrecord_parser(ID_SPEC)

    def counted(record):
        value = tf.py_function(lambda r: reads.append(1) or r, [record], tf.string)
        return parse(tf.ensure_shape(value, []))

    files = tdata.Files(str(data_dir / "tfrecord" / "*.tfrecord"), parse_fn=counted)
    dist = tdata.distribute(strategy4, files, 16)
    assert dist.cardinality == 5 and reads == []
    next(iter(dist))
    assert len(reads) > 0


def test_count_records_is_opt_in_and_makes_text_steps_exact(strategy4, data_dir, tmp_path):
    texts = [tmp_path / f"t{k}.txt" for k in range(5)]
    for k, p in enumerate(texts):
        p.write_text("".join(f"{i}\n" for i in ids_of_file(k)))
    def make():
        return tf.data.TextLineDataset([str(p) for p in texts]).map(
            lambda s: tf.strings.to_number(s, tf.int64))
    assert tdata.distribute(strategy4, make(), 16).cardinality == tf.data.UNKNOWN_CARDINALITY
    assert tdata.count_records([str(p) for p in texts], reader="text") == SIZES
    assert tdata.distribute(strategy4, make(), 16).cardinality == 5


def test_a_pattern_that_matches_the_index_is_refused(strategy4, data_dir):
    wide = tf.data.Dataset.list_files(str(data_dir / "tfrecord" / "*"), shuffle=False).interleave(
        tf.data.TFRecordDataset)
    with pytest.raises(tdata.DataShardingError, match="record-count index"):
        tdata.distribute(strategy4, wide, 16)


# --- real processes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, data_dir):
    """One run of mw_data_files.py on 2 worker processes x 2 replicas; its output directory."""
    tmp_path = tmp_path_factory.mktemp("two_workers")
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, TFDP_TEST_DATA=data_dir)
    code, out = run_job(tfdp_run_command(worker_script("mw_data_files.py"), cpu_replicas=2),
                        environ, 240)
    assert code == 0, out
    return tmp_path


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_worker_processes_exactly_once_native_and_batched(two_workers):
    tmp_path = two_workers
    results = [json.loads((tmp_path / f"files-{r}.json").read_text()) for r in range(2)]
    assert results[0].keys() == results[1].keys() and len(results[0]) >= 7
    for key in results[0]:
        a, b = results[0][key], results[1][key]
        assert sorted(a["ids"] + b["ids"]) == list(range(a["n"])), key  # once, none twice
        assert a["steps"] == b["steps"], key  # the workers agreed on every step
        if a["cardinality"] >= 0:
            assert a["steps"] == a["cardinality"] == b["cardinality"], key
        if a["policy"] == "file":  # each worker read only its own files
            for w, r in enumerate((a, b)):
                assert sorted(r["ids"]) == sorted(i for k in range(w, 5, 2)
                                                  for i in ids_of_file(k)), key
    assert results[0]["batched_range/auto"]["policy"] == "data"
    assert results[0]["tfrecord_list/auto"]["policy"] == "file"


@pytest.mark.slow
@pytest.mark.multiworker
def test_no_end_of_data_collective_where_every_worker_has_the_same_steps(two_workers):
    """2 workers x 2 replicas, batch taken inside a tf.function as Keras does. Exact counts
    (record-count index, TensorFlow's cardinality): every worker gets exactly the epoch's steps
    (uneven files padded with empty batches, or cut with drop_remainder), and a step traces no
    collective but its own all-reduce. Unknown or user-given counts keep TensorFlow's per-step
    end-of-data all-reduce (the guard: the same count that would show it gone)."""
    a, b = (json.loads((two_workers / f"agreement-{r}.json").read_text()) for r in range(2))
    for name, per_file in [("file_indexed", True), ("file_indexed_drop", True),
                           ("data_known", False), ("file_unknown", True),
                           ("data_user_count", False)]:
        known = name in ("file_indexed", "file_indexed_drop", "data_known")
        for r in (a, b):
            case = r[name]
            assert case["agreement"] is (not known), name
            # The step's own all_reduce of the batch size (one op per local replica), plus the
            # agreement where it runs (one all-reduce of "replicas with data" per get_next).
            assert len(case["get_next_collectives"]) == (0 if known else 1), name
            assert len(case["step_collectives"]) == (2 if known else 3), name
        assert a[name]["steps"] == b[name]["steps"], name
        if a[name]["cardinality"] >= 0:
            assert a[name]["steps"] == a[name]["cardinality"] == b[name]["cardinality"], name
        seen = a[name]["ids"] + b[name]["ids"]
        if name == "file_indexed_drop":  # whole steps only: worker 0's 23 records give 5
            assert len(seen) == len(set(seen)) == 8 * a[name]["steps"], name
            assert set(a[name]["ids"]) <= {i for k in (0, 2, 4) for i in ids_of_file(k)}
        else:
            n = 70 if per_file else 101
            assert sorted(seen) == list(range(n)), name  # every element once, none twice
    # Uneven files: worker 0 holds 23 records, worker 1 47; both ran the 12 steps of the epoch.
    assert a["file_indexed"]["steps"] == 12 and len(a["file_indexed"]["ids"]) == 23


@pytest.mark.slow
@pytest.mark.multiworker
def test_keras_traces_one_step_per_kind_of_input(two_workers):
    """One model fits an input without the end-of-data agreement, one with it (uneven files,
    unknown counts: worker 0 runs out first), then the first again, on 2 workers. TensorFlow's
    iterator type does not tell them apart; reusing the first trace for the second would leave
    worker 1 waiting in the step's all-reduce (the job would not finish)."""
    fits = [json.loads((two_workers / f"keras-{r}.json").read_text()) for r in range(2)]
    assert [f["agreement"] for f in fits[0]] == [False, True, False]
    assert fits[0] == fits[1]  # the same losses on both workers: they stepped together
