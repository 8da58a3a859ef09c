"""ZeRO stage 3 (``DataParallelStrategy(shard_parameters=True)``): N replicas holding slices of
the parameters and of the optimizer state train like one device on the same global batch,
hold about 1/N of the bytes, and save and restore whole tensors."""

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from helpers import (assert_weights_close, classification_data, cpu_devices, image_data,
                     initial_weights, token_data)
from launching import run_job, tfdp_run_command, worker_env, worker_script
from tfdp.strategy import xla
from tfdp.strategy.zero3 import config as zero3_config
from tfdp.strategy.zero3 import layout, parameters, units_xla
from tfdp.strategy.zero3 import optimizer as zero3_optimizer
from tfdp.strategy.zero3.partition import owner_of, shard_layout
from zero3_cases import MODELS, OPTIMIZERS, compile_for, dense_stack

GLOBAL_BATCH = 64


def data_for(model_name):
    if model_name == "conv_bn":
        return image_data()
    if model_name == "tied":
        return token_data(vocab=20)
    return classification_data()


def train(strategy, model_fn, optimizer_fn, data, weights, epochs=2, **compile_kwargs):
    x, y = data
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = model_fn()
        model.set_weights(weights)
        compile_for(model, optimizer_fn(), **compile_kwargs)
    model.fit(ds, epochs=epochs, verbose=0)
    return model


@functools.cache
def one_device(opt_name):
    """One device's weights after 2 epochs of ``dense_stack`` with ``opt_name`` on
    ``classification_data()`` from ``initial_weights``: the reference several tests compare
    with, trained once per module (each run is deterministic)."""
    return train(None, dense_stack, OPTIMIZERS[opt_name], classification_data(),
                 initial_weights(dense_stack)).get_weights()


def zero3(replicas=4, **kwargs):
    kwargs.setdefault("shard_min_elements", 0)  # every trainable float variable sharded
    return tfdp.DataParallelStrategy(devices=cpu_devices(replicas), shard_parameters=True,
                                     **kwargs)


def sharded_count(model):
    return sum(layout.is_sharded(v) for v in model.trainable_variables)


# --- The partition rule (pure) -----------------------------------------------------------------

def test_layout_pads_the_last_slice_and_every_element_has_one_owner():
    assert shard_layout(90, 4) == (23, 2)
    assert shard_layout(80, 4) == (20, 0)
    assert shard_layout(3, 4) == (1, 1)  # fewer elements than replicas: one each, one padded
    owners = [owner_of(e, 90, 4) for e in range(90)]
    assert owners == sorted(owners) and set(owners) == {0, 1, 2, 3}
    assert [owners.count(r) for r in range(4)] == [23, 23, 23, 21]
    with pytest.raises(ValueError, match="outside"):
        owner_of(90, 90, 4)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="shard_parameters"):
        tfdp.DataParallelStrategy(devices=cpu_devices(2), shard_parameters="yes")
    with pytest.raises(ValueError, match="shard_min_elements"):
        tfdp.DataParallelStrategy(devices=cpu_devices(2), shard_parameters=True,
                                  shard_min_elements=-1)


# --- Training equals one device ----------------------------------------------------------------

