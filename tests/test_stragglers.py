"""StragglerMonitor in one process with several local replicas (issue 20): the collective
timing it traces into the step must not change the math, nor deadlock the replicas of one
worker (tf.function chains stateful ops across replicas; tfdp/_tf_private.run_independently).
The multi-worker behaviour (who is named, eviction) is in tests/test_elastic.py."""

import keras
import pytest

import tfdp
from helpers import assert_weights_close, classification_data, initial_weights, mlp, train

FIELDS = ("compute", "step", "input", "host", "wait")


@pytest.mark.slow
def test_the_monitor_times_four_replicas_without_changing_the_weights(strategy4):
    x, y = classification_data(n=256)
    w0 = initial_weights(mlp)
    def optimizer():
        return keras.optimizers.Adam(0.01)
    monitor = tfdp.callbacks.StragglerMonitor(window=3)
    timed, logs = train(strategy4, mlp, optimizer, x, y, global_batch=32, epochs=2, weights=w0,
                        fit_kwargs={"callbacks": [monitor]})
    plain, _ = train(strategy4, mlp, optimizer, x, y, global_batch=32, epochs=2, weights=w0)
    assert_weights_close(timed.get_weights(), plain.get_weights(), atol=1e-6, rtol=1e-6)
    # 8 steps per epoch; the first step of each epoch is not measured.
    assert monitor.history and sum(e["steps"] for e in monitor.history) >= 10
    for entry in monitor.history:
        own = entry["step_ms"][0] + entry["input_ms"][0] + entry["host_ms"][0]
        assert abs(entry["compute_ms"][0] - own) < 1e-6 * max(1.0, own), entry
        assert entry["wait_ms"][0] > 0.0, entry  # the gradient reduction was timed
    assert monitor.stragglers == set()  # one worker: nobody to compare with
    for field in FIELDS:
        assert f"tfdp_{field}_ms_rank0" in logs, logs.keys()
    # The hooks are gone after fit: the model trains and saves as a plain one.
    assert "train_step" not in vars(timed)
