"""keras.distribution on the TensorFlow backend through tfdp (issue 58, docs/keras_distribution.md).

Pure rules (plan.py) without TensorFlow; Keras's own guide (tests/keras_distribution_guide.py)
on 4 logical CPUs against one device; KerasHub Gemma with its own layout map; the errors;
``tfdp.reset()``; the same guide on 2 workers x 2 replicas under tfdp-run, with and without
``keras.distribution.initialize()``.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
import keras_distribution_guide as guide
from tfdp.keras_distribution import plan
from tfdp.keras_distribution.plan import KerasDistributionError

DEVICES = 4


def _gap(a, b):
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
               for u, v in zip(a, b))


@pytest.fixture(autouse=True)
def _installed():
    keras.distribution.set_distribution(None)
    tfdp.keras_distribution.install()
    yield
    keras.distribution.set_distribution(None)


@pytest.fixture(scope="module")
def one_device_guide():
    keras.distribution.set_distribution(None)
    model, loss = guide.one_device()
    return model.get_weights(), loss


# --- pure rules -------------------------------------------------------------------------------

def test_device_names_are_kerass_form_in_tfdps_order():
    assert plan.device_names("CPU", 2, 2) == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert plan.device_names("GPU", 1, 1) == ["gpu:0"]


def test_a_mesh_maps_to_this_workers_local_positions():
    job = dict(device_type="CPU", per_worker=2, num_workers=2)
    names = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert plan.plan_mesh(names, rank=0, **job).local_positions == (0, 1)
    assert plan.plan_mesh(names, rank=1, **job).local_positions == (0, 1)
    assert plan.plan_mesh(names[::-1], rank=1, **job).num_replicas == 4
    # TensorFlow's spellings: a job device, and a local one (this worker's).
    tf_names = ["/job:worker/replica:0/task:1/device:CPU:1", "/job:worker/task:0/device:CPU:0"]
    assert plan.plan_mesh(tf_names, rank=1, **job).local_positions == (1,)
    assert plan.plan_mesh(["/device:CPU:1"], rank=0, device_type="CPU", per_worker=2,
                          num_workers=1).local_positions == (1,)


@pytest.mark.parametrize("devices, words", [
    (["cuda:0"], "PyTorch"),
    (["TFRT_CPU_0"], "JAX"),
    (["tpu_core_3"], "neither"),
    (["gpu:0", "gpu:1"], "are CPUs"),
    (["cpu:0", "cpu:9"], "not a device of this job"),
    (["cpu:0", "cpu:0"], "twice"),
    (["cpu:0", "cpu:1"], "same number"),  # leaves worker 1 out
    ([], "no devices"),
])
def test_what_cannot_be_honored_is_an_error_naming_the_fix(devices, words):
    with pytest.raises(KerasDistributionError, match=words) as error:
        plan.plan_mesh(devices, device_type="CPU", per_worker=2, num_workers=2, rank=0)
    assert "Fix" in str(error.value) or words in ("twice",)


def test_layout_shards_when_any_axis_is_named():
    assert plan.layout_shards((None, "model"))
    assert plan.layout_shards(("batch", None, None))
    assert not plan.layout_shards((None, None))
    assert not plan.layout_shards(())


def test_initialize_needs_every_workers_address():
    assert plan.initialize_workers(None, None, None) is None
    assert plan.initialize_workers("h:1", 1, 0) is None
    assert plan.initialize_workers("h:1,h:2", 2, 1) == (["h:1", "h:2"], 1)
    assert plan.initialize_workers(["h:1", "h:2"], None, 0) == (["h:1", "h:2"], 0)
    with pytest.raises(KerasDistributionError, match="every worker's"):
        plan.initialize_workers("coordinator:1234", 2, 0)  # JAX's form: coordinator only
    with pytest.raises(KerasDistributionError, match="process_id"):
        plan.initialize_workers("h:1,h:2", 2, 2)


def test_import_tfdp_before_keras_installs_when_keras_loads():
    import subprocess
    import sys

    code = ("import os, sys; os.environ['KERAS_BACKEND'] = 'tensorflow'\n"
            "import tfdp\n"
            "assert 'tensorflow' not in sys.modules\n"
            "import keras\n"
            "from keras.src.backend.tensorflow import distribution_lib as b\n"
            "print('installed', hasattr(b, 'num_processes'), "
            "getattr(keras.distribution.set_distribution, '_tfdp_patch', False))\n")
    environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "installed True True" in result.stdout


# --- in process: Keras's guide on 4 logical CPUs ------------------------------------------------

def test_list_devices_is_the_jobs_devices():
    devices = keras.distribution.list_devices()
    assert devices == [f"cpu:{i}" for i in range(len(devices))] and len(devices) >= DEVICES
    assert keras.distribution.list_devices("gpu") == []
    assert keras.distribution.get_device_count() == len(devices)
    dist = keras.distribution.DataParallel()
    assert dist.num_processes == 1 and dist.device_mesh.devices.size == len(devices)


@pytest.mark.slow
def test_guide_data_parallel_trains_like_one_device(one_device_guide):
    devices = keras.distribution.list_devices()[:DEVICES]
    reference, reference_loss = one_device_guide
    data_parallel = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(data_parallel)
    model = guide.guide_model()
    strategy = tf.distribute.get_strategy()
    assert isinstance(strategy, tfdp.DataParallelStrategy) and strategy.num_replicas_in_sync == 4
    assert model.distribute_strategy is strategy
    kernel = model.get_layer("d1").kernel.value
    assert len(strategy.experimental_local_results(kernel)) == DEVICES  # mirrored on 4
    model, loss = guide.fit_and_evaluate(model)
    gap = _gap(model.get_weights(), reference)
    assert gap < 1e-6, gap
    assert abs(loss - reference_loss) < 1e-6
    predicted = model.predict(guide.dataset(), verbose=0)
    assert predicted.shape == (128, 10)
    # Guard: the reference is not the initial weights (training moved them).
    keras.distribution.set_distribution(None)
    assert _gap(guide.guide_model().get_weights(), reference) > 1e-3


def _custom_loop():
    """The guide's model trained by a custom loop through whatever strategy is current."""
    strategy = tf.distribute.get_strategy()
    model = guide.guide_model()
    optimizer = keras.optimizers.SGD(0.1)
    distributed = strategy.experimental_distribute_dataset(guide.dataset())

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(y, model(x, training=True))
                loss = tf.reduce_sum(per_example) / 16.0  # the global batch
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
        strategy.run(replica, (x, y))

    for x, y in distributed:
        step(x, y)
    return model.get_weights(), strategy.num_replicas_in_sync