def test_sharded_training_equals_one_device_and_variables_are_slices():
    data = classification_data()
    w0 = initial_weights(dense_stack)
    ref = one_device("adam_global_clipnorm")
    strategy = zero3()
    model = train(strategy, dense_stack, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    assert_weights_close(model.get_weights(), ref, atol=1e-6, rtol=1e-5)
    # Every trainable variable is stored as four slices, none of them the whole tensor.
    assert sharded_count(model) == len(model.trainable_variables) == 6
    for variable in model.trainable_variables:
        slices = variable.value.components
        size, pad = shard_layout(int(np.prod(variable.shape)), 4)
        assert [tuple(s.shape) for s in slices] == [(size,)] * 4
        assert len({s.device for s in slices}) == 4
    # Adam's moments are sliced like their parameters.
    moments = [v for v in model.optimizer.variables if layout.is_sharded(v)]
    assert len(moments) == 2 * 6


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", sorted(set(OPTIMIZERS) - {"adam_global_clipnorm"}))
def test_every_optimizer_with_sharded_parameters_equals_one_device(opt_name):
    data = classification_data()
    w0 = initial_weights(dense_stack)
    ref = one_device(opt_name)
    model = train(zero3(), dense_stack, OPTIMIZERS[opt_name], data, w0)
    assert sharded_count(model) == 6
    assert_weights_close(model.get_weights(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["conv_bn", "tied", "frozen"])
def test_models_users_bring_train_like_one_device(model_name):
    model_fn = MODELS[model_name]
    data = data_for(model_name)
    w0 = initial_weights(model_fn)
    ref = train(None, model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    model = train(zero3(), model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    assert sharded_count(model) >= 1
    assert_weights_close(model.get_weights(), ref.get_weights(), atol=1e-6, rtol=1e-5)
    if model_name == "frozen":  # the frozen kernel did not move, and is still sliced
        assert_weights_close(model.get_weights()[:2], w0[:2], atol=0, rtol=0)
        assert layout.is_sharded(model.layers[0].kernel)
    if model_name == "conv_bn":  # BatchNorm statistics stay mirrored (not trainable)
        stats = [v for v in model.non_trainable_variables]
        assert stats and not any(layout.is_sharded(v) for v in stats)


@pytest.mark.slow
def test_dropout_and_a_custom_loop_with_sharded_parameters_equal_one_device():
    """The idioms users have: Dropout between sharded layers (each replica draws what one
    device draws for its rows), and a custom loop through strategy.run with a tape."""
    def model_fn():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(40, activation="relu"),
                                 keras.layers.Dropout(0.3), keras.layers.Dense(30),
                                 keras.layers.Dropout(0.2), keras.layers.Dense(3)])
    data = classification_data()
    w0 = initial_weights(model_fn)
    keras.utils.set_random_seed(7)
    ref = train(None, model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    keras.utils.set_random_seed(7)
    model = train(zero3(), model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    assert sharded_count(model) == 6
    assert_weights_close(model.get_weights(), ref.get_weights(), atol=1e-6, rtol=1e-5)

    # The custom loop of examples/custom_loop.py (strategy.run, a tape, optimizer.apply).
    import custom_loop

    def loop(strategy):
        source = tf.data.Dataset.from_tensor_slices(data)
        if strategy is None:
            strategy, batches = tf.distribute.get_strategy(), source.batch(GLOBAL_BATCH)
        else:
            batches = tfdp.data.distribute(strategy, source, GLOBAL_BATCH)
        with strategy.scope():
            net = dense_stack()
            net.set_weights(initial_weights(dense_stack))
            opt = keras.optimizers.Adam(0.05, global_clipnorm=0.5)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        custom_loop.train(strategy, net, opt, loss_fn, batches, len(data[0]) // GLOBAL_BATCH, 2,
                          GLOBAL_BATCH, report=lambda line: None)
        return net

    net = loop(zero3())
    assert sharded_count(net) == 6
    assert_weights_close(net.get_weights(), loop(None).get_weights(), atol=1e-6, rtol=1e-5)


def compiled_units(model):
    """The layers of ``model`` whose ZeRO-3 unit ran as an XLA program of its own."""
    return [layer for layer in model._flatten_layers() if units_xla.compiled_calls.get(layer)]


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_global_clipnorm", "adamw_clipnorm",
                                      "lamb"])
def test_jit_compile_true_with_sharded_parameters_equals_one_device(opt_name):
    """Under XLA each unit is compiled on its own (plan "units"), its gathers outside: the
    weights equal one device's (not compiled) within 1e-6."""
    data = classification_data()
    w0 = initial_weights(dense_stack)
    ref = one_device(opt_name)  # not compiled with XLA
    model = train(zero3(), dense_stack, OPTIMIZERS[opt_name], data, w0, jit_compile=True)
    assert_weights_close(model.get_weights(), ref, atol=1e-6, rtol=1e-5)
    assert len(compiled_units(model)) == 3  # every Dense layer ran as its own XLA program
    # ... and its backward program ran on what its forward program kept, not recomputing it
    assert [units_xla.backward_kinds[layer] for layer in compiled_units(model)] == [{"kept"}] * 3


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tied", "frozen"])
def test_jit_compile_true_with_sharded_parameters_on_models_users_bring(model_name):
    model_fn = MODELS[model_name]
    data = data_for(model_name)
    w0 = initial_weights(model_fn)
    ref = train(None, model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    model = train(zero3(), model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0,
                  jit_compile=True)
    assert compiled_units(model)
    assert_weights_close(model.get_weights(), ref.get_weights(), atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_activations_recomputes_every_compiled_unit_like_one_device():
    """``checkpoint_activations=True``: each compiled unit keeps only its inputs and recomputes
    its forward pass in its backward pass (less memory for activation-heavy models), and
    trains like one device."""
    strategy = zero3(checkpoint_activations=True)
    assert strategy.checkpoint_activations
    model = train(strategy, dense_stack, OPTIMIZERS["adam_global_clipnorm"],
                  classification_data(), initial_weights(dense_stack), jit_compile=True)
    assert [units_xla.backward_kinds[layer] for layer in compiled_units(model)] == [
        {"recomputed"}] * 3
    assert_weights_close(model.get_weights(), one_device("adam_global_clipnorm"), atol=1e-6,
                         rtol=1e-5)


class WeightNormDense(keras.layers.Layer):
    """``x @ (kernel / |kernel|)`` (weight normalisation, Salimans & Kingma 2016): the matmul's
    gradient reads the normalised kernel, a value computed from the parameters alone, which a
    compiled unit must not keep to its backward pass."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units),
                                      initializer="glorot_uniform")

    def call(self, x):
        kernel = self.kernel / keras.ops.norm(self.kernel, axis=0, keepdims=True)
        return keras.ops.tanh(keras.ops.matmul(x, kernel))


@pytest.mark.slow
def test_a_unit_whose_gradient_reads_a_value_of_its_parameters_recomputes_like_one_device():
    """A compiled unit keeps only activations: where its backward program would read a value
    of its parameters alone (here a normalised kernel), it recomputes its forward pass
    instead, and still trains like one device; the Dense unit beside it keeps its
    activations."""
    def model_fn():
        return keras.Sequential([keras.Input((8,)), WeightNormDense(40), keras.layers.Dense(3)])
    data = classification_data()
    w0 = initial_weights(model_fn)
    ref = train(None, model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    model = train(zero3(), model_fn, OPTIMIZERS["adam_global_clipnorm"], data, w0,
                  jit_compile=True)
    normalised, dense = model.layers
    assert units_xla.backward_kinds[normalised] == {"recomputed"}
    assert units_xla.backward_kinds[dense] == {"kept"}
    assert_weights_close(model.get_weights(), ref.get_weights(), atol=1e-6, rtol=1e-5)


class DenseAddingLoss(keras.layers.Dense):
    """A Dense layer that adds a penalty on its outputs with ``add_loss`` in its call."""

    def call(self, x):
        y = super().call(x)
        self.add_loss(0.5 * keras.ops.mean(keras.ops.square(y)))
        return y


@pytest.mark.slow
def test_losses_a_compiled_unit_adds_join_the_models_loss_like_one_device():
    """``add_loss`` in a unit's call and an activity regularizer run inside the unit's XLA
    program; their losses come out of it and join the model's (they were dropped: 4.2e-3 off
    one device), so training equals one device's."""
    def model_fn():
        return keras.Sequential([
            keras.Input((8,)), DenseAddingLoss(40, activation="tanh"),
            keras.layers.Dense(30, activation="tanh",
                               activity_regularizer=keras.regularizers.L2(0.5)),
            keras.layers.Dense(3)])
    data = classification_data()
    w0 = initial_weights(model_fn)
    ref = train(None, model_fn, OPTIMIZERS["sgd_momentum"], data, w0)
    model = train(zero3(), model_fn, OPTIMIZERS["sgd_momentum"], data, w0, jit_compile=True)
    assert len(compiled_units(model)) == 3
    assert_weights_close(model.get_weights(), ref.get_weights(), atol=1e-6, rtol=1e-5)


def test_the_step_plan_compiles_units_for_zero3_and_keeps_the_split_otherwise():
    assert xla.step_plan(True, 4, True, sharded_units=True) == "units"
    assert xla.step_plan(True, 4, False, sharded_units=True) == "units"
    assert xla.step_plan(True, 4, True, sharded_units=False) == "split"
    assert xla.step_plan(False, 4, True, sharded_units=True) == "keras"
    assert xla.step_plan(True, 1, True, sharded_units=True) == "keras"


@pytest.mark.slow
def test_mixed_precision_loss_scaling_sharded_equals_unsharded():
    def model_fn():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(40, activation="relu"),
                                 keras.layers.Dense(3, dtype="float32")])
    data = classification_data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        w0 = initial_weights(model_fn)
        def opt():  # Keras wraps it in a LossScaleOptimizer
            return keras.optimizers.Adam(0.01)
        plain = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), model_fn, opt, data, w0)
        model = train(zero3(), model_fn, opt, data, w0)
        ref = train(None, model_fn, opt, data, w0)
        compiled = train(zero3(), model_fn, opt, data, w0, jit_compile=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert sharded_count(model) == 4
    # Both Dense layers are units (found through Keras's autocast, which casts a variable's
    # value inside a mixed-precision call), and under XLA each one's float16 kernel is the
    # float32 parameter cast inside its program: the backward program gets the cast of the
    # re-gathered parameter, not a kept copy.
    assert [units_xla.backward_kinds[layer] for layer in compiled_units(compiled)] == [
        {"kept"}] * 2
    assert_weights_close(compiled.get_weights(), ref.get_weights(), atol=2e-3, rtol=2e-3)
    # float16 products differ with the per-replica batch; sharding changes nothing of that.
    assert_weights_close(model.get_weights(), plain.get_weights(), atol=1e-6, rtol=1e-6)
    assert_weights_close(model.get_weights(), ref.get_weights(), atol=2e-3, rtol=2e-3)


def test_guard_clipping_with_slice_norms_would_differ(monkeypatch):
    """What the clipping test would catch: norms of the local slices, not summed over the
    replicas, clip far more weakly than one device does."""
    data = classification_data()
    w0 = initial_weights(dense_stack)
    ref = one_device("adam_global_clipnorm")  # before the patch, as one device trains
    monkeypatch.setattr(zero3_optimizer, "sum_over_replicas", lambda value: value)
    model = train(zero3(), dense_stack, OPTIMIZERS["adam_global_clipnorm"], data, w0)
    gap = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), ref))
    assert gap > 1e-4


