"""tfdp.horovod: Horovod's API on tfdp (issue 34).

In-process (quick): the ranks' definitions, the errors before ``init()``, the GPU each
process of a host takes, horovodrun's flags on ``tfdp-run`` (the pure translation, and one
TensorFlow-free job), DistributedOptimizer's class and saving, the learning-rate callbacks'
schedules, the TensorFlow-private calls ``init()`` relies on, and the save rendezvous of a
sharded optimizer (a fake coordination service). Multi-process (slow, real ``tfdp-run`` jobs,
each bounded by a timeout): every collective against numpy in one job per size; a
Horovod-style Keras ``fit`` (on one host, and on two loopback ssh hosts) and Horovod's custom
loops, each from different random weights on every rank, against one process trained on the
same global batches; the chief saving a ShardedOptimizer model alone under the strategy.
"""

import json
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp.horovod as hvd
import tfdp.horovod.keras as hvd_keras
from helpers import classification_data, mlp
from launching import run_job, tfdp_run_command, worker_env, worker_script
from tfdp import _tf_private
from tfdp.cluster import ClusterConfig
from tfdp.horovod import _runtime
from tfdp.launcher import horovodrun
from tfdp.launcher.cli import parse_args
from tfdp.optimizers import sharded_state
from loopback_sshd import launch_over_ssh

LAUNCH_TIMEOUT = 180
LOCAL_BATCH = 8
multiworker = [pytest.mark.slow, pytest.mark.multiworker]


def launch(tmp_path, script, workers=2, **env):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, **env)
    code, out = run_job(tfdp_run_command(worker_script(script), workers=workers,
                                         flags=["--output", "all"]), environ, LAUNCH_TIMEOUT)
    assert code == 0, out[-4000:]
    return out


# --- ranks and errors ---------------------------------------------------------------------

def cluster(workers, rank):
    spec = {"worker": list(workers)}
    return ClusterConfig(workers=list(workers), task_type="worker", task_index=rank,
                         cluster_spec=spec)


def test_local_and_cross_ranks_follow_horovods_definitions():
    hosts = ["a:1", "a:2", "b:1", "b:2", "c:1", "c:2"]
    seen = [_runtime.placement(cluster(hosts, r)) for r in range(6)]
    assert [p.local_rank for p in seen] == [0, 1, 0, 1, 0, 1]
    assert [p.local_size for p in seen] == [2] * 6
    assert [p.cross_rank for p in seen] == [0, 0, 1, 1, 2, 2]
    assert [p.cross_size for p in seen] == [3] * 6
    assert all(p.homogeneous for p in seen)
    uneven = [_runtime.placement(cluster(["a:1", "a:2", "a:3", "b:1"], r)) for r in range(4)]
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in uneven] == [
        (0, 3, 0, 2), (1, 3, 0, 1), (2, 3, 0, 1), (0, 1, 1, 2)]
    assert not uneven[0].homogeneous
    single = _runtime.placement(ClusterConfig.single_worker())
    assert (single.rank, single.size, single.local_rank, single.local_size) == (0, 1, 0, 1)


def test_calls_before_init_raise_horovods_error():
    hvd.shutdown()
    assert not hvd.is_initialized()
    for query in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
                  hvd.cross_size, hvd.mpi_threads_supported):
        with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
            query()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(tf.constant(1.0))
    assert (hvd.mpi_enabled(), hvd.gloo_enabled(), hvd.mpi_built()) == (False, False, False)


def test_unimplemented_names_say_what_to_use():
    assert hvd.elastic.run and hvd_keras.elastic.KerasState  # issue 42: implemented
    with pytest.raises(AttributeError, match="synchronized=True"):
        hvd_keras.SyncBatchNormalization  # the lookup itself raises
    assert not hasattr(hvd, "no_such_name")
    with pytest.raises(NotImplementedError, match="tfdp.data"):
        hvd.join()
    with pytest.raises(NotImplementedError, match="process sets"):
        hvd.add_process_set([0])
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.collectives.resolve_op(None, hvd.Adasum)


