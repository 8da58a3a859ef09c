"""A gradient captured from outside ``strategy.run`` (issue 10): tfdp sums what every
replica passes to ``optimizer.apply``; MirroredStrategy regroups one object and applies it
once. Moved from test_rough_edges.py."""

import numpy as np
import tensorflow as tf
import keras

import tfdp
from helpers import cpu_devices


def _apply_captured_gradient(strategy):
    """SGD(lr=1) applies a gradient tensor made outside ``strategy.run`` (captured by the
    replica function); returns every replica's copy of the variable afterwards."""
    with strategy.scope():
        variable = keras.Variable(np.ones(2, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])
    gradient = tf.constant([1.0, 2.0])  # one tensor, the same object in every replica

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply([gradient], [variable]))

    step()
    return [np.asarray(v) for v in strategy.experimental_local_results(variable.value)]


def test_captured_gradient_is_summed_over_replicas():
    # tfdp's rule: every replica contributes what it passes to optimizer.apply, as when each
    # replica computes its own gradient, so a captured g enters N times: w - lr * N * g.
    for value in _apply_captured_gradient(tfdp.DataParallelStrategy(cpu_devices(4))):
        np.testing.assert_allclose(value, 1.0 - 4 * np.array([1.0, 2.0]), rtol=1e-6)


def test_guard_mirrored_strategy_does_not_sum_a_captured_gradient():
    # MirroredStrategy regroups the identical object into one value and applies it once
    # (Keras's optimizer_distribute_test.py::test_ema relies on this). Reduction-to-one-
    # device cross-device ops: no collective keys that could clash with other tests.
    mirrored = tf.distribute.MirroredStrategy(
        cpu_devices(4), cross_device_ops=tf.distribute.ReductionToOneDevice())
    values = _apply_captured_gradient(mirrored)
    for value in values:
        np.testing.assert_allclose(value, 1.0 - np.array([1.0, 2.0]), rtol=1e-6)
    assert not np.allclose(values[0], 1.0 - 4 * np.array([1.0, 2.0]))
