"""XLA under the strategy (tfdp/xla.py, issue 23): jit_compile=True on several CPU replicas
and several workers trains exactly like one device, with and without XLA; the compiled part
reads no variable and really runs compiled; "auto" resolves as Keras would on one device."""

import functools
import json
import logging

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp.strategy import xla
from tfdp.strategy import options
from helpers import (assert_weights_close, classification_data, cpu_devices, initial_weights,
                     mlp, replica_components, train)
import xla_cases
from launching import run_job, tfdp_run_command, worker_env, worker_script


# --- pure policies ----------------------------------------------------------------------------

@pytest.mark.parametrize("device,supports,replicas,keras_step,expected", [
    ("GPU", True, 1, True, True),     # one GPU: as Keras without a strategy
    ("GPU", True, 8, True, True),     # several GPUs: tfdp splits the step
    ("GPU", False, 8, True, False),   # a layer without XLA support, or op determinism on
    ("GPU", True, 8, False, False),   # own train_step, several replicas: cannot split
    ("GPU", True, 1, False, True),    # own train_step, one replica: Keras compiles it whole
    ("CPU", True, 1, True, False),    # Keras turns XLA off on CPU-only hosts
    ("CPU", True, 4, True, False),
    ("TPU", True, 8, True, False),
])
def test_auto_jit_compile_policy(device, supports, replicas, keras_step, expected):
    assert xla.resolve_auto_jit_compile(device, supports, replicas, keras_step) is expected


@pytest.mark.parametrize("jit,replicas,keras_step,expected", [
    (False, 4, True, "keras"), (False, 4, False, "keras"),
    (True, 1, True, "keras"), (True, 1, False, "keras"),
    (True, 4, True, "split"), (True, 4, False, "no_xla"),
])
def test_step_plan_policy(jit, replicas, keras_step, expected):
    assert xla.step_plan(jit, replicas, keras_step) == expected
    assert expected in xla.STEP_PLANS


@pytest.mark.parametrize("kind,workers,keras_step,expected", [
    ("train", 2, True, True),
    ("train", 1, True, False),    # one worker: Keras averages the logs locally, no collective
    ("train", 2, False, False),   # the user's own train_step keeps its order
    ("test", 2, True, False),     # no gradients to ride with
])
def test_logs_ride_with_the_gradients_only_where_a_collective_is_saved(kind, workers, keras_step,
                                                                       expected):
    assert xla.rides_metrics(kind, workers, keras_step) is expected


def test_an_instance_override_of_train_step_is_the_users_step():
    # tfdp's own train steps (split, riding logs) do not call model.train_step, so an override
    # on the instance must make tfdp keep Keras's path, which calls it; a wrapper marked
    # transparent (StragglerMonitor's: it only observes) does not.
    model = mlp()
    assert xla._keras_step(model, "train_step")
    original = model.train_step
    model.train_step = lambda data: original(data)
    assert not xla._keras_step(model, "train_step")
    model.train_step._tfdp_transparent = True
    assert xla._keras_step(model, "train_step")
    assert xla._keras_step(model, "test_step")


def test_jit_compile_policy_refuses_only_what_xla_cannot_compile():
    message = options.jit_compile_error("CPU", 4)
    for needed in ("jit_compile=True", "4 CPU replicas", "cross-replica collectives",
                   "tfdp.compile_gradients", "jit_compile=False"):
        assert needed in message, needed
    assert options.jit_compile_error("CPU", 1) is None  # no collective to compile
    assert "2 GPU replicas in one process" in options.jit_compile_error("GPU", 2, 2)
    # Guard: one GPU per worker is left to TensorFlow, which compiles GPU collectives.
    assert options.jit_compile_error("GPU", 8, 1) is None


# Moved from test_rough_edges.py (issue 10's jit_compile section). Since issue 23, fit and
# evaluate with jit_compile=True on CPU replicas train (they were refused before);
# strategy.run inside tf.function(jit_compile=True) is still refused.
JIT_MESSAGE = "jit_compile=True cannot compile a step of 2 CPU replicas"


def test_jit_compile_policy_refuses_several_cpu_replicas_only():
    message = options.jit_compile_error("CPU", 4)
    for needed in ("jit_compile=True", "4 CPU replicas",
                   "XLA on CPU cannot compile the cross-replica collectives",
                   "jit_compile=False", "jit_compile='auto'", "one replica"):
        assert needed in message, needed
    assert options.jit_compile_error("CPU", 1) is None  # no collective to compile
    # Guard: one GPU per process is left to TensorFlow, which compiles collectives there.
    assert options.jit_compile_error("GPU", 8) is None