def test_tf_private_calls_init_relies_on_exist():
    context = _tf_private.tf_eager_context.context()
    _tf_private.require_attributes(type(context),
                                   _tf_private.COLLECTIVE_RUNTIME_CONTEXT_METHODS, "test")
    assert isinstance(_tf_private.eager_context_initialized(), bool)
    from tfdp._tf_private import coordination as area
    spec = {"worker": ["h:1", "h:2"]}
    leader = "/job:worker/replica:0/task:0"
    assert area._multi_worker_util.collective_leader(spec, "worker", 1) == leader
    assert area._multi_worker_util.coordination_leader(spec) == leader
    assert area._coordination_pb2.CoordinatedJob(name="worker", num_tasks=2).num_tasks == 2
    assert hasattr(area._server_pb2, "ServerDef")
    # The area's public names are the package's (tfdp._tf_private's rule).
    public = ["COLLECTIVE_RUNTIME_CONTEXT_METHODS", "eager_context_initialized",
              "preconfigure_collective_runtime"]
    assert all(getattr(_tf_private, n) is getattr(area, n) and n in _tf_private.__all__
               for n in public)
    # This process's context runs already: init() refuses clearly with several workers.
    assert _tf_private.eager_context_initialized()
    with pytest.raises(RuntimeError, match="has started already"):
        _tf_private.preconfigure_collective_runtime(spec, "worker", 0)


def test_init_after_the_runtime_started_says_to_move_it(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker",
                                                                         "index": 0}}))
    hvd.shutdown()
    with pytest.raises(RuntimeError, match="top of the script|another job"):
        hvd.init()
    assert not hvd.is_initialized()


# --- one GPU per process on a shared host --------------------------------------------------

def test_local_gpus_give_each_process_of_a_host_its_own():
    # One GPU per process: Horovod's gpus[hvd.local_rank()] and the even share agree.
    assert [_runtime.local_gpus(r, 4, 4, per_process=1) for r in range(4)] == \
        [(0,), (1,), (2,), (3,)]
    assert [_runtime.local_gpus(r, 4, 4) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    # More GPUs than processes: Horovod's one each, or an even share (leftovers unused).
    assert [_runtime.local_gpus(r, 2, 8, per_process=1) for r in range(2)] == [(0,), (1,)]
    assert [_runtime.local_gpus(r, 2, 8) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [_runtime.local_gpus(r, 3, 4) for r in range(3)] == [(0,), (1,), (2,)]
    # Fewer GPUs than processes: shared, round-robin (the engine then uses ring).
    assert [_runtime.local_gpus(r, 3, 1) for r in range(3)] == [(0,), (0,), (0,)]
    assert [_runtime.local_gpus(r, 4, 2, per_process=1) for r in range(4)] == \
        [(0,), (1,), (0,), (1,)]
    assert _runtime.local_gpus(0, 2, 0) == ()


class FakeGPUs:
    """tf.config's GPU calls on a host with ``count`` GPUs whose runtime has not started."""

    def __init__(self, monkeypatch, count, visible=None):
        self.gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
                     for i in range(count)]
        self.visible = list(self.gpus if visible is None else visible)
        monkeypatch.setattr(_tf_private, "eager_context_initialized", lambda: False)
        monkeypatch.setattr(tf.config, "list_physical_devices",
                            lambda kind=None: list(self.gpus) if kind == "GPU" else [])
        monkeypatch.setattr(tf.config, "get_visible_devices",
                            lambda kind=None: list(self.visible))
        monkeypatch.setattr(tf.config, "set_visible_devices", self.set_visible)

    def set_visible(self, devices, kind=None):
        self.visible = list(devices if isinstance(devices, list) else [devices])


def test_init_pins_the_local_ranks_gpu_as_horovod_scripts_do(monkeypatch, caplog):
    hosts = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "10.0.0.2:1"]
    gpus = FakeGPUs(monkeypatch, 4)
    with caplog.at_level("INFO", logger="tfdp"):
        _runtime._pin_local_gpu(_runtime.placement(cluster(hosts, 2)))
    assert gpus.visible == [gpus.gpus[2]]
    assert "rank 2 (local rank 2 of 3 on this host) uses /physical_device:GPU:2, GPU 2 of the 4" \
        in caplog.text
    # The Horovod script's own pin afterwards picks the same GPU.
    tf.config.set_visible_devices(tf.config.list_physical_devices("GPU")[2], "GPU")
    assert gpus.visible == [gpus.gpus[2]]
    # A script that chose its GPUs before init() keeps them; one process per host: untouched.
    chosen = FakeGPUs(monkeypatch, 4, visible=[])
    chosen.visible = [chosen.gpus[3]]
    _runtime._pin_local_gpu(_runtime.placement(cluster(hosts, 1)))
    assert chosen.visible == [chosen.gpus[3]]
    alone = FakeGPUs(monkeypatch, 4)
    _runtime._pin_local_gpu(_runtime.placement(cluster(hosts, 3)))
    assert alone.visible == alone.gpus
    # One GPU, three processes on the host: each takes it (the engine finds them sharing it).
    one = FakeGPUs(monkeypatch, 1)
    _runtime._pin_local_gpu(_runtime.placement(cluster(hosts, 1)))
    assert one.visible == one.gpus


