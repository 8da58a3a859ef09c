"""ShardedOptimizer with Keras's gradient accumulation and EMA (ZeRO stage 2): equivalence
with one device, state visible in ``variables``, memory, and checkpoints on update boundaries."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp.optimizers.sharded_state import variable_bytes_per_device
from helpers import ACCUMULATION_OPTIMIZERS as OPTIMIZERS
from helpers import (assert_weights_close, classification_data, cpu_devices, deep_mlp,
                     embedding_model, initial_weights, many_variable_model, mixed_precision_mlp,
                     token_data, train)
from launching import run_job, tfdp_run_command, worker_env, worker_script
from zero2_cases import K, MICRO_BATCH, MW_CASES, MW_REFERENCE_BATCH, compile_for


def sharded(make, accumulation="sharded", **kw):
    return lambda: tfdp.ShardedOptimizer(make(**kw), accumulation=accumulation)


def assert_replicas_identical(strategy, model):
    for var in model.trainable_variables:
        parts = [np.asarray(p) for p in strategy.experimental_local_results(var.value)]
        for p in parts[1:]:
            np.testing.assert_array_equal(p, parts[0])


def device_index(variable):
    return tf.DeviceSpec.from_string(variable.value.device).device_index


@functools.cache
def one_device(opt_name):
    """One device's weights and optimizer iterations after 2 epochs of ``deep_mlp`` with
    ``opt_name`` at K times the micro-batch, from ``initial_weights``: the reference several
    tests compare with, trained once per module (each run is deterministic)."""
    x, y = classification_data()
    model, _ = train(None, deep_mlp, OPTIMIZERS[opt_name], x, y, K * MICRO_BATCH,
                     weights=initial_weights(deep_mlp))
    return model.get_weights(), int(model.optimizer.iterations)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_accumulation_equals_one_device_at_k_times_the_batch(replicas, opt_name):
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    make = OPTIMIZERS[opt_name]
    ref_weights, ref_iterations = one_device(opt_name)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    got, _ = train(s, deep_mlp, sharded(make, gradient_accumulation_steps=K), x, y, MICRO_BATCH,
                   weights=w0)
    assert_weights_close(got.get_weights(), ref_weights)
    assert_replicas_identical(s, got)
    opt = got.optimizer
    # Keras's counters: iterations counts updates, the wrapped optimizer's _iterations calls.
    assert int(opt.iterations) == ref_iterations == 8
    assert int(opt.inner_optimizer._iterations.numpy()) == 32
    # ZeRO-2: each accumulator exists once, on its owner's device, and is zero after an update.
    accumulators = opt.inner_optimizer._accumulated_gradients
    for i, acc in enumerate(accumulators):
        assert device_index(acc) == opt._owners[i]
        np.testing.assert_array_equal(acc.numpy(), 0.0)
    assert {opt._owners[i] for i in range(len(accumulators))} == set(range(replicas))


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4])
def test_local_accumulation_equals_one_device_at_k_times_the_batch(replicas):
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    make = OPTIMIZERS["adam_global_clipnorm"]
    ref_weights, _ = one_device("adam_global_clipnorm")
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    got, _ = train(s, deep_mlp, sharded(make, "local", gradient_accumulation_steps=K), x, y,
                   MICRO_BATCH, weights=w0)
    assert_weights_close(got.get_weights(), ref_weights)
    assert_replicas_identical(s, got)
    # "local": the accumulators are full copies on every replica.
    for acc in got.optimizer.inner_optimizer._accumulated_gradients:
        assert len(s.experimental_local_results(acc.value)) == replicas


@pytest.mark.slow
def test_guard_accumulation_changes_the_result():
    """The equivalence above can fail: without accumulation at the micro-batch size the
    weights differ far beyond the tolerance."""
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    make = OPTIMIZERS["adam_global_clipnorm"]
    ref_weights, _ = one_device("adam_global_clipnorm")
    got, _ = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), deep_mlp, sharded(make), x, y,
                   MICRO_BATCH, weights=w0)
    with pytest.raises(AssertionError):
        assert_weights_close(got.get_weights(), ref_weights)


def test_accumulation_with_a_schedule_and_sparse_gradients_equals_keras():
    """Keras's semantics beyond the k-times-batch case: the schedule sees micro-batches, and
    sparse (Embedding) gradients are accumulated densely: sharded == unsharded Keras."""
    model_fn = embedding_model
    x, y = token_data()
    w0 = initial_weights(model_fn)

    def make():
        schedule = tfdp.schedules.WarmupCosineDecay(0.05, warmup_steps=6, total_steps=32)
        return keras.optimizers.Adam(schedule, gradient_accumulation_steps=K)
    ref, _ = train(None, model_fn, make, x, y, MICRO_BATCH, weights=w0)
    got, _ = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), model_fn,
                   lambda: tfdp.ShardedOptimizer(make()), x, y, MICRO_BATCH, weights=w0)
    assert_weights_close(got.get_weights(), ref.get_weights())


EMA_CASES = {
    # name: (optimizer factory, replicas)
    "adam_finalize": (lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9), 4),
    "sgd_overwrite_every_3": (lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3), 2),
    "adamw_accumulation": (lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.05, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=2,
        gradient_accumulation_steps=2), 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EMA_CASES))
def test_ema_sharded_equals_unsharded(case):
    make, replicas = EMA_CASES[case]
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    ref, ref_hist = train(None, deep_mlp, make, x, y, 32, weights=w0)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    got, hist = train(s, deep_mlp, lambda: tfdp.ShardedOptimizer(make()), x, y, 32, weights=w0)
    # fit ended with finalize_variable_values: the weights are the moving averages.
    assert_weights_close(got.get_weights(), ref.get_weights())
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert_replicas_identical(s, got)
    opt = got.optimizer
    averages = opt.inner_optimizer._model_variables_moving_average
    for i, (average, want) in enumerate(zip(averages, ref.optimizer._model_variables_moving_average)):
        assert device_index(average) == opt._owners[i]  # sharded like the slots
        np.testing.assert_allclose(average.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    # Guard: the averages are not the raw weights, so the comparison above tests the EMA.
    raw, _ = train(None, deep_mlp, lambda: type(make()).from_config(
        {**make().get_config(), "use_ema": False}), x, y, 32, weights=w0)
    with pytest.raises(AssertionError):
        assert_weights_close(raw.get_weights(), ref.get_weights())


@pytest.mark.parametrize("replicas", [2, 4])
def test_variables_list_the_sharded_state(replicas):
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    settings = dict(gradient_accumulation_steps=K, use_ema=True)
    with s.scope():
        model = many_variable_model()
        unsharded = keras.optimizers.Adam(**settings)
        unsharded.build(model.trainable_variables)
        opt = tfdp.ShardedOptimizer(keras.optimizers.Adam(**settings))
        opt.build(model.trainable_variables)
        zero1 = tfdp.ShardedOptimizer(keras.optimizers.Adam())
        zero1.build(model.trainable_variables)
    listed = {id(v) for v in opt.variables}
    inner = opt.inner_optimizer
    state = ([(v, i) for i, v in enumerate(inner._accumulated_gradients)]
             + [(v, i) for i, v in enumerate(inner._model_variables_moving_average)]
             + [(v, i) for i, v in enumerate(inner._momentums)]
             + [(v, i) for i, v in enumerate(inner._velocities)])
    assert len(state) == 4 * len(model.trainable_variables)
    for v, i in state:  # every piece listed, on its owner's device
        assert id(v) in listed
        assert device_index(v) == opt._owners[i]
    assert id(inner._iterations) in listed and id(opt._iterations) in listed
    # Memory read from the variables is what state_bytes_per_replica() reports ...
    from_variables = variable_bytes_per_device(opt.variables, s)
    assert from_variables == opt.state_bytes_per_replica()
    # ... and about 1/N of the unsharded state (slots + accumulators + EMA) per replica.
    full = variable_bytes_per_device(unsharded.variables, s)
    assert len(set(full)) == 1
    assert sum(from_variables) < 1.05 * full[0]
    for b in from_variables:
        assert b <= 1.10 * full[0] / replicas
    # ZeRO-1 without accumulation/EMA holds half of that (2 of Adam's 4 per-parameter copies).
    np.testing.assert_allclose(sum(zero1.state_bytes_per_replica()), sum(from_variables) / 2, rtol=0.01)


def test_local_accumulators_cost_a_full_gradient_per_replica():
    s = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    with s.scope():
        model = many_variable_model()
        by_mode = {}
        for mode in ("sharded", "local"):
            opt = tfdp.ShardedOptimizer(keras.optimizers.Adam(gradient_accumulation_steps=K),
                                        accumulation=mode)
            opt.build(model.trainable_variables)
            by_mode[mode] = opt.state_bytes_per_replica()
    gradient_bytes = 4 * model.count_params()
    extra = np.asarray(by_mode["local"]) - np.asarray(by_mode["sharded"])
    # local: a full gradient copy on every replica instead of the owned ~1/4 of one.
    assert sum(extra) == 4 * gradient_bytes - gradient_bytes
    for e in extra:
        assert 0.6 * gradient_bytes <= e <= gradient_bytes


def test_keras_users_of_optimizer_variables():
    """get_state_tree / set_state_tree / summary and LossScaleOptimizer read ``variables``."""
    s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    with s.scope():
        model = deep_mlp()
        opt = tfdp.ShardedOptimizer(keras.optimizers.Adam(gradient_accumulation_steps=2, use_ema=True))
        model.compile(optimizer=opt, loss="mse")
        opt.build(model.trainable_variables)
        wrapped = keras.optimizers.LossScaleOptimizer(
            tfdp.ShardedOptimizer(keras.optimizers.Adam()))
        wrapped.build(model.trainable_variables)
    assert {id(v) for v in wrapped.inner_optimizer.variables} <= {id(v) for v in wrapped.variables}
    tree = model.get_state_tree()["optimizer_variables"]
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            walk(v, f"{prefix}{k}/") if isinstance(v, dict) else flat.__setitem__(prefix + k, v)
    walk(tree)
    assert len(flat) == len(opt.variables)
    momentum = opt.inner_optimizer._momentums[0]
    key = momentum.path
    assert key in flat
    flat[key] = np.full(momentum.shape, 0.5, "float32")
    nested = {}
    for path, value in flat.items():
        parts = path.split("/")
        d = nested
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    model.set_state_tree({"optimizer_variables": nested})
    np.testing.assert_array_equal(momentum.numpy(), 0.5)
    model.summary(print_fn=lambda *a, **k: None)


def _fit(strategy, make_opt, x, y, weights, epochs=1, load_from=None, how=None):
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = deep_mlp()
        model.set_weights(weights)
        opt = make_opt()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if load_from is not None:
            opt.build(model.trainable_variables)
            if how == "tf_checkpoint":
                tf.train.Checkpoint(model=model, optimizer=opt).restore(
                    load_from).assert_existing_objects_matched()
            else:
                model.load_weights(load_from)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH), epochs=epochs, verbose=0)
    return model


def _ema_adam(**kw):
    return keras.optimizers.Adam(0.01, global_clipnorm=0.3, gradient_accumulation_steps=K,
                                 use_ema=True, ema_momentum=0.9, **kw)


@functools.cache
def uninterrupted_ema_adam(loss_scaled):
    """One device, uninterrupted: two fit calls of one epoch of ``_ema_adam`` (each ends with
    the EMA overwrite), wrapped in a LossScaleOptimizer if ``loss_scaled``; its weights and
    moving averages. Trained once per module: three checkpoint formats compare with the same
    run (each run is deterministic)."""
    x, y = classification_data()
    def wrap(o):
        return keras.optimizers.LossScaleOptimizer(o) if loss_scaled else o
    reference = _fit(None, lambda: wrap(_ema_adam()), x, y, initial_weights(deep_mlp))
    reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH), epochs=1, verbose=0)
    opt = reference.optimizer.inner_optimizer if loss_scaled else reference.optimizer
    return (reference.get_weights(),
            [v.numpy() for v in opt._model_variables_moving_average])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["weights_h5", "tf_checkpoint", "keras_model", "loss_scale_h5"])
def test_update_boundary_checkpoint_restores_on_another_replica_count(tmp_path, how):
    """4 replicas -> 2 replicas at an update boundary (the end of an epoch of 16
    micro-batches, k=4), with sharded accumulators and EMA: the resumed run continues
    exactly like one device that never stopped."""
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    lso = how == "loss_scale_h5"
    wrap = keras.optimizers.LossScaleOptimizer if lso else (lambda o: o)
    ref_weights, ref_averages = uninterrupted_ema_adam(lso)

    def make():
        return wrap(tfdp.ShardedOptimizer(_ema_adam()))
    first = _fit(tfdp.DataParallelStrategy(devices=cpu_devices(4)), make, x, y, w0)
    sharded_opt = first.optimizer.inner_optimizer if lso else first.optimizer
    assert int(sharded_opt.inner_optimizer._iterations.numpy()) % K == 0  # a boundary
    if lso:
        first.optimizer.dynamic_scale.assign(1024.0)  # a value the restore must bring back
    if how == "tf_checkpoint":
        path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "c"))
    elif how == "keras_model":
        path = str(tmp_path / "m.keras")
        first.save(path)
    else:
        path = str(tmp_path / "w.weights.h5")
        first.save_weights(path)

    s2 = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    if how == "keras_model":
        with s2.scope():
            resumed = keras.models.load_model(path)
        resumed.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH), epochs=1, verbose=0)
    else:
        resumed = _fit(s2, make, x, y, first.get_weights(), load_from=path, how=how)
    if lso:
        # The loss scale came back instead of restarting at 2**15 (in float32 any
        # power-of-two scale divides out exactly, so the weights still match the reference).
        assert float(resumed.optimizer.dynamic_scale.numpy()) == 1024.0
    assert_weights_close(resumed.get_weights(), ref_weights)
    opt = resumed.optimizer.inner_optimizer if lso else resumed.optimizer
    assert int(opt.iterations) == 16 // K * 2
    averages = opt.inner_optimizer._model_variables_moving_average
    assert len(averages) == len(ref_averages)
    for got, want in zip(averages, ref_averages):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_loss_scale_optimizer_mixed_precision_with_accumulation():
    x, y = classification_data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        make = mixed_precision_mlp
        w0 = initial_weights(make)
        def inner():
            return keras.optimizers.Adam(0.01, gradient_accumulation_steps=K)
        ref, _ = train(None, make, lambda: keras.optimizers.LossScaleOptimizer(inner()),
                       x, y, MICRO_BATCH, weights=w0)
        got, hist = train(tfdp.DataParallelStrategy(devices=cpu_devices(2)), make,
                          lambda: keras.optimizers.LossScaleOptimizer(tfdp.ShardedOptimizer(inner())),
                          x, y, MICRO_BATCH, weights=w0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(hist["loss"]).all()
    assert int(got.optimizer.iterations) == int(ref.optimizer.iterations) == 8
    assert_weights_close(got.get_weights(), ref.get_weights(), atol=2e-3, rtol=2e-3)


def test_config_round_trip_keeps_accumulation_mode():
    opt = tfdp.ShardedOptimizer(keras.optimizers.Adam(gradient_accumulation_steps=3, use_ema=True),
                                accumulation="local")
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert restored.accumulation == "local"
    assert restored.inner_optimizer.gradient_accumulation_steps == 3
    assert restored.inner_optimizer.use_ema


# --- two workers x two replicas (real processes) -----------------------------------------------

MW_LAUNCH_TIMEOUT = 240


@pytest.fixture(scope="module")
def two_worker_job(tmp_path_factory):
    """One tfdp-run job (2 workers x 2 replicas) that trains every case of MW_CASES in turn,
    each on a model and optimizer of its own, writing to OUT/<case>/: the job's start-up (two
    TensorFlow processes and the cluster) is paid once for the module."""
    out_dir = tmp_path_factory.mktemp("zero2-two-workers")
    environ = worker_env(TFDP_TEST_OUT=out_dir, TFDP_TEST_CASE=",".join(sorted(MW_CASES)),
                         TF_CPP_MIN_LOG_LEVEL=2)
    code, out = run_job(tfdp_run_command(worker_script("mw_zero2_worker.py"), cpu_replicas=2),
                        environ, MW_LAUNCH_TIMEOUT)
    return code, out, out_dir


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("case", sorted(MW_CASES))
def test_two_workers_two_replicas_accumulate_like_one_device(two_worker_job, case):
    code, out, out_dir = two_worker_job
    assert code == 0, out
    assert "rank 0: 4 replicas, chief=True" in out
    assert f"rank 0: {case} done" in out, out
    tmp_path = out_dir / case

    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    def ds(batch):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    reference = deep_mlp()
    reference.set_weights(w0)
    compile_for(reference, MW_CASES[case](sharded=False))
    reference.fit(ds(MW_REFERENCE_BATCH[case]), epochs=2, verbose=0)
    for rank in range(2):
        saved = dict(np.load(tmp_path / f"weights-{rank}.npz"))
        got = [saved[f"arr_{i}"] for i in range(len(w0))]
        assert_weights_close(got, reference.get_weights())
        replica_keys = [k for k in saved if "_replica" in k]
        assert len(replica_keys) == 2 * len(w0)
        for k in replica_keys:  # every replica of every worker holds the same weights
            np.testing.assert_array_equal(saved[k], saved[k.split("_replica")[0] + "_replica0"])

    # The checkpoint both workers wrote together (state gathered from its owners on both
    # workers) resumes in one process on 2 replicas and continues like the reference.
    reference.fit(ds(MW_REFERENCE_BATCH[case]), epochs=1, verbose=0)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    with s.scope():
        resumed = deep_mlp()
        compile_for(resumed, MW_CASES[case](sharded=True))
        resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(tmp_path / "ckpt.weights.h5")
    resumed.fit(ds(MICRO_BATCH), epochs=1, verbose=0)
    assert_weights_close(resumed.get_weights(), reference.get_weights())


def test_zero_paper_formulas_in_the_memory_tool():
    """tools/zero_memory.py's formulas reproduce the paper's Figure 1 (Ψ = 7.5B, N = 64,
    K = 12: 120 GB, 31.4 GB, 16.6 GB per device) and the float32 analogue."""
    import zero_memory as zm  # tools/ is on pytest's pythonpath

    psi = 7.5e9
    assert psi * zm.zero_bytes_per_parameter(0, 64) / 1e9 == pytest.approx(120.0)
    assert psi * zm.zero_bytes_per_parameter(1, 64) / 1e9 == pytest.approx(31.4, abs=0.05)
    assert psi * zm.zero_bytes_per_parameter(2, 64) / 1e9 == pytest.approx(16.6, abs=0.05)
    assert zm.zero_bytes_per_parameter(1, 4, "float32") == pytest.approx(4 + 4 + 8 / 4)
    assert zm.zero_bytes_per_parameter(2, 4, "float32") == pytest.approx(4 + 12 / 4)
    assert zm.zero_bytes_per_parameter(2, 1) == zm.zero_bytes_per_parameter(0, 1) == 16
    with pytest.raises(ValueError, match="stage=3"):
        zm.zero_bytes_per_parameter(3, 4)


def test_traffic_model_in_the_memory_tool():
    """Bytes one replica sends per update: ZeRO-2 "sharded" reduce-scatters every micro-batch."""
    import zero_memory as zm  # tools/ is on pytest's pythonpath

    sizes = [100, 100, 100, 100]  # 4 equal variables over 4 replicas: rows of 100 elements
    assert zm.bytes_sent_per_update(sizes, 4, 4, "all_reduce") == pytest.approx(2 * 3 / 4 * 400 * 4)
    assert zm.bytes_sent_per_update(sizes, 4, 4, "zero") == 2 * 3 * 100 * 4
    assert zm.bytes_sent_per_update(sizes, 4, 4, "zero2_sharded") == (4 + 1) * 3 * 100 * 4
    assert zm.bytes_sent_per_update(sizes, 1, 4, "zero2_sharded") == 0
    # A dominant variable pads every row to its size.
    assert zm.bytes_sent_per_update([300, 10, 10, 10], 4, 1, "zero") == 2 * 3 * 300 * 4


@pytest.mark.slow
def test_sharded_accumulators_checkpoint_even_mid_cycle(tmp_path):
    """What the docstring claims about mid-cycle files: with the default "sharded" mode the
    accumulators hold globally reduced sums and are saved consolidated, so a file written
    after 14 micro-batches (2 into a cycle of 4) resumes on 2 replicas exactly; with
    "local" accumulators the same file loses the other replicas' partial sums."""
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    reference, _ = one_device("adam_global_clipnorm")
    head = 14 * MICRO_BATCH
    results = {}
    for mode in ("sharded", "local"):
        make = sharded(OPTIMIZERS["adam_global_clipnorm"], mode, gradient_accumulation_steps=K)
        s4 = tfdp.DataParallelStrategy(devices=cpu_devices(4))
        with s4.scope():
            first = deep_mlp()
            first.set_weights(w0)
            compile_for(first, make())
        first.fit(tf.data.Dataset.from_tensor_slices((x[:head], y[:head])).batch(MICRO_BATCH),
                  epochs=1, verbose=0)
        assert int(first.optimizer.inner_optimizer._iterations.numpy()) % K == 2  # mid-cycle
        path = str(tmp_path / f"{mode}.weights.h5")
        first.save_weights(path)
        s2 = tfdp.DataParallelStrategy(devices=cpu_devices(2))
        with s2.scope():
            resumed = deep_mlp()
            compile_for(resumed, make())
            resumed.optimizer.build(resumed.trainable_variables)
            resumed.load_weights(path)
        rest = (np.concatenate([x[head:], x]), np.concatenate([y[head:], y]))
        resumed.fit(tf.data.Dataset.from_tensor_slices(rest).batch(MICRO_BATCH), epochs=1, verbose=0)
        results[mode] = resumed.get_weights()
    assert_weights_close(results["sharded"], reference)
    with pytest.raises(AssertionError):
        assert_weights_close(results["local"], reference)