# --- Memory: bytes per replica -----------------------------------------------------------------

def wide_mlp():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


@pytest.mark.parametrize("replicas", [2, 4])
def test_parameters_and_adam_state_take_one_nth_per_replica(replicas):
    x = np.random.default_rng(0).normal(size=(64, 64)).astype("float32")
    y = np.arange(64) % 10
    strategy = zero3(replicas, shard_min_elements=zero3_config.DEFAULT_SHARD_MIN_ELEMENTS)
    with strategy.scope():
        model = wide_mlp()
        compile_for(model, keras.optimizers.Adam(1e-3))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    mirrored = sum(int(np.prod(v.shape)) for v in model.trainable_variables
                   if not layout.is_sharded(v))
    assert mirrored == 256 + 256 + 10 + 2560  # biases and the 2,560-element head stay whole
    held = parameters.sharded_bytes_per_replica(
        model.trainable_variables + model.optimizer.variables, strategy)
    # Parameters + Adam's two moments: 12 bytes per parameter, 1/N of them per replica
    # (padding included), plus the mirrored variables whole.
    bound = 1.1 * 12 * (params - mirrored) / replicas + 12 * mirrored + 64  # + counters
    assert len(held) == replicas
    assert max(held) <= bound, (held, bound)
    unsharded = 12 * params
    assert max(held) < 0.6 * unsharded if replicas == 2 else max(held) < 0.35 * unsharded


