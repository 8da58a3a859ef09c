"""A worker that finds its cluster by itself (Slurm step, TF_CONFIG, CLUSTER_SPEC, SM_HOSTS).

Started by tests/test_slurm.py (under srun/sbatch) and tests/test_cluster.py (plain processes
with a scheduler's environment). Builds ``tfdp.DataParallelStrategy()`` with no argument,
trains the helpers' MLP on in-order tfdp.data input (Adam), and writes:

  OUT/weights-<rank>.npz      the final weights
  OUT/steps-rank<rank>.txt    "<launch> <optimizer iteration>" after every step it ran
  OUT/held-<rank>             (TFDP_TEST_HOLD) its pid, once it holds for SIGTERM (before that step)

Env knobs: TFDP_TEST_OUT (required), TFDP_TEST_EPOCHS (2), TFDP_TEST_GLOBAL_BATCH (32),
TFDP_TEST_BACKUP (dir: BackupAndRestore(save_freq=5)), TFDP_TEST_HOLD ("rank:iteration": in
launch 0 that rank waits after that step until it has received SIGTERM). The launch number is
SLURM_RESTART_COUNT (set by Slurm in a requeued job), else 0.
"""

import os
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras

import tfdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import classification_data, initial_weights, mlp

out = os.environ["TFDP_TEST_OUT"]
epochs = int(os.environ.get("TFDP_TEST_EPOCHS", "2"))
global_batch = int(os.environ.get("TFDP_TEST_GLOBAL_BATCH", "32"))
launch = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
hold = os.environ.get("TFDP_TEST_HOLD")

strategy = tfdp.DataParallelStrategy()
cluster = strategy.cluster
rank = cluster.rank
address = cluster.workers[rank] if cluster.workers else "-"
print(f"rank {rank}: source={cluster.source} workers={cluster.num_workers} "
      f"replicas={strategy.num_replicas_in_sync} address={address} launch={launch}", flush=True)

x, y = classification_data(n=256)
w0 = initial_weights(mlp)
with strategy.scope():
    model = mlp()
    model.set_weights(w0)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), global_batch)
backup = (tfdp.callbacks.BackupAndRestore(os.environ["TFDP_TEST_BACKUP"], save_freq=5,
                                          dataset=train)
          if os.environ.get("TFDP_TEST_BACKUP") else None)


class Record(keras.callbacks.Callback):
    """Records every step run (the optimizer's counter, read back); holds where asked."""

    def __init__(self):
        super().__init__()
        self.file = open(os.path.join(out, f"steps-rank{rank}.txt"), "a")

    def on_train_batch_end(self, batch, logs=None):
        iteration = int(self.model.optimizer.iterations.numpy())
        self.file.write(f"{launch} {iteration}\n")
        self.file.flush()

    def on_train_batch_begin(self, batch, logs=None):
        # Held before the step, so that step carries the stop flag in its gradient reduction.
        upcoming = int(self.model.optimizer.iterations.numpy()) + 1
        if hold and launch == 0 and hold == f"{rank}:{upcoming}":
            with open(os.path.join(out, f"held-{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(out, f"held-{rank}.tmp"), os.path.join(out, f"held-{rank}"))
            waiting = threading.Event()
            while not backup._watcher.requested:  # until the test's SIGTERM
                waiting.wait(0.01)


# Record first: a step is recorded even when BackupAndRestore ends fit right after it.
callbacks = [Record()] + ([backup] if backup else [])
model.fit(train, epochs=epochs, verbose=0, callbacks=callbacks)
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
print(f"rank {rank}: done", flush=True)