def _jit_model(strategy, jit_compile):
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
    return model


@pytest.mark.slow
def test_jit_compile_true_on_cpu_replicas_fits_evaluates_and_predicts():
    x, y = classification_data(n=32)
    model = _jit_model(tfdp.DataParallelStrategy(cpu_devices(2)), True)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][0])
    assert np.all(np.isfinite(model.evaluate(x, y, batch_size=16, verbose=0)))
    # predict jit-compiles only the per-replica function (no collective inside), as Keras does.
    assert model.predict(x, batch_size=16, verbose=0).shape == (32, 3)


def test_jit_compile_in_a_custom_loop_is_the_same_clear_error():
    strategy = tfdp.DataParallelStrategy(cpu_devices(2))

    @tf.function(jit_compile=True)
    def step(v):
        return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("sum", t),
                            args=(v,))

    with pytest.raises(ValueError, match=JIT_MESSAGE):
        step(tf.constant(1.0))


def test_keras_auto_jit_compile_is_not_refused():
    x, y = classification_data(n=32)
    model = _jit_model(tfdp.DataParallelStrategy(cpu_devices(2)), "auto")
    assert model.jit_compile is False  # "auto" leaves XLA off on CPUs, as Keras does on one
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][0])


def test_one_replica_trains_with_jit_compile_true_like_without():
    x, y = classification_data(n=64)
    def sgd():
        return keras.optimizers.SGD(0.1)
    compiled, _ = train(tfdp.DataParallelStrategy(cpu_devices(1)), mlp, sgd, x, y, 16,
                        weights=initial_weights(mlp), compile_kwargs={"jit_compile": True},
                        fit_kwargs={"shuffle": False})
    assert compiled.jit_compile is True
    assert xla.compiled_train_step(compiled) is None  # one replica: Keras compiles it whole
    plain, _ = train(tfdp.DataParallelStrategy(cpu_devices(1)), mlp, sgd, x, y, 16,
                     weights=initial_weights(mlp), fit_kwargs={"shuffle": False})
    assert_weights_close(compiled.get_weights(), plain.get_weights())


# --- model.fit: 4 CPU replicas with XLA == one device ------------------------------------------

@functools.lru_cache(maxsize=None)
def _one_device(opt_name, jit_compile):
    x, y = xla_cases.data()
    model, history = train(None, mlp, xla_cases.OPTIMIZERS[opt_name], x, y,
                           xla_cases.GLOBAL_BATCH, epochs=xla_cases.EPOCHS,
                           weights=xla_cases.weights(),
                           compile_kwargs={"jit_compile": jit_compile})
    assert model.jit_compile is jit_compile
    return model.get_weights(), history


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", sorted(xla_cases.OPTIMIZERS))
def test_four_replicas_with_xla_train_like_one_device(opt_name):
    x, y = xla_cases.data()
    strategy = tfdp.DataParallelStrategy(cpu_devices(4))
    model, history = train(strategy, mlp, xla_cases.OPTIMIZERS[opt_name], x, y,
                           xla_cases.GLOBAL_BATCH, epochs=xla_cases.EPOCHS,
                           weights=xla_cases.weights(), compile_kwargs={"jit_compile": True})
    assert model.jit_compile is True
    compiled = xla.compiled_train_step(model)
    assert compiled is not None  # the split step ran ...
    assert compiled.function.experimental_get_tracing_count() == 4  # ... once per replica
    for jit_reference in (False, True):
        ref_weights, ref_history = _one_device(opt_name, jit_reference)
        assert_weights_close(model.get_weights(), ref_weights)
        np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)
        np.testing.assert_allclose(history["accuracy"], ref_history["accuracy"], rtol=1e-5)
    for var in model.trainable_variables:  # every replica holds the same weights
        components = replica_components(strategy, var)
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


