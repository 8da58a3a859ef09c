"""DataParallelStrategy: construction, selection logic, errors, and the Keras features
users rely on (evaluate/predict, sync BatchNorm, save/load, BackupAndRestore, gradient
accumulation, buckets, compression)."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp.strategy import lifecycle
from tfdp.strategy import options
from tfdp.strategy.buckets import plan_buckets
from helpers import (assert_weights_close, classification_data, cpu_devices,
                     initial_weights, mlp, replica_components, train)


# --- selection logic (no GPU needed) ----------------------------------------------------

@pytest.mark.parametrize("requested,device_type,expected", [
    ("auto", "GPU", "nccl"), ("auto", "CPU", "ring"), ("ring", "GPU", "ring"),
    ("nccl", "GPU", "nccl"), ("ring", "CPU", "ring"),
])
def test_communication_selection(requested, device_type, expected):
    assert options.resolve_communication(requested, device_type) == expected


def test_nccl_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs GPUs"):
        options.resolve_communication("nccl", "CPU")
    with pytest.raises(ValueError, match="needs GPUs"):
        tfdp.DataParallelStrategy(communication="nccl")


# --- GPUs, decided on CPU: dtypes collectives cannot sum, shared GPUs (issue 23) ---------

@pytest.mark.parametrize("dtype,device,expected", [
    (tf.float32, "GPU", None), (tf.float16, "GPU", None), (tf.float64, "GPU", None),
    (tf.int64, "GPU", None),
    (tf.int32, "GPU", tf.int64),      # 'does not support datatype DT_INT32 on DEVICE_GPU'
    (tf.bfloat16, "GPU", tf.float32),  # ... DT_BFLOAT16 on DEVICE_GPU
    (tf.int32, "CPU", None), (tf.bfloat16, "CPU", None),
    (tf.bool, "CPU", tf.int64), (tf.bool, "GPU", tf.int64),  # no collective sums bool
    (tf.uint8, "CPU", tf.int64), (tf.int16, "GPU", tf.int64), (tf.uint32, "GPU", tf.int64),
])
def test_reduce_dtype_policy(dtype, device, expected):
    from tfdp.strategy.wire import reduce_dtype
    assert reduce_dtype(dtype, device) == expected


def test_reduce_dtype_refuses_what_no_widening_holds():
    from tfdp.strategy.wire import reduce_dtype
    for dtype in (tf.uint64, tf.complex64, tf.string):
        with pytest.raises(TypeError, match="Cast them to float32 or int64"):
            reduce_dtype(dtype, "GPU")


def _replica_values(strategy, dtype):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.cast(tf.fill([2], ctx.replica_id_in_sync_group + 1), dtype))


@pytest.mark.parametrize("dtype", [tf.bool, tf.uint8, tf.int32])
def test_reduce_of_dtypes_collectives_cannot_sum(dtype):
    # The policy forced to GPU rules on CPU replicas: bool and uint8 fail on any device
    # without it (guard below), int32 is what fails on GPUs.
    strategy = tfdp.DataParallelStrategy(cpu_devices(4))
    strategy.extended._tfdp_reduce_device_type = "GPU"
    values = _replica_values(strategy, dtype)
    total = strategy.reduce("SUM", values, axis=None)
    assert total.dtype == dtype
    expected = np.sum([np.full(2, r + 1).astype(dtype.as_numpy_dtype) for r in range(4)], axis=0)
    np.testing.assert_array_equal(total.numpy(), expected.astype(dtype.as_numpy_dtype))

    @tf.function
    def all_reduced():
        return strategy.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v),
                            args=(values,))

    for part in strategy.experimental_local_results(all_reduced()):
        assert part.dtype == dtype
        np.testing.assert_array_equal(part.numpy(), expected.astype(dtype.as_numpy_dtype))
    # The collectives ran in int64 (the graph says so); without the policy they would run
    # in dtype, which TensorFlow refuses for bool and uint8 on any device (and, once failed,
    # a collective executor stays aborted, so that is not run here).
    graph = all_reduced.get_concrete_function().graph
    kinds = {op.get_attr("T") for op in graph.get_operations() if op.type == "CollectiveReduceV2"}
    assert kinds == {tf.int64}


def test_fit_with_int32_labels_under_gpu_dtype_rules_trains_like_one_device():
    # Keras reduces the (x, int32 y) batch nest before fit; under GPU rules y travels as int64.
    x, y = classification_data(n=64)
    weights = initial_weights(mlp)
    def sgd():
        return keras.optimizers.SGD(0.1, momentum=0.9)
    ref, _ = train(None, mlp, sgd, x, y, 32, weights=weights)
    strategy = tfdp.DataParallelStrategy(cpu_devices(2))
    strategy.extended._tfdp_reduce_device_type = "GPU"
    got, _ = train(strategy, mlp, sgd, x, y, 32, weights=weights)
    assert_weights_close(got.get_weights(), ref.get_weights())


@pytest.mark.parametrize("counts,visible,indices,expected", [
    ([1, 1], None, [0, 1], ["0", "1"]),
    ([2], None, [0, 1], ["0", "0"]),                  # two logical GPUs on one physical
    ([2, 1], None, [0, 1, 2], ["0", "0", "1"]),
    ([1, 1], "3,5", [0, 1], ["3", "5"]),              # CUDA_VISIBLE_DEVICES renumbers
    ([1], "GPU-8f2a", [0], ["GPU-8f2a"]),             # or names by UUID
])
def test_gpu_identities(counts, visible, indices, expected):
    from tfdp.strategy import devices
    assert devices.gpu_identities(indices, counts, visible) == expected


def test_shared_gpu_detection():
    from tfdp.strategy.devices import Placement, shared_gpu
    alone = [Placement(0, 0, "a", "0"), Placement(0, 1, "a", "1"), Placement(1, 0, "b", "0")]
    assert shared_gpu(alone) is None  # GPU 0 of two hosts is two GPUs
    logical = [Placement(0, 0, "a", "0"), Placement(0, 1, "a", "0")]
    assert shared_gpu(logical) == ("a", "0", [(0, 0), (0, 1)])
    workstation = [Placement(0, 0, "ws", "0"), Placement(1, 0, "ws", "0")]  # tfdp-run -w 2
    assert shared_gpu(workstation).replicas == [(0, 0), (1, 0)]
    split = [Placement(0, 0, "ws", "0"), Placement(1, 0, "ws", "1")]  # CUDA_VISIBLE_DEVICES
    assert shared_gpu(split) is None


def test_shared_gpu_picks_ring_for_auto_and_refuses_nccl():
    from tfdp.strategy.devices import SharedGPU
    shared = SharedGPU("ws", "0", [(0, 0), (1, 0)])
    assert options.resolve_communication("auto", "GPU", shared) == "ring"
    assert options.resolve_communication("ring", "GPU", shared) == "ring"
    with pytest.raises(ValueError) as raised:
        options.resolve_communication("nccl", "GPU", shared)
    for needed in ("GPU '0' of host 'ws'", "worker 0 replica 0", "worker 1 replica 0",
                   "NCCL refuses two ranks on one GPU", "communication='auto' or 'ring'",
                   "CUDA_VISIBLE_DEVICES"):
        assert needed in str(raised.value), needed
    assert options.resolve_communication("auto", "GPU", None) == "nccl"  # guard


def test_the_shared_gpu_message_is_said_once_per_gpu(caplog):
    # A SharedGPU holds a list of replicas: the said-once key must still be a set member
    # (on an H100 every strategy over a shared GPU failed "unhashable type: 'list'").
    from tfdp import said_once
    from tfdp.strategy import data_parallel
    from tfdp.strategy.devices import SharedGPU
    said_once.forget()
    with caplog.at_level("WARNING", logger="tfdp"):
        for _ in range(2):
            data_parallel._say_shared_gpu_once("auto", SharedGPU("ws", "0", [(0, 0), (1, 0)]))
        data_parallel._say_shared_gpu_once("auto", SharedGPU("ws", "1", [(0, 1), (1, 1)]))
        data_parallel._say_shared_gpu_once("ring", SharedGPU("ws", "2", [(0, 2), (1, 2)]))
    said = [r.getMessage() for r in caplog.records if "uses ring collectives" in r.getMessage()]
    assert len(said) == 2 and "GPU '0' of host 'ws'" in said[0] and "GPU '1'" in said[1], said


def test_bf16_compression_on_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="compression='fp16'"):
        options.check_compression("bf16", "GPU")
    options.check_compression("bf16", "CPU")
    options.check_compression("fp16", "GPU")


@pytest.mark.parametrize("kwargs,match", [
    ({"communication": "mpi"}, "not one of"),
    ({"compression": "int8"}, "compression='int8'"),
    ({"bucket_bytes": -1}, "bucket_bytes=-1"),
    ({"timeout_seconds": 0}, "timeout_seconds"),
    ({"devices": ["/device:CPU:17"]}, "does not exist"),
    ({"devices": ["/device:GPU:0"]}, "does not exist"),
    ({"devices": ["/device:CPU:0", "/device:CPU:0"]}, "twice"),
    ({"devices": []}, "names no device"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdp.DataParallelStrategy(**kwargs)


def test_configure_cpu_replicas_errors():
    assert len(tfdp.configure_cpu_replicas(4)) == 4  # same split again: fine
    with pytest.raises(RuntimeError, match="after TensorFlow initialised"):
        tfdp.configure_cpu_replicas(3)
    for bad in (0, -2, 1.5, "4", True):
        with pytest.raises(ValueError, match="positive integer"):
            tfdp.configure_cpu_replicas(bad)


def test_defaults_and_properties():
    s = tfdp.DataParallelStrategy()
    assert isinstance(s, tf.distribute.Strategy)
    assert isinstance(s, tf.distribute.MultiWorkerMirroredStrategy)
    assert s.num_replicas_in_sync == 4
    assert s.communication == "ring"
    assert s.cluster == tfdp.ClusterConfig()
    assert s.cluster.num_workers == 1 and s.cluster.is_chief
    assert s.bucket_bytes == options.DEFAULT_BUCKET_BYTES
    assert s.timeout_seconds is None


def test_variables_are_mirrored_on_every_replica():
    s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    with s.scope():
        model = mlp()
    components = replica_components(s, model.trainable_variables[0])
    assert len(components) == 2
    np.testing.assert_array_equal(components[0], components[1])


def test_plan_buckets():
    f32, f16 = tf.float32, tf.float16
    assert plan_buckets([4, 4, 4], [f32] * 3, 0) == [[0], [1], [2]]
    assert plan_buckets([4, 4, 4], [f32] * 3, 8) == [[0, 1], [2]]
    assert plan_buckets([100, 4, 4], [f32] * 3, 8) == [[0], [1, 2]]
    assert plan_buckets([4, 4, 4, 4], [f32, f16, f32, f16], 1 << 20) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        plan_buckets([4], [f32], -1)


def test_plan_buckets_small_first_bucket_only_when_the_gradient_needs_several():
    f32 = tf.float32
    # Everything fits in one cap: one fused collective, the first-bucket size unused.
    assert plan_buckets([4, 4, 4], [f32] * 3, 100, first_bucket_bytes=4) == [[0, 1, 2]]
    # Larger than one cap: the first bucket closes at 4 bytes, the others at 8.
    assert plan_buckets([4, 4, 4, 4, 4], [f32] * 5, 8, first_bucket_bytes=4) == [
        [0], [1, 2], [3, 4]]
    # The first bucket never exceeds the cap, and a large first tensor is a bucket of its own.
    assert plan_buckets([10, 4, 4], [f32] * 3, 8, first_bucket_bytes=100) == [[0], [1, 2]]
    assert plan_buckets([4, 4], [f32] * 2, 0, first_bucket_bytes=4) == [[0], [1]]


def _collective_reduce_inputs(graph):
    """The element counts reduced by each CollectiveReduceV2 of ``graph``, in creation order,
    per device, and whether each one waits (a control input) for the one before it."""
    per_device = {}
    for op in graph.get_operations():
        if op.type == "CollectiveReduceV2":
            per_device.setdefault(op.device, []).append(op)
    return {device: ([int(op.inputs[0].shape.num_elements()) for op in ops],
                     [ops[k - 1] in op.control_inputs for k, op in enumerate(ops) if k])
            for device, ops in per_device.items()}


@pytest.mark.parametrize("order", ["last_layers_first", "first_layers_first"])
def test_backprop_finishes_a_bucket_before_going_past_its_layers(monkeypatch, order):
    """Issue 43, backward pacing: the op that carries backprop past the last layer (its
    input gradient) waits for the last layers' packed bucket, so that bucket can launch
    while the earlier layers' gradients are computed; not in the old order (the guard). The
    result is unchanged."""
    from tfdp.strategy import collectives

    monkeypatch.setattr(collectives, "LAUNCH_ORDER", order)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2), bucket_bytes=4 * 64 * 64)
    with strategy.scope():
        layers = [keras.layers.Dense(64, use_bias=False, name=f"d{i}") for i in range(3)]
        for layer in layers:
            layer.build((None, 64))

    def replica_fn(x):
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h)
            loss = tf.reduce_sum(h)
        weights = [layer.kernel for layer in layers]
        return collectives.all_reduce_gradients(tape.gradient(loss, weights))

    step = tf.function(lambda x: strategy.run(replica_fn, args=(x,)))
    graph = step.get_concrete_function(tf.TensorSpec([4, 64])).graph
    # One bucket per kernel (16 KiB each); the last layer's input gradient is the MatMul
    # of d2's backward that does not produce d2's kernel gradient.
    paced = [op for op in graph.get_operations()
             if op.type == "MatMul" and any(c.type in ("ConcatV2", "Reshape")
                                            for c in op.control_inputs)]
    assert bool(paced) is (order == "last_layers_first"), [op.name for op in paced]
    x = tf.ones([4, 64])
    reduced = step(x)
    for g in reduced:
        for value in strategy.experimental_local_results(g):
            assert np.all(np.isfinite(value.numpy()))
    monkeypatch.setattr(collectives, "LAUNCH_ORDER", "first_layers_first")
    unpaced = tf.function(lambda x: strategy.run(replica_fn, args=(x,)))(x)
    for a, b in zip(reduced, unpaced):
        for u, v in zip(strategy.experimental_local_results(a),
                        strategy.experimental_local_results(b)):
            np.testing.assert_array_equal(u.numpy(), v.numpy())


@pytest.mark.parametrize("order", ["last_layers_first", "first_layers_first"])
def test_gradient_buckets_launch_last_layers_first(monkeypatch, order):
    """Issue 43: the gradient buckets' collectives are created (so launched: each waits for
    the one created before it, through the launcher's ordering token) from the last layers'
    bucket to the first layers', the order backprop produces them. TensorFlow's own
    ReplicaContext.all_reduce reversed them; the old order stays reachable to show the
    difference."""
    from tfdp.strategy import collectives

    monkeypatch.setattr(collectives, "LAUNCH_ORDER", order)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2), bucket_bytes=1000)
    sizes = [100, 150, 300, 400]  # the first layer's gradient first, as Keras lists them

    def replica_fn():
        grads = [tf.fill([n], 1.0) for n in sizes]
        return collectives.all_reduce_gradients(grads)

    step = tf.function(lambda: strategy.run(replica_fn))
    launched = _collective_reduce_inputs(step.get_concrete_function().graph)
    assert len(launched) == 2  # one launch sequence per replica
    # Buckets from the last layers back, each closed once it holds 1,000 bytes (the 1 MiB
    # first-bucket size is above that cap): [400], [300], [150, 100].
    expected = [400, 300, 150 + 100]
    if order == "first_layers_first":
        expected = expected[::-1]
    for counts, chained in launched.values():
        assert counts == expected
        assert all(chained), "each collective waits for the one launched before it"
    results = step()
    for reduced in results:
        for value in strategy.experimental_local_results(reduced):
            np.testing.assert_array_equal(value.numpy(), np.full(value.shape, 2.0))


# --- numerics of buckets and compression -------------------------------------------------

@functools.cache
def _one_device_fit():
    """One device's weights and history of ``_run_fit`` on ``classification_data()`` from
    ``initial_weights(mlp)`` (each run is deterministic: once per module)."""
    return _run_fit(None, *classification_data(), initial_weights(mlp))


def _run_fit(strategy, x, y, weights, epochs=2):
    def opt():
        return keras.optimizers.Adam(0.01)
    model, history = train(strategy, mlp, opt, x, y, 64, weights=weights, epochs=epochs)
    return model.get_weights(), history


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [0, 64, 1 << 30])
def test_bucket_sizes_do_not_change_results(bucket_bytes):
    x, y = classification_data()
    w0 = initial_weights(mlp)
    ref, _ = _one_device_fit()
    got, _ = _run_fit(tfdp.DataParallelStrategy(devices=cpu_devices(4),
                                                bucket_bytes=bucket_bytes), x, y, w0)
    assert_weights_close(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("compression,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compression_stays_within_dtype_tolerance(compression, tol):
    x, y = classification_data()
    w0 = initial_weights(mlp)
    ref, ref_hist = _one_device_fit()
    got, hist = _run_fit(tfdp.DataParallelStrategy(devices=cpu_devices(4),
                                                   compression=compression), x, y, w0)
    scale = max(np.abs(w).max() for w in ref)
    diff = max(np.abs(a - b).max() for a, b in zip(got, ref))
    assert diff <= tol * scale
    assert diff > 0  # the wire dtype really was used
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=tol)


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_logs_ride_in_the_gradient_all_reduce_and_pass_the_strategy_reduce(compression):
    """riders.LogsRider: each replica's logs come back averaged over all replicas from
    the gradient all-reduce (no collective of their own), and strategy.reduce passes them
    through. Guards: a reduction under a condition (gradient accumulation, loss scaling) and
    a compressed bucket leave the logs to the usual reduction."""
    from tfdp.strategy import collectives, riders

    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(4), compression=compression)

    def replica_fn(conditional):
        ctx = tf.distribute.get_replica_context()
        r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        logs = {"loss": r + 1.0, "acc": 10.0 * r}
        rider = riders.LogsRider.of(logs, ctx.num_replicas_in_sync)
        grads = [tf.fill([3], r)]
        with riders.riding_with_gradients(rider):
            if conditional:
                grads = tf.cond(r >= 0.0, lambda: collectives.all_reduce_gradients(grads),
                                lambda: grads)
            else:
                grads = collectives.all_reduce_gradients(grads)
        reduced = rider.mean_logs()
        return (reduced if reduced is not None else logs), grads[0], reduced is not None

    results = {}
    for conditional in (False, True):
        @tf.function
        def step():
            logs, grads, rode = strategy.run(replica_fn, args=(conditional,))
            rode = strategy.experimental_local_results(rode)
            return strategy.reduce("MEAN", logs, axis=0), grads, rode
        logs, grads, rode = step()
        results[conditional] = {k: float(v) for k, v in logs.items()}, rode
        for g in strategy.experimental_local_results(grads):
            np.testing.assert_allclose(g.numpy(), [6.0] * 3)  # 0+1+2+3: the gradients intact
    for conditional, (logs, rode) in results.items():
        assert logs == {"loss": 2.5, "acc": 15.0}  # the mean over replicas, either way
        expected = not conditional and compression is None
        assert all(bool(r) is expected for r in rode), (conditional, compression)


def test_riders_cost_no_copy_of_the_bucket_beyond_its_own_packing():
    """The riders join the bucket's one concatenation and leave by its one split (before, a
    second concatenation and a slice copied the whole bucket again: 2 ConcatV2 per replica)."""
    from tfdp.strategy import collectives, riders

    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(4))

    def replica_fn():
        r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        rider = riders.LogsRider.of({"loss": r}, 4)
        with riders.riding_with_gradients(rider):
            grads = collectives.all_reduce_gradients([tf.fill([3], r), tf.fill([2, 2], r)])
        return grads, rider.mean_logs()["loss"]

    step = tf.function(lambda: strategy.run(replica_fn))
    graph = step.get_concrete_function().graph
    assert sum(op.type == "ConcatV2" for op in graph.get_operations()) == 4  # one per replica
    grads, loss = step()
    for g in strategy.experimental_local_results(grads[1]):
        np.testing.assert_array_equal(g.numpy(), np.full([2, 2], 6.0))  # the gradient intact
    assert float(strategy.experimental_local_results(loss)[0]) == 1.5  # the mean of 0..3


def test_a_rider_without_a_static_shape_is_refused_by_name():
    from tfdp.strategy import collectives, riders

    class Unshaped:
        def contribution(self):
            return tf.reshape(tf.where(tf.ones([3]) > 0), [-1])  # length known only at run time

        def receive(self, total):
            raise AssertionError("never reached")

    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    step = tf.function(lambda: strategy.run(
        lambda: collectives.all_reduce_gradients([tf.ones([3])])))
    rider = Unshaped()
    riders.add_gradient_rider(strategy, rider)
    try:
        with pytest.raises(ValueError, match=r"needs a static shape .* from Unshaped"):
            step()
    finally:
        riders.remove_gradient_rider(strategy, rider)


def test_a_strategy_wide_rider_goes_with_its_strategy():
    # Riders were keyed by id(strategy): a new strategy could reuse a dead one's id and
    # inherit its riders. They are held on the strategy, weakly.
    import gc

    from tfdp.strategy import riders

    before = riders.strategy_riders()
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    riders.add_gradient_rider(strategy, object())
    assert riders.strategy_riders() == before + 1
    del strategy
    gc.collect()
    assert riders.strategy_riders() == before


# --- Keras features ----------------------------------------------------------------------

@pytest.mark.slow
def test_evaluate_and_predict_match_single_device():
    x, y = classification_data()
    w0 = initial_weights(mlp)
    ref_model, _ = train(None, mlp, lambda: keras.optimizers.SGD(0.1), x, y, 64, weights=w0)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    model, _ = train(s, mlp, lambda: keras.optimizers.SGD(0.1), x, y, 64, weights=w0)
    ref_eval = ref_model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    got_eval = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    for k in ref_eval:
        np.testing.assert_allclose(got_eval[k], ref_eval[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(model.predict(x, batch_size=64, verbose=0),
                               ref_model.predict(x, batch_size=64, verbose=0), atol=1e-5)


def _bn_model(synchronized):
    def make():
        return keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16),
            keras.layers.BatchNormalization(synchronized=synchronized),
            keras.layers.Activation("relu"), keras.layers.Dense(3)])
    return make


@pytest.mark.slow
def test_synchronized_batchnorm_uses_global_batch_statistics():
    x, y = classification_data()
    w0 = initial_weights(_bn_model(False))
    def opt():
        return keras.optimizers.SGD(0.1)
    ref, _ = train(None, _bn_model(False), opt, x, y, 64, weights=w0)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    got, _ = train(s, _bn_model(True), opt, x, y, 64, weights=w0)
    assert_weights_close(got.get_weights(), ref.get_weights())  # includes moving stats
    # Guard: per-replica statistics (synchronized=False) give different weights.
    s2 = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    local, _ = train(s2, _bn_model(False), opt, x, y, 64, weights=w0)
    diff = max(np.abs(a - b).max() for a, b in zip(local.get_weights(), ref.get_weights()))
    assert diff > 1e-4


def test_gradient_accumulation_matches_single_device():
    x, y = classification_data()
    w0 = initial_weights(mlp)
    def opt():
        return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2,
                                    global_clipnorm=0.3)
    ref, ref_hist = train(None, mlp, opt, x, y, 32, weights=w0)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    got, hist = train(s, mlp, opt, x, y, 32, weights=w0)
    assert_weights_close(got.get_weights(), ref.get_weights())
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)


@pytest.mark.slow
def test_dropout_trains_and_replicas_stay_identical():
    def make():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dropout(0.5), keras.layers.Dense(3)])
    x, y = classification_data()
    s = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    model, hist = train(s, make, lambda: keras.optimizers.Adam(0.01), x, y, 64, epochs=5)
    assert hist["loss"][-1] < hist["loss"][0]
    for var in model.trainable_variables:
        c = replica_components(s, var)
        for other in c[1:]:
            np.testing.assert_array_equal(other, c[0])


def test_save_and_load_round_trip(tmp_path):
    x, y = classification_data()
    s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    model, _ = train(s, mlp, lambda: keras.optimizers.Adam(0.01), x, y, 64)
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, atol=1e-6)
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)

    model.save_weights(tmp_path / "w.weights.h5")
    s2 = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    with s2.scope():
        other = mlp()
    other.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_allclose(other.predict(x, verbose=0), expected, atol=1e-6)
    for var in other.trainable_variables:  # loaded into every replica
        c = replica_components(s2, var)
        np.testing.assert_array_equal(c[-1], c[0])


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at_epoch):
        super().__init__()
        self.at_epoch = at_epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at_epoch:
            raise RuntimeError("simulated preemption")


@pytest.mark.slow
def test_backup_and_restore_resumes_exactly(tmp_path):
    x, y = classification_data()
    w0 = initial_weights(mlp)
    def opt():
        return keras.optimizers.Adam(0.01)
    ref, _ = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), mlp, opt, x, y, 64,
                   weights=w0, epochs=4)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="simulated preemption"):
        train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), mlp, opt, x, y, 64,
              weights=w0, epochs=4, fit_kwargs={"callbacks": [backup, _Interrupt(1)]})
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    resumed, hist = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), mlp, opt, x, y,
                          64, weights=w0, epochs=4, fit_kwargs={"callbacks": [backup]})
    assert len(hist["loss"]) == 2  # epochs 3 and 4 only: nothing trained twice
    assert_weights_close(resumed.get_weights(), ref.get_weights())


def test_many_strategies_in_one_process_do_not_collide():
    """Strategies of 2, 4 and again 2 replicas, one after the other in one process: each
    trains on its own replicas, and all three end with the same weights from the same start
    (the global batch is the same), as a collision of their collectives or variables would
    not."""
    x, y = classification_data(n=64)
    w0 = initial_weights(mlp)
    results = []
    for replicas in (2, 4, 2):
        s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
        assert s.num_replicas_in_sync == replicas
        model, hist = train(s, mlp, lambda: keras.optimizers.SGD(0.1), x, y, 32, epochs=1,
                            weights=w0)
        assert np.isfinite(hist["loss"][0])
        results.append(model.get_weights())
    assert not np.allclose(results[0][0], w0[0])  # it trained
    assert_weights_close(results[1], results[0])
    assert_weights_close(results[2], results[0])


@pytest.mark.slow
def test_shuffled_resume_replays_the_uninterrupted_order(tmp_path):
    """tfdp BackupAndRestore + DatasetEpoch: a resumed job sees epoch e's order exactly."""
    x, y = classification_data()
    w0 = initial_weights(mlp)

    def run(epochs_callbacks, backup_dir, set_epoch=True, keras_backup=False):
        s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
        data = tfdp.data.distribute(s, tf.data.Dataset.from_tensor_slices((x, y)), 64,
                                    shuffle_buffer=256, seed=11)
        with s.scope():
            model = mlp()
            model.set_weights(w0)
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        backup = (keras.callbacks.BackupAndRestore if keras_backup
                  else tfdp.callbacks.BackupAndRestore)(str(backup_dir))
        callbacks = [backup] + epochs_callbacks
        if set_epoch:
            callbacks.append(tfdp.callbacks.DatasetEpoch(data))
        history = model.fit(data, epochs=4, verbose=0, callbacks=callbacks)
        return model, history.history

    reference, _ = run([], tmp_path / "a")
    with pytest.raises(RuntimeError, match="simulated preemption"):
        run([_Interrupt(1)], tmp_path / "b")
    resumed, hist = run([], tmp_path / "b")
    assert len(hist["loss"]) == 2
    assert_weights_close(resumed.get_weights(), reference.get_weights())
    # tfdp's BackupAndRestore alone positions the dataset too (no DatasetEpoch needed).
    with pytest.raises(RuntimeError, match="simulated preemption"):
        run([_Interrupt(1)], tmp_path / "e", set_epoch=False)
    alone, _ = run([], tmp_path / "e", set_epoch=False)
    assert_weights_close(alone.get_weights(), reference.get_weights())
    # Guard: with Keras's own BackupAndRestore and no DatasetEpoch the resumed process counts
    # epochs from 0 again and replays the wrong orders.
    with pytest.raises(RuntimeError, match="simulated preemption"):
        run([_Interrupt(1)], tmp_path / "c", set_epoch=False, keras_backup=True)
    drifted, _ = run([], tmp_path / "c", set_epoch=False, keras_backup=True)
    uninterrupted, _ = run([], tmp_path / "d", set_epoch=False, keras_backup=True)
    diff = max(np.abs(a - b).max() for a, b in zip(drifted.get_weights(), uninterrupted.get_weights()))
    assert diff > 1e-4


