"""A worker for the multi-worker tests, started by tfdp-run (real processes).

Trains a small MLP on a deterministic dataset with tfdp.DataParallelStrategy and writes
this worker's final weights (and every replica's copy) to OUT/weights-<rank>.npz; with several
optimizers in TFDP_TEST_OPT (comma separated), one model per optimizer in turn, each to
OUT/weights-<optimizer>-<rank>.npz.

Env knobs: TFDP_TEST_OUT, TFDP_TEST_EPOCHS, TFDP_TEST_GLOBAL_BATCH, TFDP_TEST_OPT,
TFDP_TEST_BACKUP (dir: use tfdp BackupAndRestore), TFDP_TEST_SHUFFLE (shuffle + DatasetEpoch), TFDP_TEST_FAIL="rank:epoch:batch:how"
(how = exit | kill | stop | block | hang-before-strategy; block: alive, heartbeating,
but stuck in a callback), TFDP_TEST_TIMEOUT (strategy timeout), TFDP_TEST_LATE="rank:epoch:batch"
(that rank, after that batch, waits until tfdp-run announces a peer's exit in its control
directory, then goes on: its next step's collectives start after the peer died).
"""

import os
import signal
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
rank = int(os.environ.get("TFDP_RANK", "0"))
fail = os.environ.get("TFDP_TEST_FAIL", "")
fail_rank, fail_epoch, fail_batch, fail_how = (fail.split(":") + ["", "", "", ""])[:4] if fail else ("-1", "", "", "")
if int(fail_rank) == rank and fail_how == "hang-before-strategy":
    while True:  # a worker that never joins: the others block in the strategy constructor
        time.sleep(1)

import numpy as np  # noqa: E402  (after the hang-before-strategy branch)
import tensorflow as tf  # noqa: E402  (after the hang-before-strategy branch)
import keras  # noqa: E402  (after the hang-before-strategy branch)

import tfdp  # noqa: E402  (after the hang-before-strategy branch)
from helpers import classification_data, initial_weights, mlp  # noqa: E402  (after the hang-before-strategy branch)

out = os.environ["TFDP_TEST_OUT"]
epochs = int(os.environ.get("TFDP_TEST_EPOCHS", "2"))
global_batch = int(os.environ.get("TFDP_TEST_GLOBAL_BATCH", "32"))
opt_name = os.environ.get("TFDP_TEST_OPT", "sgd")
timeout = os.environ.get("TFDP_TEST_TIMEOUT")

strategy = tfdp.DataParallelStrategy(timeout_seconds=float(timeout) if timeout else None)
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas, chief={strategy.cluster.is_chief}",
      flush=True)
x, y = classification_data(n=256)
w0 = initial_weights(mlp)


def optimizer(opt_name):
    if opt_name == "adam":
        return keras.optimizers.Adam(0.01, global_clipnorm=0.5)
    if opt_name == "sharded_adam":
        return tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=0.5))
    return keras.optimizers.SGD(0.05, momentum=0.9)


class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(fail_rank) == rank and self.epoch == int(fail_epoch) and batch == int(fail_batch):
            print(f"rank {rank}: failing ({fail_how}) at epoch {self.epoch} batch {batch}", flush=True)
            if fail_how == "exit":
                os._exit(3)
            if fail_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fail_how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if fail_how == "block":
                threading.Event().wait()  # until tfdp-run stops the job

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


class LateAfterPeerExit(keras.callbacks.Callback):
    """Waits, at one batch's end, for tfdp-run's announcement that a peer exited (a file, not
    a sleep: the next step then starts after the peer is gone)."""

    def __init__(self, spec):
        super().__init__()
        self.rank, self.at_epoch, self.at_batch = (int(v) for v in spec.split(":"))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.rank, self.at_epoch, self.at_batch) != (rank, self.epoch, batch):
            return
        from tfdp.protocol import CONTROL_DIR_ENV, PEER_EXITED_FILE

        path = os.path.join(os.environ[CONTROL_DIR_ENV], PEER_EXITED_FILE)
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a file that tfdp-run writes
        print(f"rank {rank}: going on after the peer's exit ({os.path.exists(path)})", flush=True)


def run(opt_name, weights_file):
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        model.compile(optimizer=optimizer(opt_name),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    shuffle = bool(os.environ.get("TFDP_TEST_SHUFFLE"))
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), global_batch,
                                 shuffle_buffer=256 if shuffle else None, seed=5)

    callbacks = [Fail()] + ([tfdp.callbacks.DatasetEpoch(train)] if shuffle else [])
    if os.environ.get("TFDP_TEST_LATE"):
        callbacks.append(LateAfterPeerExit(os.environ["TFDP_TEST_LATE"]))
    if os.environ.get("TFDP_TEST_BACKUP"):
        callbacks.insert(0, tfdp.callbacks.BackupAndRestore(os.environ["TFDP_TEST_BACKUP"]))
    history = model.fit(train, epochs=epochs, verbose=0, callbacks=callbacks)
    replicas = {f"var{i}_replica{j}": np.asarray(c)
                for i, v in enumerate(model.trainable_variables)
                for j, c in enumerate(strategy.experimental_local_results(v.value))}
    np.savez(os.path.join(out, weights_file),
             *model.get_weights(), loss=np.asarray(history.history["loss"]),
             accuracy=np.asarray(history.history["accuracy"]), **replicas)
    done = "done" if weights_file == f"weights-{rank}.npz" else f"{opt_name} done"
    print(f"rank {rank}: {done}, loss {history.history['loss']}", flush=True)


# TFDP_TEST_OPT may name several optimizers (comma separated): each trains in turn, on a
# model of its own, and writes OUT/weights-<optimizer>-<rank>.npz; one job, one start-up.
opt_names = opt_name.split(",")
for name in opt_names:
    run(name, f"weights-{rank}.npz" if len(opt_names) == 1 else f"weights-{name}-{rank}.npz")
