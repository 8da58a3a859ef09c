"""The heart of the suite: N replicas with per-replica batch b train exactly like one
device with batch N*b (weights, losses and metrics), for 1, 2 and 4 CPU replicas."""

import functools

import numpy as np
import pytest
import keras

import tfdp
from helpers import (assert_weights_close, classification_data, convnet, cpu_devices,
                     image_data, initial_weights, mlp, replica_components, train)

PER_REPLICA_BATCH = 16
OPTIMIZERS = {
    "sgd_momentum": lambda clip: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=clip),
    "adam": lambda clip: keras.optimizers.Adam(0.01, global_clipnorm=clip),
}
MODELS = {"mlp": (mlp, classification_data), "convnet": (convnet, image_data)}


@functools.lru_cache(maxsize=None)
def _reference(model_name, opt_name, clip, global_batch):
    model_fn, data_fn = MODELS[model_name]
    x, y = data_fn()
    weights = initial_weights(model_fn)
    model, history = train(None, model_fn, lambda: OPTIMIZERS[opt_name](clip), x, y,
                           global_batch, weights=weights)
    return model.get_weights(), history


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_replicas_train_like_one_device(replicas, opt_name, clip, model_name):
    model_fn, data_fn = MODELS[model_name]
    x, y = data_fn()
    global_batch = PER_REPLICA_BATCH * replicas
    ref_weights, ref_history = _reference(model_name, opt_name, clip, global_batch)

    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(replicas))
    assert strategy.num_replicas_in_sync == replicas
    model, history = train(strategy, model_fn, lambda: OPTIMIZERS[opt_name](clip), x, y,
                           global_batch, weights=initial_weights(model_fn))

    assert_weights_close(model.get_weights(), ref_weights)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    # Every replica holds the same weights (checked, not assumed).
    for var in model.trainable_variables:
        components = replica_components(strategy, var)
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0])


@pytest.mark.slow
def test_clipping_acts_on_the_reduced_gradient():
    """Local clipping (stock Keras) would differ from the reference; tfdp must not."""
    x, y = classification_data()
    weights = initial_weights(mlp)
    def opt():  # tight per-tensor clip
        return keras.optimizers.SGD(0.5, clipnorm=0.05)
    ref, _ = train(None, mlp, opt, x, y, 64, weights=weights, epochs=1)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    got, _ = train(strategy, mlp, opt, x, y, 64, weights=weights, epochs=1)
    assert_weights_close(got.get_weights(), ref.get_weights())
    # Guard that the test can fail: clipping the 4 local gradients first gives other weights.
    local = tfdp.DataParallelStrategy(devices=cpu_devices(4))
    local._is_tfdp_strategy = False  # behave like stock Keras: clip, then reduce
    stock, _ = train(local, mlp, opt, x, y, 64, weights=weights, epochs=1)
    diff = max(np.abs(a - b).max() for a, b in zip(stock.get_weights(), ref.get_weights()))
    assert diff > 1e-4