def test_take_back_sigterm_reinstalls_the_handler_a_c_library_replaced():
    # TensorFlow's coordination service replaces SIGTERM's handler in C when a worker joins
    # (measured: a joined worker outlives `kill` until SIGKILL). A C-level SIG_IGN stands in
    # for it here; Python still has its own handler on record.
    import ctypes
    import os
    import signal

    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        libc.signal(int(signal.SIGTERM), int(signal.SIG_IGN))
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == []  # guard: the replaced handler no longer runs
        lifecycle.take_back_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _fresh_autograph(monkeypatch):
    """AutoGraph as in a new process (it remembers what it converted and what it let through),
    with every function it converts recorded as ``(module, qualified name)``."""
    from tensorflow.python.autograph.impl import api, conversion
    from tensorflow.python.autograph.pyct import cache, transpiler

    monkeypatch.setattr(api, "_TRANSPILER", api.PyToTF())
    monkeypatch.setattr(conversion, "_ALLOWLIST_CACHE", cache.UnboundInstanceCache())
    converted = []
    transform = transpiler.GenericTranspiler.transform_function

    def recording(self, fn, *args, **kwargs):
        converted.append((getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))))
        return transform(self, fn, *args, **kwargs)

    monkeypatch.setattr(transpiler.GenericTranspiler, "transform_function", recording)
    return converted