# --- tfdp-run's horovodrun spellings ----------------------------------------------------------

def test_np_is_workers_and_H_is_hosts():
    args = parse_args(["-np", "4", "python", "train.py"])
    assert args.workers == 4 and args.host_list is None and args.command == ["python", "train.py"]
    args = parse_args(["-np", "4", "-H", "a:2,b:2", "--", "python", "train.py", "--lr", "1"])
    assert args.workers == 4 and [(h.name, h.slots) for h in args.host_list] == [("a", 2), ("b", 2)]
    assert args.command == ["python", "train.py", "--lr", "1"]
    args = parse_args(["-H", "localhost:3", "python", "train.py"])
    assert args.workers == 3


def test_np_fills_the_hosts_in_order_as_horovodrun_does(tmp_path, capsys):
    args = parse_args(["-np", "3", "-H", "a:2,b:2", "python", "train.py"])
    assert args.workers == 3 and [(h.name, h.slots) for h in args.host_list] == [("a", 2),
                                                                                  ("b", 1)]
    assert "hosts are filled in order, as horovodrun does: a:2, b:1" in args.notes[0]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    args = parse_args(["-np", "1", "-hostfile", str(hostfile), "python", "train.py"])
    assert args.workers == 1 and [(h.name, h.slots) for h in args.host_list] == [("a", 1)]
    for argv, problem in (
            (["-np", "5", "-H", "a:2,b:2"], "-np 5: the hosts have only 4 slots"),
            (["--workers", "3", "-H", "a:2,b:2"], "--workers 3 but the hosts have 4 slots"),
            (["-np", "3", "--workers", "2"], "-np 3 and --workers 2 disagree"),
            (["-H", "a:1", "--hostfile", str(hostfile)], "not allowed with argument")):
        with pytest.raises(SystemExit):
            parse_args([*argv, "python", "train.py"])
        assert problem in capsys.readouterr().err, argv


def translate(*argv, environ=None):
    """horovodrun.translate of the flags as given, and parse_args's result (which applies it)."""
    from tfdp.launcher import arguments

    parser = arguments._parser()
    given = parser.parse_args([*argv, "python", "train.py"])
    given.host_list = arguments._host_list(parser, given)
    return (horovodrun.translate(horovodrun.given(given), environ or {}),
            parse_args([*argv, "python", "train.py"]))


def test_horovodruns_elastic_flags_map_onto_restarts_and_min_workers(capsys):
    t, args = translate("-np", "4", "--min-np", "2", "--max-np", "8", "--reset-limit", "3")
    assert (t.min_workers, t.max_restarts) == (2, 3)
    assert (args.workers, args.min_workers, args.max_restarts) == (4, 2, 3)
    assert any("never adds processes" in n for n in t.notes)
    t, _ = translate("-np", "4", "--min-np", "4")  # no elasticity asked: no restart needed
    assert t.min_workers == 4 and t.max_restarts is None
    for argv, problem in (
            (["-np", "4", "--min-np", "2"], "--min-np 2 needs --reset-limit R (tfdp-run's "
                                             "--max-restarts R)"),
            (["-np", "4", "--max-np", "2"], "--max-np 2 is below -np 4"),
            (["-np", "4", "--reset-limit", "1", "--max-restarts", "2"], "disagree"),
            (["-np", "4", "--min-np", "2", "--min-workers", "3", "--max-restarts", "1"],
             "--min-np 2 and --min-workers 3 disagree"),
            (["-np", "2", "--min-np", "3", "--reset-limit", "1"],
             "--min-workers 3: must be between 1 and --workers 2")):
        with pytest.raises(SystemExit):
            parse_args([*argv, "python", "train.py"])
        assert problem in capsys.readouterr().err, argv