# --- Whole tensors outside the step -------------------------------------------------------------

@pytest.mark.slow
def test_get_set_weights_save_and_load_see_whole_tensors(tmp_path):
    data = classification_data()
    w0 = initial_weights(dense_stack)
    strategy = zero3()
    model = train(strategy, dense_stack, OPTIMIZERS["adam_global_clipnorm"], data, w0, epochs=1)
    weights = model.get_weights()
    assert [w.shape for w in weights] == [w.shape for w in w0]
    # set_weights gives every replica its slice of the whole tensor.
    model.set_weights(w0)
    assert_weights_close(model.get_weights(), w0, atol=0, rtol=0)
    model.set_weights(weights)
    predicted = model.predict(data[0][:16], verbose=0)

    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "x.npy", data[0][:16])
    code = ("import numpy as np, keras; m = keras.saving.load_model('model.keras'); "
            "np.save('p.npy', m.predict(np.load('x.npy'), verbose=0))")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120,
                   env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), predicted, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_from_four_replicas_restores_on_two_and_continues_like_one_device(tmp_path):
    data = classification_data()
    w0 = initial_weights(dense_stack)
    opt = OPTIMIZERS["adam_global_clipnorm"]
    ref = one_device("adam_global_clipnorm")
    model = train(zero3(4), dense_stack, opt, data, w0, epochs=1)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")

    strategy = zero3(2)
    with strategy.scope():
        resumed = dense_stack()
        compile_for(resumed, opt())
        resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        path).assert_existing_objects_matched()
    assert [tuple(c.shape) for c in resumed.layers[0].kernel.value.components] == [(160,)] * 2
    assert_weights_close(resumed.get_weights(), model.get_weights(), atol=0, rtol=0)
    ds = tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH)
    resumed.fit(ds, epochs=1, verbose=0)  # the second epoch, on 2 replicas
    assert_weights_close(resumed.get_weights(), ref, atol=1e-6, rtol=1e-5)


