"""ShardedOptimizer (ZeRO-1): equivalence with the unsharded optimizer, memory, the
partition rule, and topology-free checkpoints."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp.optimizers.sharded import partition
from tfdp.optimizers.sharded_state import optimizer_state_bytes_per_replica
from helpers import SHARDING_OPTIMIZERS as OPTIMIZERS
from helpers import (assert_weights_close, classification_data, cpu_devices, deep_mlp,
                     embedding_model, initial_weights, many_variable_model, mixed_precision_mlp,
                     mlp, token_data, train)


@functools.cache
def one_device(opt_name):
    """One device's weights and loss history after 2 epochs of ``deep_mlp`` with ``opt_name``
    unsharded, from ``initial_weights``: the reference several tests compare with, trained
    once per module (each run is deterministic, so sharing it changes no assertion)."""
    x, y = classification_data()
    model, history = train(None, deep_mlp, OPTIMIZERS[opt_name], x, y, 64,
                           weights=initial_weights(deep_mlp))
    return model.get_weights(), history["loss"]


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_sharded_equals_unsharded(replicas, opt_name):
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    make = OPTIMIZERS[opt_name]
    ref_weights, ref_loss = one_device(opt_name)
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    got, hist = train(s, deep_mlp, lambda: tfdp.ShardedOptimizer(make()), x, y, 64, weights=w0)
    assert_weights_close(got.get_weights(), ref_weights)
    np.testing.assert_allclose(hist["loss"], ref_loss, rtol=1e-5)
    # Every replica holds identical weights after the all-gather.
    for var in got.trainable_variables:
        parts = [np.asarray(p) for p in s.experimental_local_results(var.value)]
        for p in parts[1:]:
            np.testing.assert_array_equal(p, parts[0])
    # State really is partitioned: each slot exists on its owner's device only.
    opt = got.optimizer
    owners = {opt.owner_of(v) for v in got.trainable_variables}
    assert owners == set(range(replicas))
    for slot, index in opt._book.slots:
        owner = opt._owners[index]
        assert tf.DeviceSpec.from_string(slot.value.device).device_index == owner


def test_partition_rule():
    assert partition([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    assert partition([100, 1, 1, 1], 2) == [0, 1, 1, 1]  # a dominant variable is its own shard
    assert partition([5], 4) == [0]
    rng = np.random.default_rng(0)
    sizes = list(rng.integers(1, 5000, size=200))
    for n in (2, 4, 8):
        owners = partition(sizes, n)
        loads = np.bincount(owners, weights=sizes, minlength=n)
        assert loads.max() <= 1.10 * sum(sizes) / n
    with pytest.raises(ValueError):
        partition([1], 0)


@pytest.mark.parametrize("replicas", [2, 4])
def test_state_per_replica_is_about_one_nth(replicas):
    s = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    with s.scope():
        model = many_variable_model()
        unsharded = keras.optimizers.Adam()
        unsharded.build(model.trainable_variables)
        sharded = tfdp.ShardedOptimizer(keras.optimizers.Adam())
        sharded.build(model.trainable_variables)
    full = optimizer_state_bytes_per_replica(unsharded, s)
    assert len(set(full)) == 1  # unsharded: everything on every replica
    per_replica = sharded.state_bytes_per_replica()
    assert len(per_replica) == replicas
    assert sum(per_replica) < full[0] * 1.05  # the whole state exists about once
    for b in per_replica:
        assert b <= 1.10 * full[0] / replicas


def _fit_steps(strategy, x, y, weights, opt_state_from=None, epochs=1, sharded=True):
    make = OPTIMIZERS["adam_global_clipnorm"]
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = deep_mlp()
        model.set_weights(weights)
        opt = tfdp.ShardedOptimizer(make()) if sharded else make()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if opt_state_from:
            opt.build(model.trainable_variables)
            model.load_weights(opt_state_from)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=epochs, verbose=0)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(4, 2), (2, 1), (1, 4)])
def test_checkpoint_restores_on_another_replica_count(tmp_path, before, after):
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    def strategy(n):
        return tfdp.DataParallelStrategy(devices=cpu_devices(n))
    reference, _ = one_device("adam_global_clipnorm")  # = _fit_steps(None, ..., epochs=2)

    first = _fit_steps(strategy(before), x, y, w0)
    first.save_weights(tmp_path / "ckpt.weights.h5")
    resumed = _fit_steps(strategy(after), x, y, first.get_weights(),
                         opt_state_from=tmp_path / "ckpt.weights.h5")
    assert_weights_close(resumed.get_weights(), reference)
    # The iteration counters came back too (bias correction depends on them).
    assert int(resumed.optimizer.inner_optimizer.iterations.numpy()) == 8


def test_model_save_and_load_model(tmp_path):
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    model = _fit_steps(tfdp.DataParallelStrategy(devices=cpu_devices(4)), x, y, w0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, tfdp.ShardedOptimizer)
    assert isinstance(loaded.optimizer.inner_optimizer, keras.optimizers.Adam)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    loaded.fit(ds, epochs=1, verbose=0)
    reference, _ = one_device("adam_global_clipnorm")  # = _fit_steps(None, ..., epochs=2)
    assert_weights_close(loaded.get_weights(), reference)


def test_config_round_trip():
    opt = tfdp.ShardedOptimizer(tfdp.optimizers.LAMB(0.01, weight_decay=0.1))
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, tfdp.ShardedOptimizer)
    assert restored.inner_optimizer.get_config() == opt.inner_optimizer.get_config()


def test_learning_rate_schedule_and_sparse_gradients():
    model_fn = embedding_model
    x, y = token_data()
    w0 = initial_weights(model_fn)
    def schedule():
        return tfdp.schedules.WarmupCosineDecay(0.05, warmup_steps=3, total_steps=8)
    ref, _ = train(None, model_fn, lambda: keras.optimizers.Adam(schedule()), x, y, 64, weights=w0)
    got, _ = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), model_fn,
                   lambda: tfdp.ShardedOptimizer(keras.optimizers.Adam(schedule())), x, y, 64, weights=w0)
    assert_weights_close(got.get_weights(), ref.get_weights())


@pytest.mark.slow
def test_loss_scale_optimizer_mixed_precision():
    x, y = classification_data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        make = mixed_precision_mlp
        w0 = initial_weights(make)
        ref, _ = train(None, make, lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                       x, y, 64, weights=w0)
        got, hist = train(tfdp.DataParallelStrategy(devices=cpu_devices(2)), make,
                          lambda: keras.optimizers.LossScaleOptimizer(
                              tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01))), x, y, 64, weights=w0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(hist["loss"]).all()
    assert_weights_close(got.get_weights(), ref.get_weights(), atol=2e-3, rtol=2e-3)


def test_bad_usage_is_a_clear_error():
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        tfdp.ShardedOptimizer("adam")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        tfdp.ShardedOptimizer(keras.optimizers.SGD(loss_scale_factor=128.0))
    with pytest.raises(ValueError, match="accumulation='nowhere' is not one of"):
        tfdp.ShardedOptimizer(keras.optimizers.SGD(), accumulation="nowhere")
    with pytest.raises(ValueError, match="on the wrapped optimizer"):
        tfdp.ShardedOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="LossScaleOptimizer\\(ShardedOptimizer"):
        tfdp.ShardedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with mirrored.scope():
        model = mlp()
        opt = tfdp.ShardedOptimizer(keras.optimizers.SGD())
        with pytest.raises(ValueError, match="needs tfdp.DataParallelStrategy"):
            opt.build(model.trainable_variables)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(4, 2), (1, 4)])
def test_tf_train_checkpoint_restores_on_another_replica_count(tmp_path, before, after):
    x, y = classification_data()
    w0 = initial_weights(deep_mlp)
    reference, _ = one_device("adam_global_clipnorm")  # = _fit_steps(None, ..., epochs=2)
    first = _fit_steps(tfdp.DataParallelStrategy(devices=cpu_devices(before)), x, y, w0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "ckpt"))

    s = tfdp.DataParallelStrategy(devices=cpu_devices(after))
    with s.scope():
        model = deep_mlp()
        opt = tfdp.ShardedOptimizer(OPTIMIZERS["adam_global_clipnorm"]())
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        opt.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_existing_objects_matched()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=1, verbose=0)
    assert_weights_close(model.get_weights(), reference)
