"""A DLRM-style recommender (tools/dlrm.py: a large Embedding table, small tables, a dot
interaction, bottom and top MLPs) under tfdp and ShardedOptimizer, against one device
(issue 41, part 3).

ShardedOptimizer sends each table read by lookups whole from its owner, in one broadcast
that the receivers' variables adopt; a table too large for one message goes in rounds of
broadcasts whose rows the receivers write by scatter (tfdp/optimizers/exchange.py). The tests
here run both paths (a guard reads the traced step for which ran) and compare the weights
with one device's from the same initial weights.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp import _tf_private
from tfdp.optimizers import exchange
from tfdp.strategy import replica_ops
from helpers import assert_weights_close, cpu_devices
from launching import run_job, tfdp_run_command, worker_env, worker_script
from recommender_cases import GLOBAL_BATCH, SMALL_ROUNDS_BUCKET_BYTES, build, data
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adamw_global_clipnorm": lambda: keras.optimizers.AdamW(0.01, global_clipnorm=0.5),
}


@functools.cache
def one_device(opt_name):
    """One device's weights with ``opt_name`` (each run is deterministic: once per module)."""
    return _train(None, OPTIMIZERS[opt_name]).get_weights()


def _train(strategy, make_optimizer, sharded=False, epochs=1):
    x, y = data()
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = build()
        optimizer = make_optimizer()
        model.compile(tfdp.ShardedOptimizer(optimizer) if sharded else optimizer,
                      "binary_crossentropy")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    model.fit(ds, epochs=epochs, verbose=0, shuffle=False)
    return model


@pytest.fixture
def traced(monkeypatch):
    """Counts, while steps are traced, the broadcasts, the whole-table broadcasts and the
    rows written by scatter."""
    counts = {"broadcasts": 0, "whole": 0, "scatters": 0}
    broadcast_row, write = replica_ops.broadcast_row, exchange._write
    broadcast_whole = exchange._broadcast_whole

    def counting_broadcast(*args, **kwargs):
        counts["broadcasts"] += 1
        return broadcast_row(*args, **kwargs)

    def counting_whole(*args, **kwargs):
        counts["whole"] += 1
        return broadcast_whole(*args, **kwargs)

    def counting_write(target, segment, piece, shape, row, looked_up=False):
        counts["scatters"] += bool(looked_up and len(shape) > 1)
        return write(target, segment, piece, shape, row, looked_up)

    monkeypatch.setattr(replica_ops, "broadcast_row", counting_broadcast)
    monkeypatch.setattr(exchange, "_broadcast_whole", counting_whole)
    monkeypatch.setattr(exchange, "_write", counting_write)
    return counts


def test_broadcast_reaches_every_replica_though_the_sender_drops_its_output():
    """Pins _tf_private.broadcast: TensorFlow's collective broadcast ops on the launcher's
    device, and why broadcast_row marks the send to run: tf.function's automatic control
    dependencies leave these ops out of the ops that must run (an unused send would be
    pruned and the receivers would wait for ever)."""
    from tensorflow.python.framework import auto_control_deps

    assert {"CollectiveBcastSendV2", "CollectiveBcastRecvV2"} <= auto_control_deps.ASYNC_STATEFUL_OPS
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(3))

    def replica_fn():
        me = replica_ops.local_replica_index()
        row = tf.constant([1.0, 2.0, 3.0]) if me == 2 else None
        got = replica_ops.broadcast_row(row, 3, tf.float32)
        return tf.constant([0.0, 0.0, 0.0]) if me == 2 else got  # the sender drops its output

    step = tf.function(lambda: strategy.run(replica_fn))
    graph = step.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("CollectiveBcastSendV2") == 1 and types.count("CollectiveBcastRecvV2") == 2
    values = [v.numpy().tolist() for v in strategy.experimental_local_results(step())]
    assert values == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
    assert hasattr(_tf_private, "broadcast")


def test_whole_tables_are_the_looked_up_matrices_up_to_the_cap():
    shapes = {0: (1000, 8), 1: (8,), 2: (10, 4), 3: (5000, 8)}
    assert exchange.whole_tables(shapes, {0, 2, 3}, 4) == [0, 2, 3]
    assert exchange.whole_tables(shapes, {0, 1}, 4) == [0]  # a vector is no table; 2 not looked up
    cap = exchange._WHOLE_TABLE_MAX_BYTES
    assert exchange.whole_tables({0: (cap // 32, 8), 1: (cap // 32 + 1, 8)}, {0, 1}, 4) == [0]


@pytest.mark.parametrize("opt_name,path", [
    ("adam", "whole"), ("adam", "rounds"),
    pytest.param("adagrad", "whole", marks=pytest.mark.slow),
    pytest.param("adamw_global_clipnorm", "whole", marks=pytest.mark.slow)])
def test_dlrm_under_sharded_optimizer_trains_like_one_device(opt_name, path, traced, monkeypatch):
    if path == "rounds":  # as for a table over the cap: rounds of broadcasts, rows scattered
        monkeypatch.setattr(exchange, "_WHOLE_TABLE_MAX_BYTES", 0)
    reference = one_device(opt_name)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(4),
                                         bucket_bytes=SMALL_ROUNDS_BUCKET_BYTES)
    model = _train(strategy, OPTIMIZERS[opt_name], sharded=True)
    # Guard: the path under test ran.
    if path == "whole":  # the three tables (the large one and two small ones), no scatter
        assert traced["whole"] >= 3 and traced["scatters"] == 0, traced
    else:
        assert traced["whole"] == 0 and traced["broadcasts"] >= 4 and traced["scatters"] >= 4, traced
    assert_weights_close(model.get_weights(), reference)
    for var in model.trainable_variables:  # every replica holds the same table
        parts = [np.asarray(p) for p in strategy.experimental_local_results(var.value)]
        for p in parts[1:]:
            np.testing.assert_array_equal(p, parts[0])


@pytest.mark.slow
def test_dlrm_under_tfdp_trains_like_one_device():
    reference = one_device("adam")
    model = _train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), OPTIMIZERS["adam"])
    assert_weights_close(model.get_weights(), reference)


@pytest.mark.slow
def test_dlrm_on_two_workers_under_sharded_optimizer_trains_like_one_device(tmp_path):
    """2 workers x 2 replicas: the whole-table broadcasts cross the process boundary (gRPC)."""
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2)
    code, out = run_job(tfdp_run_command(worker_script("mw_recommender.py"), cpu_replicas=2),
                        environ, 240)
    assert code == 0, out
    tables = [int(n) for n in re.findall(r"(\d+) whole-table broadcasts", out)]
    assert tables and min(tables) >= 3, out  # guard: the tables went whole (each worker says)
    reference = one_device("adam")
    for rank in range(2):
        saved = dict(np.load(tmp_path / f"weights-{rank}.npz"))
        assert_weights_close([saved[f"arr_{i}"] for i in range(len(reference))], reference)