@pytest.mark.slow
def test_evaluate_and_predict_with_xla_equal_one_device():
    x, y = classification_data(n=128)
    weights = initial_weights(mlp)
    def sgd():
        return keras.optimizers.SGD(0.1)
    ref, _ = train(None, mlp, sgd, x, y, 32, epochs=1, weights=weights)
    got, _ = train(tfdp.DataParallelStrategy(cpu_devices(4)), mlp, sgd, x, y, 32, epochs=1,
                   weights=weights, compile_kwargs={"jit_compile": True},
                   fit_kwargs={"validation_data": (x, y)})
    np.testing.assert_allclose(got.evaluate(x, y, batch_size=32, verbose=0),
                               ref.evaluate(x, y, batch_size=32, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(got.predict(x, batch_size=32, verbose=0),
                               ref.predict(x, batch_size=32, verbose=0), rtol=1e-5, atol=1e-6)


class NotCompilable(keras.layers.Layer):
    """An identity XLA cannot compile (a host callback): proof that a step was compiled."""

    def call(self, x):
        y = tf.numpy_function(lambda a: a, [x], tf.float32)
        return tf.ensure_shape(y, x.shape)


def _not_compilable_model():
    return keras.Sequential([keras.Input((8,)), NotCompilable(), keras.layers.Dense(3)])


def test_the_split_step_really_runs_compiled_and_jit_compile_false_turns_it_off():
    x, y = classification_data(n=32)
    def sgd():
        return keras.optimizers.SGD(0.1)
    strategy = tfdp.DataParallelStrategy(cpu_devices(2))
    with pytest.raises(Exception, match="(?i)xla|compil|EagerPyFunc|PyFunc"):
        train(strategy, _not_compilable_model, sgd, x, y, 16, epochs=1,
              compile_kwargs={"jit_compile": True})
    # Guard: the same model trains with jit_compile=False, and nothing is compiled.
    model, history = train(strategy, _not_compilable_model, sgd, x, y, 16, epochs=1,
                           compile_kwargs={"jit_compile": False})
    assert np.isfinite(history["loss"][0])
    assert xla.compiled_train_step(model) is None


def test_compiled_function_takes_values_and_captures_no_variable():
    # What keeps XLA off other replicas' variables on GPUs: the compiled function's inputs
    # are tensors; it reads no variable (checked on its concrete function).
    x, y = classification_data(n=32)
    model, _ = train(tfdp.DataParallelStrategy(cpu_devices(2)), mlp,
                     lambda: keras.optimizers.SGD(0.1), x, y, 16, epochs=1,
                     compile_kwargs={"jit_compile": True})
    compiled = xla.compiled_train_step(model)
    values = [tf.convert_to_tensor(v.value) for v in compiled.variables]
    state = [tf.convert_to_tensor(v.value) for v in compiled.state_variables]
    args = ((tf.constant(x[:16]), tf.constant(y[:16])), tf.constant(1.0))
    concrete = compiled.function.get_concrete_function(values, state, args, {})
    assert concrete.captured_inputs == []
    assert not [op for op in concrete.graph.get_operations()
                if op.type in ("ReadVariableOp", "VarHandleOp", "AssignVariableOp")]
    hlo = compiled.function.experimental_get_compiler_ir(values, state, args, {})(stage="hlo")
    assert "ENTRY" in hlo  # XLA compiled it


@pytest.mark.slow
def test_state_updates_under_xla_equal_without():
    # BatchNormalization statistics and metrics are state the compiled part returns and the
    # replica assigns: 4 replicas with XLA end with the same moving statistics as without.
    def bn_model():
        # No bias before BatchNormalization: its true gradient is zero, and Adam would turn
        # the rounding noise in it into full-size steps.
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, use_bias=False),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(3)])

    x, y = classification_data(n=128)
    weights = initial_weights(bn_model)
    def adam():
        return keras.optimizers.Adam(0.01)
    results = []
    for jit in (True, False):
        model, history = train(tfdp.DataParallelStrategy(cpu_devices(4)), bn_model, adam, x, y,
                               64, weights=weights, compile_kwargs={"jit_compile": jit})
        results.append((model.get_weights(), history))
    assert_weights_close(results[0][0], results[1][0])  # moving mean/variance included
    np.testing.assert_allclose(results[0][1]["loss"], results[1][1]["loss"], rtol=1e-5)
    # Guard: the moving statistics moved (so the comparison above covers state updates).
    assert not np.allclose(results[0][0][3], weights[3])  # moving mean
    assert not np.allclose(results[0][0][4], weights[4])  # moving variance


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def test_an_overridden_train_step_runs_without_xla_and_says_so_once(caplog):
    x, y = classification_data(n=64)
    weights = initial_weights(mlp)
    def sgd():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    def own_model():
        return OwnStep(mlp().layers)

    ref, _ = train(None, own_model, sgd, x, y, 32, weights=weights)
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        got, _ = train(tfdp.DataParallelStrategy(cpu_devices(2)), own_model, sgd, x, y, 32,
                       weights=weights, compile_kwargs={"jit_compile": True})
        got.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
        ref.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert_weights_close(got.get_weights(), ref.get_weights())
    said = [r for r in caplog.records if "overrides train_step" in r.getMessage()]
    assert len(said) == 1 and "tfdp.compile_gradients" in said[0].getMessage()


# --- custom loops: tfdp.compile_gradients -----------------------------------------------------