def test_horovodruns_other_flags_work_or_say_why_not(tmp_path, capsys):
    t, args = translate("-np", "2", "-p", "2222", "-i", "/keys/job", "--verbose",
                        "--output-filename", str(tmp_path / "out"), "--start-timeout", "45")
    assert (args.ssh_port, args.verbose, args.start_timeout) == (2222, True, 45.0)
    assert args.ssh_option == ["IdentityFile=/keys/job"]
    assert args.log_dir == str(tmp_path / "out") and "(tfdp-run's --log-dir)" in t.notes[-1]
    # HOROVOD_START_TIMEOUT when --start-timeout is not given, as horovodrun reads it.
    t, _ = translate("-np", "2", environ={"HOROVOD_START_TIMEOUT": "90"})
    assert t.start_timeout == 90.0
    t, _ = translate("-np", "2", "--start-timeout", "5", environ={"HOROVOD_START_TIMEOUT": "90"})
    assert t.start_timeout is None
    assert parse_args(["-np", "2", "python", "t.py"]).start_timeout == 300.0
    args = parse_args(["-np", "2", "-H", "a:1,b:1", "--network-interfaces", "eth1", "x"])
    assert [h.interface for h in args.host_list] == ["eth1", "eth1"]
    args = parse_args(["-np", "2", "-H", "a:1,b:1", "--network-interface", "b=eth2",
                       "--network-interface", "eth1,", "x"])
    assert [h.interface for h in args.host_list] == ["eth1", "eth2"]
    # Every tuning flag is accepted with a note; values are consumed, not taken as the command.
    t, args = translate("-np", "2", "--fusion-threshold-mb", "64", "--autotune", "--gloo",
                        "--blacklist-cooldown-range", "10", "100", "--log-level", "INFO",
                        "--timeline-filename", "t.json")
    assert args.command == ["python", "train.py"]
    assert [n.split(":")[0] for n in t.notes] == [
        "horovodrun's --fusion-threshold-mb 64", "horovodrun's --autotune",
        "horovodrun's --gloo", "horovodrun's --blacklist-cooldown-range 10 100",
        "horovodrun's --log-level INFO", "horovodrun's --timeline-filename t.json"]
    assert "TensorBoard profiler" in t.notes[-1] and "bucket_bytes" in t.notes[0]
    for argv, problem in (
            (["--host-discovery-script", "d.sh"], "no host discovery: list the hosts with -H"),
            (["--slots-per-host", "4"], "no host discovery"),
            (["--mpi-args=--bind-to none"], "no mpirun: set variables with -x NAME=VALUE"),
            (["--jsrun"], "no jsrun"), (["--config-file", "c.yaml"], "as flags"),
            (["-cb"], "hvd.nccl_built()"),
            (["--network-interfaces", "eth0,eth1"], "name one interface"),
            (["--network-interface", "eth0,eth1"], "name one interface"),
            (["--output-filename", "a", "--log-dir", str(tmp_path)], "disagree")):
        with pytest.raises(SystemExit):
            parse_args(["-np", "2", *argv, "python", "train.py"])
        assert problem in capsys.readouterr().err, argv