def test_a_custom_loop_under_the_distribution_runs_data_parallel():
    reference, one = _custom_loop()
    assert _gap(reference, guide.guide_model().get_weights()) > 1e-4  # guard: it trained
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:DEVICES]))
    weights, replicas = _custom_loop()
    assert one == 1 and replicas == DEVICES
    gap = _gap(weights, reference)
    assert gap < 1e-6, gap


@pytest.mark.slow
def test_guide_model_parallel_shards_the_layouts_variables(one_device_guide):
    from tfdp.strategy.zero3 import layout, parameters

    devices = keras.distribution.list_devices()[:DEVICES]
    reference, reference_loss = one_device_guide
    distribution = guide.model_parallel_distribution(devices)
    with distribution.scope():
        model = guide.guide_model()
    assert not tf.distribute.has_strategy()  # the scope ended with distribution.scope()
    strategy = model.distribute_strategy
    sharded = {v.path for v in model.weights if layout.is_sharded(v)}
    assert sharded == {"d1/kernel"}  # d1 has no bias; d2's weights have no layout
    kernel = model.get_layer("d1").kernel
    per_replica = parameters.sharded_bytes_per_replica([kernel], strategy)
    assert per_replica == [784 * 200 * 4 // DEVICES] * DEVICES
    model, loss = guide.fit_and_evaluate(model)
    gap = _gap(model.get_weights(), reference)
    assert gap < 1e-6, gap
    assert abs(loss - reference_loss) < 1e-6


def test_a_distribution_tfdp_cannot_run_is_an_error_and_changes_nothing():
    with pytest.raises(KerasDistributionError, match="PyTorch"):
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            device_mesh=keras.distribution.DeviceMesh((2,), ["batch"], ["cuda:0", "cuda:1"])))
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    mesh = keras.distribution.DeviceMesh((1,), ["batch"], ["cpu:99"])
    with pytest.raises(KerasDistributionError, match="not a device of this job"):
        keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))

    class Custom(keras.distribution.DataParallel.__mro__[1]):  # Keras's Distribution base
        pass

    with pytest.raises(KerasDistributionError, match="DataParallel and ModelParallel"):
        keras.distribution.set_distribution(Custom(keras.distribution.DeviceMesh(
            (1,), ["batch"], ["cpu:0"])))
    assert keras.distribution.distribution() is None


def test_reset_returns_kerass_distribution_module_to_its_state_at_import():
    from keras.src.backend.tensorflow import distribution_lib as backend
    from keras.src.backend.tensorflow.core import Variable
    from keras.src.distribution import distribution_lib as front

    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:2]))
    assert isinstance(tf.distribute.get_strategy(), tfdp.DataParallelStrategy)
    assert hasattr(backend, "num_processes")
    tfdp.reset()
    # Keras's own functions again, in every namespace, and nothing tfdp added.
    for name in ("num_processes", "process_id", "initialize", "get_device_count",
                 "distribute_tensor"):
        assert not hasattr(backend, name), name
    assert not getattr(backend.list_devices, "_tfdp_patch", False)
    assert keras.distribution.set_distribution is front.set_distribution
    assert not getattr(front.set_distribution, "_tfdp_patch", False)
    assert not getattr(Variable._initialize, "_tfdp_patch", False)
    assert not getattr(front.Distribution.distribute_dataset, "_tfdp_patch", False)
    assert keras.distribution.distribution() is None and not tf.distribute.has_strategy()
    # Guard: stock Keras on TensorFlow ignores the distribution: one device, no strategy.
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:2]))
    try:
        model = guide.guide_model()
        assert not tf.distribute.has_strategy()
        assert not hasattr(model.get_layer("d1").kernel.value, "values")
    finally:
        keras.distribution.set_distribution(None)
    assert tfdp.keras_distribution.install()
    assert getattr(backend.list_devices, "_tfdp_patch", False)