def _custom_loop(strategy, jit_compile, steps=4):
    x, y = classification_data(n=64 * steps)
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = mlp()
        model.set_weights(initial_weights(mlp))
        optimizer = keras.optimizers.Adam(0.01, global_clipnorm=0.5)
        optimizer.build(model.trainable_variables)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(features, labels):
        return loss_object(labels, model(features, training=True))

    grad_fn = tfdp.compile_gradients(loss_fn, model.trainable_variables,
                                     model.non_trainable_variables, jit_compile=jit_compile)

    def replica_step(features, labels):
        loss, grads = grad_fn(features, labels)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = tf.function(lambda xs, ys: strategy.run(replica_step, args=(xs, ys))) if strategy \
        else tf.function(replica_step)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    if strategy:
        dataset = strategy.experimental_distribute_dataset(dataset)
    for features, labels in dataset:
        step(features, labels)
    return model.get_weights(), grad_fn


@pytest.mark.slow
def test_compile_gradients_in_a_custom_loop_equals_one_device():
    # Keras's losses divide by the replica count under a strategy, so the reduced sum of
    # the replicas' gradients is the one-device gradient.
    reference, _ = _custom_loop(None, jit_compile=False)
    got, grad_fn = _custom_loop(tfdp.DataParallelStrategy(cpu_devices(4)), jit_compile=True)
    assert_weights_close(got, reference)
    assert grad_fn.function.experimental_get_tracing_count() == 4


def test_compile_gradients_warns_once_about_a_variable_it_was_not_given(caplog):
    given, hidden = keras.Variable(2.0), keras.Variable(3.0)
    grad_fn = tfdp.compile_gradients(lambda: given * hidden, [given])
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        for _ in range(2):
            value, (grad,) = grad_fn()
    assert float(value) == 6.0 and float(grad) == 3.0
    said = [r.getMessage() for r in caplog.records if "not among its variables" in r.getMessage()]
    assert len(said) == 1 and "reads 1 variable(s)" in said[0]
    # Guard: given as state, nothing is captured and nothing is said.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        tfdp.compile_gradients(lambda: given * hidden, [given], [hidden])()
    assert not [r for r in caplog.records if "not among its variables" in r.getMessage()]


def test_compile_gradients_takes_keras_variables_only():
    with pytest.raises(TypeError, match="must be Keras variables"):
        tfdp.compile_gradients(lambda: 0.0, [tf.Variable(1.0)])


# --- several workers -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiworker
def test_two_workers_of_two_replicas_with_xla_train_like_one_device(tmp_path):
    code, out = run_job(tfdp_run_command(worker_script("mw_xla_worker.py"), cpu_replicas=2),
                        worker_env(TFDP_TEST_OUT=tmp_path, TF_CPP_MIN_LOG_LEVEL=2), 400)
    assert code == 0, out
    # The coordination-service exchange the shared-GPU check uses: both workers got both.
    for rank in range(2):
        table = json.loads((tmp_path / f"placements-{rank}.json").read_text())
        assert table == [[0, 0, "host", "gpu-of-0"], [1, 0, "host", "gpu-of-1"]]
    for opt_name in sorted(xla_cases.OPTIMIZERS):
        for rank in range(2):
            saved = np.load(tmp_path / f"{opt_name}-{rank}.npz")
            assert bool(saved["split"]), opt_name  # tfdp's compiled split step ran
            got = [saved[f"arr_{i}"] for i in range(len(saved.files) - 2)]
            for jit_reference in (False, True):
                ref_weights, ref_history = _one_device(opt_name, jit_reference)
                assert_weights_close(got, ref_weights)
                np.testing.assert_allclose(saved["loss"], ref_history["loss"], rtol=1e-5)


def test_fit_and_evaluate_steps_run_under_one_pass_graph_optimization(monkeypatch):
    # The step functions tfdp builds are called inside _tf_private.one_pass_graph_optimization
    # (Grappler's one pass, docs/zero.md "Trace time"); a tfdp that stops wrapping the call
    # leaves `calls` empty. The options it sets are pinned in test_tf_private.
    from tfdp import _tf_private

    calls = []
    real = _tf_private.one_pass_graph_optimization

    class recorded(real):
        def __enter__(self):
            calls.append(True)
            return super().__enter__()

    monkeypatch.setattr(_tf_private, "one_pass_graph_optimization", recorded)
    x, y = classification_data(n=64)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert len(calls) == 2  # one per training step
    model.evaluate(x, y, batch_size=32, verbose=0)
    assert len(calls) == 4  # and one per evaluation step
