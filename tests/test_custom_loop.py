"""The custom training loop of examples/custom_loop.py: N replicas == one device on the same
global batch (with global-norm clipping), resumed == uninterrupted, and the example itself
(one process and two workers)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from helpers import assert_weights_close, classification_data, cpu_devices, initial_weights, mlp
from launching import ROOT, tfdp_run_command
import custom_loop  # examples/ (pytest's pythonpath): its training functions; flags stay undefined

GLOBAL_BATCH = 32
EPOCHS = 2
X, Y = classification_data(n=256)
STEPS = len(X) // GLOBAL_BATCH


def _run(strategy, clipnorm=0.5, epochs=EPOCHS, checkpoint_dir=None, shuffle=False,
         weights=None):
    """The example's loop under ``strategy`` (None: one device, no strategy)."""
    one_device = strategy is None
    strategy = strategy or tf.distribute.get_strategy()
    # Every run starts like a fresh process: tfdp.data's shuffle order also depends on
    # TensorFlow's global seed when the pipeline is built (measured; reported).
    keras.utils.set_random_seed(7)
    source = tf.data.Dataset.from_tensor_slices((X, Y))
    if one_device:
        assert not shuffle
        data = source.batch(GLOBAL_BATCH)
    else:
        data = tfdp.data.distribute(strategy, source, GLOBAL_BATCH,
                                    shuffle_buffer=len(X) if shuffle else None, seed=3)
    with strategy.scope():
        model = mlp()
        model.set_weights(weights if weights is not None else initial_weights(mlp))
        optimizer = keras.optimizers.Adam(0.05, global_clipnorm=clipnorm)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    lines = []
    history = custom_loop.train(strategy, model, optimizer, loss_fn, data, STEPS, epochs,
                                GLOBAL_BATCH, checkpoint_dir=checkpoint_dir, report=lines.append)
    return model, history, lines


def test_custom_loop_on_four_replicas_equals_one_device_with_global_norm_clipping():
    model, history, _ = _run(tfdp.DataParallelStrategy(cpu_devices(4)))
    ref_model, ref_history, _ = _run(None)
    assert_weights_close(model.get_weights(), ref_model.get_weights())
    np.testing.assert_allclose(history, ref_history, rtol=1e-5, atol=1e-6)
    # Guard: the clipping is active here (a run without it ends elsewhere), so the match
    # above includes clipping the reduced gradient like one device does.
    unclipped, _, _ = _run(None, clipnorm=None)
    diff = max(np.max(np.abs(a - b)) for a, b in
               zip(unclipped.get_weights(), ref_model.get_weights()))
    assert diff > 1e-2