def test_a_horovodrun_command_line_runs_under_tfdp_run(tmp_path):
    """horovodrun's flags on a real tfdp-run (TensorFlow-free workers): -np, --min-np and
    --reset-limit drop a slot that fails at every start and continue; --verbose names every
    worker; --output-filename holds the logs; HOROVOD_START_TIMEOUT and tuning flags noted."""
    import sys

    plan = {"1@*": "crash:3"}  # slot 1 fails at every start, before joining
    environ = worker_env(FAKE_OUT=tmp_path, FAKE_PLAN=json.dumps(plan),
                         HOROVOD_START_TIMEOUT="60")
    logs = tmp_path / "hvd-out"
    cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "--min-np", "1", "--reset-limit", "2",
           "--verbose", "--output-filename", str(logs), "--fusion-threshold-mb", "32",
           sys.executable, worker_script("fake_worker.py")]
    code, out = run_job(cmd, environ, LAUNCH_TIMEOUT)
    assert code == 0, out
    assert "horovodrun's --fusion-threshold-mb 32: ignored" in out
    assert "--start-timeout 60 (from HOROVOD_START_TIMEOUT)" in out
    assert "rank 0: slot 0, host " in out and ", local rank 0 of 2" in out
    assert ", local rank 1 of 2" in out and "address 127.0.0.1:" in out
    assert "worker 1 dropped:" in out, out
    last = out.split("attempt 2: starting 1 worker(s)")[-1]
    assert "rank 0: slot 0" in last and "local rank 0 of 1" in last, out
    assert (logs / "attempt-0" / "worker-1.log").exists()
    assert (logs / "attempt-2" / "worker-0.log").exists()


# --- one process: the optimizer and the callbacks ---------------------------------------------

@pytest.fixture
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


def test_distributed_optimizer_keeps_class_config_and_saves_plain(initialized, tmp_path):
    adam = keras.optimizers.Adam(0.01, global_clipnorm=0.5)
    optimizer = hvd.DistributedOptimizer(adam, backward_passes_per_step=2)
    assert isinstance(optimizer, keras.optimizers.Adam) and type(optimizer).__name__ == "Adam"
    assert optimizer.global_clipnorm == 0.5 and optimizer.gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match="already"):
        hvd.DistributedOptimizer(optimizer)
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    x, y = classification_data(n=32)
    model = mlp()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.SGD
    loaded = hvd_keras.load_model(path)
    assert hvd.optimizer.is_distributed_optimizer(loaded.optimizer)
    assert int(loaded.optimizer.iterations) == 4
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # trains on: state kept


class LearningRates(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_train_begin(self, logs=None):
        self.seen = []


def fit_recording_learning_rates(callback, epochs=3, steps=3):
    x, y = classification_data(n=8 * steps)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    record = LearningRates()
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0,
                        callbacks=[callback, record])
    return record.seen, history.history


def test_warmup_follows_horovods_formula(initialized, monkeypatch):
    size = 4
    monkeypatch.setattr(_runtime.state, "placement",
                        _runtime.Placement(0, size, 0, size, 0, 1, True))
    seen, history = fit_recording_learning_rates(
        hvd_keras.callbacks.LearningRateWarmupCallback(0.8, warmup_epochs=2,
                                                       momentum_correction=False))
    steps = 3
    want = [0.8 / size * ((e + b / steps + 1 / steps) * (size - 1) / 2 + 1)
            for e in range(2) for b in range(steps)]
    np.testing.assert_allclose(seen[:6], want, rtol=1e-6)
    np.testing.assert_allclose(seen[6:], [seen[5]] * 3, rtol=1e-6)  # after warm-up: untouched
    np.testing.assert_allclose(history["lr"], [want[2], want[5], want[5]], rtol=1e-6)


def test_schedule_is_a_staircase_between_its_epochs(initialized):
    seen, _ = fit_recording_learning_rates(
        hvd_keras.callbacks.LearningRateScheduleCallback(
            1.0, lambda epoch: 0.5 ** epoch, start_epoch=1, end_epoch=3), epochs=4, steps=2)
    np.testing.assert_allclose(seen, [0.1, 0.1, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25], rtol=1e-6)


# --- many processes ---------------------------------------------------------------------

@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.slow
@pytest.mark.multiworker
def test_every_collective_matches_numpy(tmp_path, workers):
    launch(tmp_path, "hvd_collectives.py", workers=workers)
    for rank in range(workers):
        result = json.loads((tmp_path / f"collectives-{rank}.json").read_text())
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
        assert result["checks"] >= 90


