"""A worker that counts the collectives of each training step (real processes, tfdp-run).

Trains the small MLP on 2 workers through tfdp.data in one process: with Adam and with
ShardedOptimizer(Adam), each plain and with tfdp.callbacks.BackupAndRestore(check_every=1), and
with Adam in a model whose train_step is Keras's called through an override (so tfdp leaves its
logs to Keras's own per-step all-reduce), counting the collectives each step runs
(tfdp.strategy.timing times every collective while a StepTimer listens; its count is read
after every step).
ShardedOptimizer reduces its gradients its own way, so there the stop flag needs its own
all-reduce: the guard that the count sees one. Prints one line "COUNTS <json>" on the chief:
per-step counts of every fit, whether the stop flag rode in the gradient reduction, and the
per-step losses Keras logged with and without the logs riding in the gradient all-reduce.

Env knob: TFDP_TEST_OUT (where the backups go).
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import tensorflow as tf

import tfdp
from tfdp.resilience import stragglers
from tfdp.strategy import timing

from helpers import classification_data, initial_weights, mlp

strategy = tfdp.DataParallelStrategy()
timer = stragglers.StepTimer()
timing.install_collective_timing()
timer.listen()  # every step traced from now on counts its collectives
x, y = classification_data(n=240)


class Count(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.counts, self.last, self.losses = [], timing.collectives_executed(), []

    def on_train_batch_end(self, batch, logs=None):
        now = timing.collectives_executed()
        self.counts.append(now - self.last)
        self.last = now
        self.losses.append(float(logs["loss"]))


class OwnStep(keras.Sequential):
    """Keras's train step, reached through an override: tfdp keeps an overridden step's
    order, so its logs take Keras's own all-reduce."""

    def train_step(self, data):
        return super().train_step(data)


def fit(with_backup, sharded, own_step=False):
    with strategy.scope():
        model = mlp()
        if own_step:
            model = OwnStep(model.layers)
        model.set_weights(initial_weights(mlp))
        adam = keras.optimizers.Adam(0.01)
        model.compile(optimizer=tfdp.ShardedOptimizer(adam) if sharded else adam,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), 24)
    count = Count()
    callbacks = [count]
    backup = None
    if with_backup:
        backup = tfdp.callbacks.BackupAndRestore(
            os.path.join(os.environ["TFDP_TEST_OUT"], "backup"),
            save_freq="epoch", dataset=train, check_every=1)
        callbacks.insert(0, backup)
    history = model.fit(train, epochs=2, verbose=0, callbacks=callbacks).history
    fit.losses[(sharded, own_step)] = (count.losses, history["loss"])
    return count.counts, backup


fit.losses = {}


result = {}
for sharded in (False, True):
    name = "sharded" if sharded else "adam"
    result[name], _ = fit(False, sharded)
    result[name + "_backup"], backup = fit(True, sharded)
    result[name + "_rides"] = backup._stop.rides_with_gradients
result["adam_own_step"], _ = fit(False, False, own_step=True)
result["losses_riding"] = fit.losses[(False, False)]
result["losses_keras"] = fit.losses[(False, True)]
if strategy.cluster.is_chief:
    print("COUNTS " + json.dumps(result), flush=True)
