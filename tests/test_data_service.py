"""tfdp.data through a tf.data service: a real dispatcher and two worker servers on 127.0.0.1
in a process of their own; trainers are this process (1 worker x 4 replicas) or two real tfdp-run worker
processes x 2 replicas (slow)."""

import json
import os
import select
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import keras

from tfdp import data as tdata
from helpers import classification_data, initial_weights, mlp
from data_helpers import collect, flat
from launching import run_job, tfdp_run_command, worker_env, worker_script


@pytest.fixture(scope="module")
def service():
    """A dispatcher and two worker servers in a process of their own
    (tests/workers/data_service_servers.py), SIGKILLed at the end of the module."""
    proc = subprocess.Popen([sys.executable, worker_script("data_service_servers.py"), "2"],
                            env=worker_env(), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        address = proc.stdout.readline().strip() if ready else ""
        assert address, f"the tf.data service process printed no address (exit {proc.poll()})"
        yield "grpc://" + address
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()


@pytest.mark.slow
def test_every_element_once_per_epoch_through_the_service(strategy4, service):
    dist = tdata.distribute(strategy4, tf.data.Dataset.range(70).map(lambda i: (i, -i)), 16,
                            shuffle_buffer=20, service=service)
    info = dist.sharding_info
    assert info["policy"] == "service" and info["service"] == service
    assert dist.cardinality == tf.data.UNKNOWN_CARDINALITY  # decided at run time
    for _ in range(2):  # each epoch is a new iteration of the shared job
        steps = collect(strategy4, dist)
        assert flat(steps) == list(range(70))
        assert all(len(ids) <= 4 for step in steps for ids in step)  # per-replica batches


def test_files_and_batched_sources_through_the_service(strategy4, service, tmp_path):
    source = tf.data.Dataset.range(50).map(lambda i: (i, i))
    tdata.write_tfrecord_shards(source, tmp_path, 5, assign=lambda i: min(i // 7, 4))
    files = tdata.Files(str(tmp_path / "*.tfrecord"), parse_fn=tdata.tfrecord_parser(source.element_spec))
    assert flat(collect(strategy4, tdata.distribute(strategy4, files, 8, shuffle_buffer=10,
                                                    service=service))) == list(range(50))
    batched = tf.data.Dataset.range(64).batch(16)
    assert flat(collect(strategy4, tdata.distribute(strategy4, batched, 16,
                                                    service=service))) == list(range(64))


def test_fit_reads_from_the_service(strategy4, service):
    x, y = classification_data(n=96)
    with strategy4.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dist = tdata.distribute(strategy4, tf.data.Dataset.from_tensor_slices((x, y)), 32,
                            service=service)
    seen = []
    cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    history = model.fit(dist, epochs=2, verbose=0, callbacks=[cb])
    assert seen == [0, 1, 2] * 2  # 96 examples / 32 per step, every epoch
    assert np.isfinite(history.history["loss"]).all()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_dispatcher_is_a_bounded_clear_error(strategy4):
    address = f"grpc://127.0.0.1:{free_port()}"
    with pytest.raises(tdata.DataShardingError, match=f"no tf.data service dispatcher answered "
                                                      f"at '{address}' within 1 s"):
        tdata.distribute(strategy4, tf.data.Dataset.range(8), 4,
                         service=tdata.Service(address, connect_timeout_seconds=1))
    with pytest.raises(tdata.DataShardingError, match="not a tf.data service address"):
        tdata.distribute(strategy4, tf.data.Dataset.range(8), 4, service="http://host")


def test_service_refuses_what_it_cannot_do(strategy4, service):
    with pytest.raises(tdata.DataShardingError, match="use shard_policy='auto'"):
        tdata.distribute(strategy4, tf.data.Dataset.range(8), 4, shard_policy="file",
                         service=service)
    with pytest.raises(tdata.DataShardingError, match="input function"):
        tdata.distribute(strategy4, lambda ctx: tf.data.Dataset.range(8), 4, service=service)
    dist = tdata.distribute(strategy4, tf.data.Dataset.range(8), 4, service=service)
    dist.set_position(1, 0)  # epoch boundaries are fine
    with pytest.raises(tdata.DataShardingError, match="assigns elements to trainers at run time"):
        dist.set_position(1, 2)
    exact, reason = tdata.resume_is_exact(dist.sharding_info, dist.sharding_info)
    assert not exact and "run time" in reason


@pytest.mark.slow
@pytest.mark.multiworker
def test_two_worker_processes_train_from_the_service(tmp_path, service):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_SERVICE=service, TF_CPP_MIN_LOG_LEVEL=2)
    code, out = run_job(tfdp_run_command(worker_script("mw_data_service.py"), cpu_replicas=2),
                        environ, 240)
    assert code == 0, out
    results = [json.loads((tmp_path / f"service-{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):  # the two trainers together saw every element once, each epoch
        union = sorted(results[0]["epochs"][epoch] + results[1]["epochs"][epoch])
        assert union == list(range(101)), epoch
        assert results[0]["steps"][epoch] == results[1]["steps"][epoch]
    assert results[0]["job"] == results[1]["job"]  # both joined one job
    # Training from the service: every replica of both workers ends with the same weights.
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert results[0]["fit_batches"] == results[1]["fit_batches"] > 0