# --- KerasHub Gemma with its own layout map ----------------------------------------------------

@pytest.mark.slow
def test_gemma_with_its_layout_map_trains_like_one_device():
    keras_hub = pytest.importorskip("keras_hub")
    import keras_hub_cases as cases
    from tfdp.strategy.zero3 import layout, parameters

    name = "gemma"
    cases.MODELS.setdefault(name, _gemma)
    weights = cases.initial_weights(name)
    reference = cases.train(name, weights).get_weights()
    devices = keras.distribution.list_devices()[:DEVICES]
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    model = cases.train(name, weights)
    strategy = model.distribute_strategy
    keras.distribution.set_distribution(None)
    gap = cases.max_gap(model.get_weights(), reference)
    assert gap < 1e-5, gap
    laid_out = [v for v in model.weights
                if plan.layout_shards(getattr(layout_map[v.path], "axes", None))]
    assert laid_out and all(layout.is_sharded(v) for v in laid_out)
    ids = {id(v) for v in laid_out}
    assert not any(layout.is_sharded(v) for v in model.weights if id(v) not in ids)
    whole = sum(int(np.prod(v.shape)) * 4 for v in laid_out)
    per_replica = parameters.sharded_bytes_per_replica(laid_out, strategy)
    padding = sum((-int(np.prod(v.shape))) % DEVICES for v in laid_out) * 4
    assert per_replica == [(whole + padding) // DEVICES] * DEVICES, (per_replica, whole)
    print(json.dumps({"gemma_gap": gap, "whole_bytes": whole, "per_replica": per_replica}))


def _gemma(layers=1):
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=96, num_layers=layers, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=64, head_dim=16)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


# --- several workers: the guide under tfdp-run, and with keras.distribution.initialize() ------

def _check_workers(tmp_path, one_device_guide, out):
    reference, reference_loss = one_device_guide
    for rank in range(2):
        saved = np.load(tmp_path / f"rank-{rank}.npz")
        assert json.loads(str(saved["devices"])) == [f"cpu:{i}" for i in range(4)], out[-3000:]
        assert json.loads(str(saved["sharded"])) == ["d1/kernel"]
        assert list(saved["replicas"]) == [4, 4]  # one job of 2 x 2, not two jobs of 2
        for part in ("dp", "mp"):
            weights = [saved[f"{part}_{k}"] for k in range(len(reference))]
            gap = _gap(weights, reference)
            print(f"2 workers x 2 replicas, {part}, rank {rank}: gap {gap:.1e}")
            assert gap < 1e-6, (part, rank, gap)
            assert abs(float(saved[f"{part}_loss"]) - reference_loss) < 1e-6


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_guide_on_two_workers_under_tfdp_run(tmp_path, one_device_guide):
    from launching import run_job, tfdp_run_command, worker_env, worker_script

    environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2)
    # The same script as below: it calls keras.distribution.initialize(), which under
    # tfdp-run (TF_CONFIG) finds the job already known.
    code, out = run_job(tfdp_run_command(worker_script("keras_distribution_worker.py"),
                                         "initialize", cpu_replicas=2), environ, 400)
    assert code == 0, out[-6000:]
    _check_workers(tmp_path, one_device_guide, out)


@pytest.mark.slow
@pytest.mark.multiworker
def test_the_guide_on_two_workers_started_by_keras_distribution_initialize(
        tmp_path, one_device_guide):
    import socket
    import subprocess
    import sys

    from launching import worker_env, worker_script

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for rank in range(2):
        environ = worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2,
                             TFDP_CPU_REPLICAS=2, KERAS_DISTRIBUTION_JOB_ADDRESSES=addresses,
                             KERAS_DISTRIBUTION_NUM_PROCESSES=2,
                             KERAS_DISTRIBUTION_PROCESS_ID=rank)
        procs.append(subprocess.Popen(
            [sys.executable, worker_script("keras_distribution_worker.py"), "initialize"],
            env={k: str(v) for k, v in environ.items()}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=400)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    out = "\n".join(outs)
    assert [p.returncode for p in procs] == [0, 0], out[-6000:]
    _check_workers(tmp_path, one_device_guide, out)
