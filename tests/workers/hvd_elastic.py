"""An elastic Keras script of Horovod's shape (tensorflow2_keras_mnist_elastic.py: only the
import line changed), with a recorder: rank 0 appends what it trained, the resets and the end
to $TFDP_TEST_OUT/events.jsonl. With KILL_AT='[E, B]', rank 1 SIGKILLs itself in attempt 0
when state.epoch == E and state.batch == B (mid-epoch); with FAIL_AT_START='1', rank 1 exits
at the start of attempt 1 (the slot is dropped and the job goes on with one process)."""

import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import tfdp.horovod.keras as hvd  # was: import horovod.tensorflow.keras as hvd

hvd.init()
keras.utils.set_random_seed(0)  # the same first weights in every job (the test compares two)

OUT = os.environ["TFDP_TEST_OUT"]
ATTEMPT = int(os.environ.get("TFDP_ATTEMPT", "0"))
KILL_AT = json.loads(os.environ.get("KILL_AT", "null"))
EPOCHS, STEPS, BASE_LR = 3, 6, 0.01
if hvd.rank() == 1 and str(ATTEMPT) in os.environ.get("FAIL_AT_START", "").split(","):
    raise SystemExit(3)  # this slot cannot come back: tfdp-run drops it (--min-np)


def record(**event):
    event.update(attempt=ATTEMPT, rank=hvd.rank(), size=hvd.size())
    with open(os.path.join(OUT, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(64, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True).astype("float32")
# One batch repeated: what a step computes does not depend on where the data stands, so an
# interrupted job can be compared with an uninterrupted one.
dataset = tf.data.Dataset.from_tensors((x[:8], y[:8])).repeat()

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
opt = keras.optimizers.SGD(learning_rate=BASE_LR * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(opt)
model.compile(optimizer=opt, loss="mse")

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    state.model.optimizer.learning_rate.assign(BASE_LR * hvd.size())
    record(event="reset", epoch=state.epoch, batch=state.batch,
           iterations=int(state.model.optimizer.iterations.numpy()),
           lr=float(state.model.optimizer.learning_rate.numpy()))


state.register_reset_callbacks([on_state_reset])


class Recorder(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 0:
            record(event="batch", epoch=state.epoch, batch=state.batch,
                   iterations=int(self.model.optimizer.iterations.numpy()))
        if KILL_AT and ATTEMPT == 0 and hvd.rank() == 1 and [state.epoch, state.batch] == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
    Recorder(),
]


@hvd.elastic.run
def train(state):
    state.model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
                    callbacks=callbacks, verbose=0)


train(state)
weights = float(sum(np.abs(w).sum() for w in model.get_weights()))
if hvd.rank() == 0:
    np.savez(os.path.join(OUT, "weights.npz"), *model.get_weights())
record(event="end", epoch=state.epoch, batch=state.batch,
       iterations=int(model.optimizer.iterations.numpy()), weights=weights)