def weights(saved, prefix):
    count = sum(1 for k in saved.files if k.startswith(prefix))
    return [saved[f"{prefix}{k}"] for k in range(count)]


def global_batches(x, y, workers, steps=None):
    """The union of the ranks' ``.shard(workers, rank).batch(LOCAL_BATCH)`` batches at each
    step: the contiguous global batch of workers * LOCAL_BATCH examples."""
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(workers * LOCAL_BATCH)
    return batches if steps is None else batches.take(steps)


def assert_same_weights(got, want, what):
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"{what}: weight {k}")


# Issue 40, hang 1: this job used to hang now and then (both workers silent in the first
# epoch; 2 of ~12 runs here, 2 of 3 CI runs). Cause: the collective engine, built at the first
# collective after TensorFlow's runtime started, re-applied the server definition, which replaced
# the process's collective resolver; a rank whose engine came first registered the first
# collective's group with rank 0's resolver before rank 0 replaced it, and both waited forever.
# "local-late" makes rank 0 the last to build its engine (HVD_LATE): that order hung every time
# (2 of 2) before the fix (tfdp._tf_private.reuse_running_collective_server).
@pytest.mark.parametrize("where", ["local", "local-late", "ssh"])
@pytest.mark.slow
@pytest.mark.multiworker
def test_horovod_keras_fit_trains_like_one_process(tmp_path, where, request):
    env = dict(HVD_LOCAL_BATCH=LOCAL_BATCH, HVD_EPOCHS=2)
    if where == "ssh":
        launch_over_ssh(tmp_path, request.getfixturevalue("sshd"), "hvd_keras_fit.py", **env)
    else:
        launch(tmp_path, "hvd_keras_fit.py", **env, **({"HVD_LATE": "0:3"}
                                                         if where == "local-late" else {}))
    ranks = [np.load(tmp_path / f"fit-{r}.npz") for r in range(2)]
    # Horovod's definitions: two processes on one host, or one on each of two hosts.
    one_host = where != "ssh"
    local, cross = ([0, 1], [0, 0]) if one_host else ([0, 0], [0, 1])
    assert [list(saved["ranks"]) for saved in ranks] == [
        [r, 2, local[r], 2 if one_host else 1, cross[r], 1 if one_host else 2]
        for r in range(2)]
    starts = [weights(saved, "init_") for saved in ranks]
    assert not np.allclose(starts[0][0], starts[1][0]), "the ranks started from one weight set"

    x, y = classification_data(n=96)
    reference = mlp()
    reference.set_weights(starts[0])  # BroadcastGlobalVariablesCallback(0)
    reference.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    # The guard: global_clipnorm acts (the global gradient's norm is above it at the start),
    # so equal weights show that the processes clip the reduced gradient, as one process.
    first_x, first_y = next(iter(global_batches(x, y, 2)))
    with tf.GradientTape() as tape:
        value = reference.compute_loss(x=first_x, y=first_y, y_pred=reference(first_x))
    norm = tf.linalg.global_norm(tape.gradient(value, reference.trainable_variables))
    assert float(norm) > 0.5 * 1.2, float(norm)
    history = reference.fit(global_batches(x, y, 2), epochs=2, verbose=0).history
    for rank, saved in enumerate(ranks):
        assert_same_weights(weights(saved, "final_"), reference.get_weights(), f"rank {rank}")
        # MetricAverageCallback: every rank logs the mean, the global batch's loss.
        np.testing.assert_allclose(saved["loss"], history["loss"], rtol=1e-5)

    # backward_passes_per_step=2 (passes summed): Keras's accumulation of 2 (the mean) at
    # twice the learning rate, for plain SGD.
    accumulated = mlp()
    accumulated.set_weights(weights(ranks[0], "final_"))
    accumulated.compile(optimizer=keras.optimizers.SGD(0.2, gradient_accumulation_steps=2),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accumulated.fit(global_batches(x, y, 2), epochs=1, verbose=0)
    for rank, saved in enumerate(ranks):
        assert_same_weights(weights(saved, "passes_"), accumulated.get_weights(),
                            f"backward_passes_per_step=2, rank {rank}")

    saved_models = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".keras")
    assert saved_models == ["model.keras"]
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert_same_weights(loaded.get_weights(), reference.get_weights(), "the saved model")
    assert type(loaded.optimizer) is keras.optimizers.Adam