# --- What cannot be sharded is refused -----------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adafactor(0.01),
                                  lambda: keras.optimizers.Lamb(0.01)],
                         ids=["adafactor", "keras_lamb"])
def test_optimizers_needing_whole_tensors_are_refused_with_the_fix(make):
    data = classification_data()
    with pytest.raises(ValueError, match="tfdp.optimizers.LAMB|elementwise"):
        train(zero3(2), dense_stack, make, data, initial_weights(dense_stack), epochs=1)


def test_sharded_optimizer_under_zero3_is_refused_with_the_fix():
    strategy = zero3(2)
    with strategy.scope():
        model = dense_stack()
        compile_for(model, tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01)))
    with pytest.raises(ValueError, match="shard_parameters=True"):
        model.optimizer.build(model.trainable_variables)


# --- Two workers x two replicas -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["no_xla", "xla"])
def test_two_workers_two_replicas_train_like_one_device_and_save_a_plain_keras_file(tmp_path,
                                                                                     jit):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_MODEL="dense",
                         TFDP_TEST_OPTIMIZER="adam_global_clipnorm", TF_CPP_MIN_LOG_LEVEL=2,
                         TFDP_TEST_JIT=int(jit))
    code, out = run_job(tfdp_run_command(worker_script("mw_zero3_worker.py"), cpu_replicas=2),
                        environ, 240)
    assert code == 0, out
    assert "rank 0: 4 replicas, chief=True" in out
    # The save gathers each of the 6 variables whole with one traced function (one per
    # variable made TensorFlow warn "5 out of the last 5 calls ... triggered tf.function
    # retracing" at every job's first save).
    assert "retracing" not in out, out
    w0 = initial_weights(dense_stack)
    ref = one_device("adam_global_clipnorm")
    for rank in range(2):
        saved = np.load(tmp_path / f"weights-{rank}.npz")
        assert_weights_close([saved[f"arr_{i}"] for i in range(len(w0))], ref,
                             atol=1e-6, rtol=1e-5)
        # Each worker holds 2 slices of each variable, of 1/4 of its elements.
        assert tuple(saved["slice0_0"]) == (shard_layout(8 * 40, 4)[0],)
        assert "slice0_2" not in saved
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert_weights_close(loaded.get_weights(), ref, atol=1e-6, rtol=1e-5)


# --- The tools' pure parts --------------------------------------------------------------------

def test_speed_ratios_pair_runs_within_a_round_and_the_headline_reads_oom():
    import bench_zero3
    import zero3_headline

    rows = [dict(round=0, layout="4x1", config="unsharded", step_ms=100.0),
            dict(round=0, layout="4x1", config="zero3", step_ms=130.0),
            dict(round=1, layout="4x1", config="unsharded", step_ms=200.0),
            dict(round=1, layout="4x1", config="zero3", step_ms=220.0),
            dict(round=1, layout="2x2", config="zero3", step_ms=10.0)]
    assert bench_zero3.ratios(rows, "4x1", "zero3") == pytest.approx([1.3, 1.1])
    assert bench_zero3.ratios(rows, "2x2", "zero3") == []  # no unsharded run to pair with
    assert zero3_headline.out_of_memory("tensorflow.python.framework.errors_impl."
                                        "ResourceExhaustedError: OOM when allocating")
    assert not zero3_headline.out_of_memory("step 1: 12.0 s, loss 2.3")


def test_a_compiled_units_key_tells_apart_calls_of_another_structure():
    """Review finding: the key held only the non-tensor values, so ``mha(q, v)`` and
    ``mha(q, v, attention_mask=m)`` shared one compiled call (the mask dropped)."""
    x, m = tf.constant([1.0]), tf.constant([0.0])

    def key(args, kwargs):
        flat = tf.nest.flatten((args, kwargs))
        positions = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor)]
        return units_xla.static_key(args, kwargs, flat, positions)

    assert key((x, x), {}) != key((x, x), {"attention_mask": m})
    assert key((x,), {"mask": m}) != key((x, m), {})
    assert key((x,), {"training": True}) != key((x,), {"training": False})
    assert key((x,), {"training": True}) == key((m,), {"training": True})