def test_tfdps_own_functions_are_not_converted_by_autograph(monkeypatch):
    """tfdp's internal tf.functions (the workers' agreement, ZeRO's gathers) branch on no
    tensor and are built with autograph=False: autograph would otherwise convert them, and
    tfdp's strategy.run and every helper they call, once per process (0.5 s of CPU at a
    worker's first agreement, measured with py-spy). Guard: with autograph on, the same
    function is converted."""
    from tfdp.strategy import agreement

    converted = _fresh_autograph(monkeypatch)
    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    summing = agreement._summing_function(strategy)
    values = tf.constant([1.0, 2.0], tf.float64)
    summed = strategy.experimental_local_results(summing(values))
    assert [v.numpy().tolist() for v in summed] == [[1.0, 2.0]] * 2  # replica 0's values
    assert converted == []
    tf.function(summing.python_function)(values)  # the guard: autograph on
    assert "_summing_function.<locals>.fn" in [name for _, name in converted], converted


def _custom_loop_step(strategy):
    def replica_step(x):
        if tf.reduce_sum(x) > 0:  # a Python if on a tensor: runs only if AutoGraph converts it
            y = x * 2.0
        else:
            y = -x
        return y

    @tf.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    return step


def test_autograph_converts_a_custom_loops_replica_function_and_no_tfdp_code(monkeypatch):
    """A custom loop (``strategy.run`` inside the user's tf.function): AutoGraph converts the
    user's functions, never tfdp's ``DataParallelStrategy.run`` and the helpers it calls (it
    did, 0.5-0.6 s of CPU in each process, before tfdp added its DoNotConvert rule, feature
    ``autograph_leaves_tfdp``). Guard: with TensorFlow's own rules, the same loop in a fresh
    AutoGraph converts tfdp's ``run``."""
    from tensorflow.python.autograph.core import config

    strategy = tfdp.DataParallelStrategy(cpu_devices(2))
    assert "autograph_leaves_tfdp" in tfdp.strategy.keras_integration.installed_features()
    converted = _fresh_autograph(monkeypatch)
    result = strategy.experimental_local_results(_custom_loop_step(strategy)(tf.ones([2])))
    assert [r.numpy().tolist() for r in result] == [[2.0, 2.0]] * 2
    assert [name for module, name in converted if module.startswith("tfdp")] == [], converted
    names = [name for _, name in converted]
    assert any(n.endswith("replica_step") for n in names), names  # the user's, converted

    tensorflows_rules = tuple(r for r in config.CONVERSION_RULES if not r.matches("tfdp"))
    monkeypatch.setattr(config, "CONVERSION_RULES", tensorflows_rules)
    converted = _fresh_autograph(monkeypatch)
    _custom_loop_step(strategy)(tf.ones([2]))
    assert "DataParallelStrategy.run" in [n for m, n in converted if m.startswith("tfdp")], \
        converted