@pytest.mark.slow
def test_custom_loop_resumed_from_a_checkpoint_equals_uninterrupted(tmp_path):
    full, full_history, _ = _run(tfdp.DataParallelStrategy(cpu_devices(4)), epochs=3,
                                 shuffle=True, checkpoint_dir=str(tmp_path / "a"))
    _run(tfdp.DataParallelStrategy(cpu_devices(4)), epochs=1, shuffle=True,
         checkpoint_dir=str(tmp_path / "b"))
    # A new process would start from fresh weights: start from other ones to show the
    # checkpoint, not the initial weights, decides.
    keras.utils.set_random_seed(99)
    other = mlp().get_weights()
    resumed, resumed_history, lines = _run(tfdp.DataParallelStrategy(cpu_devices(4)), epochs=3,
                                           shuffle=True, checkpoint_dir=str(tmp_path / "b"),
                                           weights=other)
    assert lines[0].startswith(f"resumed from {tmp_path / 'b' / 'ckpt-1'} at epoch 2")
    assert len(resumed_history) == 2  # epochs 2 and 3 only
    assert_weights_close(resumed.get_weights(), full.get_weights(), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(resumed_history, full_history[1:], rtol=1e-6)
    assert sorted(os.listdir(tmp_path / "b")) == [
        "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
        "ckpt-3.data-00000-of-00001", "ckpt-3.index"]  # max_to_keep=2


# --- the example itself -----------------------------------------------------------------

def _example(args, tfdp_run_workers=0, timeout=300):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the example sets what it needs itself
    script = os.path.join(ROOT, "examples", "custom_loop.py")
    cmd = [sys.executable, script, *args]
    if tfdp_run_workers:
        cmd = tfdp_run_command(script, *args, workers=tfdp_run_workers, cpu_replicas=2,
                               flags=("--output", "all"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def _noise(text):
    return [line for line in text.splitlines()
            if "warn" in line.lower() or "error" in line.lower()]


@pytest.mark.slow
def test_custom_loop_example_trains_resumes_and_prints_only_progress(tmp_path):
    model_dir = str(tmp_path / "ckpt")
    code, out, err = _example(["--epochs", "4", "--replicas", "2", "--model_dir", model_dir,
                               "--min_accuracy", "0.8"])
    assert code == 0, out + err
    assert "epoch 4/4: loss" in out and "test accuracy:" in out, out
    assert _noise(out + err) == [] and err == "", out + err
    code, out, err = _example(["--epochs", "5", "--replicas", "2", "--model_dir", model_dir])
    assert code == 0, out + err
    assert f"resumed from {model_dir}/ckpt-4 at epoch 5" in out and "epoch 5/5" in out, out


@pytest.mark.slow
@pytest.mark.multiworker
def test_custom_loop_example_on_two_workers(tmp_path):
    model_dir = str(tmp_path / "ckpt")
    code, out, err = _example(["--epochs", "2", "--model_dir", model_dir], tfdp_run_workers=2)
    assert code == 0, out + err
    assert "[w0] tfdp: 2 worker(s), 4 replica(s)" in out and "[w0] test accuracy:" in out, out
    assert "[w1] epoch" not in out  # the chief reports for the job
    assert "ckpt-2.index" in os.listdir(model_dir)  # the chief's checkpoints, in place
    assert _noise(out + err) == [], out + err


# --- the tf.distribute tutorial's loop, with Keras 3's optimizer.apply ----------------------

def _tutorial_loop(strategy, x, y):
    """TensorFlow's custom-loop tutorial as written for Keras 3: a batched dataset through
    ``experimental_distribute_dataset``, ``strategy.run(step)`` inside a ``tf.function``, and
    the optimizer left unbuilt until ``optimizer.apply`` in the traced step."""
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if strategy is not None:
        data = strategy.experimental_distribute_dataset(data)
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = mlp()
        model.set_weights(initial_weights(mlp))
        optimizer = keras.optimizers.Adam(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)
        return loss

    @tf.function
    def train_step(xb, yb):
        if strategy is None:
            return step(xb, yb)
        return strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None)

    losses = [float(train_step(xb, yb)) for xb, yb in data]
    return model, losses


@pytest.mark.parametrize("shard_parameters", [False, True], ids=["replicated", "zero3"])
def test_the_tutorial_loop_with_a_lazily_built_optimizer_equals_one_device(shard_parameters):
    # Under MirroredStrategy this loop fails at its first step ("You must feed a value for
    # placeholder tensor"): the optimizer's variables are created inside the traced step.
    # tfdp builds the optimizer outside it (tfdp._tf_private.patch_keras_optimizer_apply).
    strategy = tfdp.DataParallelStrategy(cpu_devices(4), shard_parameters=shard_parameters,
                                         shard_min_elements=64)
    model, losses = _tutorial_loop(strategy, X, Y)
    ref_model, ref_losses = _tutorial_loop(None, X, Y)
    assert_weights_close(model.get_weights(), ref_model.get_weights())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert len(losses) == STEPS


def test_guard_under_mirrored_strategy_the_tutorial_loop_fails_in_its_first_step():
    strategy = tf.distribute.MirroredStrategy(cpu_devices(4))
    with pytest.raises(tf.errors.InvalidArgumentError, match="must feed a value for placeholder"):
        _tutorial_loop(strategy, X, Y)