# --- The exchanges in rounds (issue 33, item 5; tfdp/optimizers/exchange.py) ------------------
ROUND_CASES = {
    # name: (optimizer factory, replicas, global batch)
    "adam_global_clipnorm_3_replicas": (lambda: OPTIMIZERS["adam_global_clipnorm"](), 3, 48),
    "adamw_accumulation_ema": (lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.05, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=2,
        gradient_accumulation_steps=2), 4, 32),
}


@pytest.mark.parametrize("case", [
    # adamw_accumulation_ema: 7.5 s or more in the quick subset (2026-11-26); whole suite only.
    pytest.param(name, marks=pytest.mark.slow) if name == "adamw_accumulation_ema" else name
    for name in sorted(ROUND_CASES)])
def test_exchange_in_many_small_rounds_equals_one_device(case):
    """With rows of 48 elements (``bucket_bytes``) the reduce-scatter and the all-gather take
    many rounds: tensors span rounds, short streams are padded, pieces are written into the
    variables' rows in place, EMA averages are gathered. Training still equals the wrapped
    optimizer on one device."""
    from tfdp.optimizers import exchange, packing

    make, replicas, batch = ROUND_CASES[case]
    x, y = classification_data(n=240)  # whole batches of 48 and 32: equal replica batches
    w0 = initial_weights(deep_mlp)
    ref, ref_hist = train(None, deep_mlp, make, x, y, batch, weights=w0)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas), bucket_bytes=replicas * 4 * 48)
    got, hist = train(s, deep_mlp, lambda: tfdp.ShardedOptimizer(make()), x, y, batch, weights=w0)
    assert_weights_close(got.get_weights(), ref.get_weights())
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert_replicas_identical(s, got)
    # Guard: the exchange did run in many rounds, with tensors cut between rounds.
    shapes = [tuple(v.shape) for v in got.trainable_variables]
    sizes = {i: int(np.prod(shape)) for i, shape in enumerate(shapes)}
    rows = {i: int(np.prod(shape[1:])) for i, shape in enumerate(shapes)}
    c = exchange.round_elements(s.bucket_bytes, replicas, 4, sizes.values())
    rounds = packing.plan_rounds(
        packing.owner_streams(sizes, got.optimizer._owners, replicas, rows), c)
    assert c == 48 and len(rounds) >= 5
    assert any(seg.size < sizes[seg.index] for plan in rounds for row in plan.rows for seg in row)