def tape_reference(x, y, starts, workers, steps):
    """Horovod's example: step 0's gradient is the mean of each rank's gradient at its own
    weights on its own batch, applied to rank 0's weights; then one process on the global
    batches."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = mlp()
    grads = []
    for rank in range(workers):
        model.set_weights(starts[rank])
        first = np.arange(rank, workers * LOCAL_BATCH, workers)  # .shard's first local batch
        with tf.GradientTape() as tape:
            value = loss(y[first], model(x[first], training=True))
        grads.append(tape.gradient(value, model.trainable_variables))
    model.set_weights(starts[0])
    optimizer = keras.optimizers.Adam(0.01)
    mean = [tf.add_n(list(g)) / workers for g in zip(*grads)]
    optimizer.apply_gradients(zip(mean, model.trainable_variables))
    for images, labels in global_batches(x, y, workers).skip(1).take(steps - 1):
        with tf.GradientTape() as tape:
            value = loss(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                      model.trainable_variables))
    return model.get_weights()


def optimizer_reference(x, y, start, workers, steps):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = mlp()
    model.set_weights(start)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    for images, labels in global_batches(x, y, workers, steps):
        with tf.GradientTape() as tape:
            value = loss(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                      model.trainable_variables))
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.multiworker
def test_horovod_custom_loops_train_like_one_process(tmp_path):
    steps = 5
    launch(tmp_path, "hvd_custom_loop.py", HVD_LOCAL_BATCH=LOCAL_BATCH, HVD_STEPS=steps)
    ranks = [np.load(tmp_path / f"loop-{r}.npz") for r in range(2)]
    x, y = classification_data(n=96)

    starts = [weights(saved, "tape_init_") for saved in ranks]
    assert not np.allclose(starts[0][0], starts[1][0]), "the ranks started from one weight set"
    want = tape_reference(x, y, starts, 2, steps)
    for rank, saved in enumerate(ranks):
        assert_same_weights(weights(saved, "tape_final_"), want, f"tape loop, rank {rank}")

    start = weights(ranks[0], "optimizer_init_")
    want = optimizer_reference(x, y, start, 2, steps)
    for rank, saved in enumerate(ranks):
        assert_same_weights(weights(saved, "optimizer_final_"), want,
                            f"DistributedOptimizer loop, rank {rank}")


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_example_runs_under_tfdp_run_np(tmp_path):
    """examples/horovod_keras.py, launched with horovodrun's spelling ``tfdp-run -np 2``."""
    import os
    import sys

    from launching import ROOT
    cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "--", sys.executable,
           os.path.join(ROOT, "examples", "horovod_keras.py"), "--epochs", "2",
           "--warmup_epochs", "1", "--checkpoint_dir", str(tmp_path)]
    code, out = run_job(cmd, worker_env(TF_CPP_MIN_LOG_LEVEL=2), LAUNCH_TIMEOUT)
    assert code == 0, out[-4000:]
    assert "2 process(es)" in out and "test accuracy" in out, out[-4000:]
    assert "finished gradual learning rate warmup" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.keras",
                                                         "checkpoint-2.keras"]


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_synthetic_benchmark_runs_under_tfdp_run_np():
    """examples/horovod_synthetic_benchmark.py (Horovod's benchmark with its import changed):
    DistributedGradientTape, the broadcast after the first step, rank 0's img/s."""
    import os
    import re
    import sys

    from launching import ROOT
    cmd = [sys.executable, "-m", "tfdp.run", "-np", "2", "--", sys.executable,
           os.path.join(ROOT, "examples", "horovod_synthetic_benchmark.py"), "--num_iters", "2",
           "--num_batches_per_iter", "2", "--fp16_allreduce"]
    code, out = run_job(cmd, worker_env(TF_CPP_MIN_LOG_LEVEL=2), LAUNCH_TIMEOUT)
    assert code == 0, out[-4000:]
    assert len(re.findall(r"Iter #\d: [\d.]+ img/sec per process", out)) == 2, out[-4000:]
    assert re.search(r"Total img/sec on 2 process\(es\): [\d.]+", out), out[-4000:]
    assert "INFO" not in out, out[-4000:]  # the chief's output only, without TensorFlow's noise


# --- the rank-0 save with ZeRO (ShardedOptimizer) under the strategy --------------------------

def test_save_wait_grows_with_the_model_and_the_variable_overrides_it():
    assert sharded_state.save_wait_seconds(0, environ={}) == 60.0
    assert sharded_state.save_wait_seconds(500_000_000, environ={}) == 70.0
    assert sharded_state.save_wait_seconds(0, {"TFDP_SAVE_WAIT_SECONDS": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="TFDP_SAVE_WAIT_SECONDS"):
            sharded_state.save_wait_seconds(0, {"TFDP_SAVE_WAIT_SECONDS": bad})


class FakeCoordinationService:
    """The key-value store as check_every_worker_saves uses it: a read of an absent key
    times out after the time it was allowed."""

    def __init__(self):
        self.keys = {}
        self.waits = []

    def install(self, monkeypatch):
        monkeypatch.setattr(_tf_private, "coordination_service_configured", lambda: True)
        monkeypatch.setattr(_tf_private, "publish_to_coordination_service", self.keys.__setitem__)
        monkeypatch.setattr(_tf_private, "read_from_coordination_service", self.read)

    def read(self, key, timeout_seconds):
        self.waits.append(timeout_seconds)
        if key not in self.keys:
            time.sleep(timeout_seconds)
            raise tf.errors.DeadlineExceededError(None, None, "timed out")
        return self.keys[key]


def test_a_chief_saving_alone_is_told_to_save_on_every_worker(monkeypatch):
    workers = ["h:1", "h:2", "h:3", "h:4"]
    service = FakeCoordinationService()
    service.install(monkeypatch)
    # A worker other than the chief posts its arrival and goes on to the gather.
    sharded_state.check_every_worker_saves(cluster(workers, 1), 5.0)
    number = int(next(iter(service.keys)).split("/")[-2])
    assert list(service.keys) == [f"tfdp/sharded-save/{number}/1"] and service.waits == []
    # The chief of the next save: worker 1 is there, 2 and 3 never come; the chief waits
    # 0.3 s in all, not per worker.
    service.keys[f"tfdp/sharded-save/{number + 1}/1"] = "1"
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        sharded_state.check_every_worker_saves(cluster(workers, 0), 0.3)
    assert time.monotonic() - started < 0.3 + 0.2
    message = str(error.value)
    assert "worker(s) 2, 3 did not reach this save within 0.3 s" in message
    assert "on every worker" in message and "hvd.rank() == 0" in message
    assert "TFDP_SAVE_WAIT_SECONDS" in message
    # Everyone there: the chief returns.
    service.keys.update({f"tfdp/sharded-save/{number + 2}/{r}": "1" for r in (1, 2, 3)})
    sharded_state.check_every_worker_saves(cluster(workers, 0), 0.3)


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_chief_saving_a_sharded_optimizer_alone_fails_within_seconds(tmp_path):
    """``if is_chief(strategy): model.save(...)`` with ZeRO on 2 workers used to hang (the
    chief waited in the state gather forever); it fails within the wait, naming the fix."""
    # 3 s instead of the default 60 (the variable's path): worker 1 never arrives at the save,
    # so no wait is long enough for it; the test needs no longer.
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2, TFDP_SAVE_WAIT_SECONDS=3)
    started = time.time()
    code, out = run_job(tfdp_run_command(worker_script("hvd_chief_save.py"), workers=2,
                                         flags=["--output", "all"]), environ, LAUNCH_TIMEOUT)
    ended = time.time()
    assert code == 1, out[-4000:]
    assert "[w1] not saving" in out and "saved after" not in out, out[-4000:]
    assert "did not reach this save within 3 s" in out, out[-4000:]
    assert "on every worker" in out and "drop the `if is_chief(...)`" in out
    saving_at = float(out.split("saving at ")[1].split()[0])
    # The wait (3 s) plus the chief's exit and tfdp-run stopping the other worker.
    assert ended - saving_at < 18, (ended - saving_at, ended - started)
