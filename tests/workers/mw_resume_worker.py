"""A worker for the preemption/restart/elastic tests (real processes, started by tfdp-run or
alone as a one-process reference).

Trains a small MLP with tfdp.DataParallelStrategy on tfdp.data input, with
tfdp.callbacks.BackupAndRestore, and records every training step it runs (the optimizer's
iteration counter after the step, read from the model, not inferred) to
OUT/steps-slot<slot>.txt as "attempt rank iteration unix-time". At the end it writes the weights to
OUT/weights-<rank>.npz.

Env knobs (all optional except TFDP_TEST_OUT):
  TFDP_TEST_BACKUP        backup dir (BackupAndRestore)
  TFDP_TEST_SAVE_FREQ     integer steps or "epoch" (default 5)
  TFDP_TEST_EPOCHS, TFDP_TEST_N, TFDP_TEST_GLOBAL_BATCH, TFDP_TEST_SHUFFLE ("1")
  TFDP_TEST_OPT           adam | sharded_adam | sgd
  TFDP_TEST_JIT           "1": model.compile(jit_compile=True), and tfdp's INFO lines on stderr
                          (the first step's XLA compile cache line)
  TFDP_TEST_HOLD          "slot:iteration": in attempt 0, that slot's worker writes OUT/held-<slot>
                          (its pid) before that step and waits until it has received SIGTERM
                          (so the step carries the stop flag in its gradient reduction and
                          every worker stops after it)
  TFDP_TEST_FAIL          "slot:iteration:kill|exit" in attempt 0
  TFDP_TEST_BROKEN_SLOT   slot that exits 1 at start in every attempt >= 1 (cannot come back)
  TFDP_TEST_MONITOR       window: add StragglerMonitor(window) ; TFDP_TEST_EVICT=1: evict=True
  TFDP_TEST_PACE_MS       host work added to every step (keeps the job running long enough
                          for a test to act on it; it is load, not synchronisation)
  TFDP_TEST_COMPUTE_MS    work inside the model's forward pass (a stand-in for a bigger model:
                          the MLP computes in well under 1 ms), leaving the math unchanged
  TFDP_TEST_SLOW          "kind:slot:first:last,...": that slot is slowed while its optimizer
                          iteration is in [first, last): kind "compute" adds TFDP_TEST_SLOW_MS
                          (default 20) of work to its forward pass, "input" makes its input
                          pipeline's map sleep TFDP_TEST_SLOW_MS per batch (per element: that
                          divided by the global batch, which each worker's pipeline maps before
                          sharding). Neither changes the math.
"""

import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from tfdp.cluster import ClusterConfig  # pure Python

# tfdp-run gives a slot; a scheduler's plain relaunch has only TF_CONFIG (slot = rank).
slot = int(os.environ.get("TFDP_SLOT", ClusterConfig.from_env().rank))
attempt = int(os.environ.get("TFDP_ATTEMPT", "0"))
out = os.environ["TFDP_TEST_OUT"]
pid_file = os.path.join(out, f"pid-slot{slot}-attempt{attempt}")
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)  # whole or absent: the tests read it as soon as it exists
broken = os.environ.get("TFDP_TEST_BROKEN_SLOT")
if broken is not None and int(broken) == slot and attempt >= 1:
    print(f"slot {slot}: this host is gone (attempt {attempt})", flush=True)
    sys.exit(1)

import numpy as np  # noqa: E402  (after the pid file and a gone host's exit)
import tensorflow as tf  # noqa: E402  (after the pid file and a gone host's exit)
import keras  # noqa: E402  (after the pid file and a gone host's exit)

import tfdp  # noqa: E402  (after the pid file and a gone host's exit)
from helpers import classification_data, initial_weights, mlp  # noqa: E402  (after the pid file and a gone host's exit)

epochs = int(os.environ.get("TFDP_TEST_EPOCHS", "3"))
n = int(os.environ.get("TFDP_TEST_N", "256"))
global_batch = int(os.environ.get("TFDP_TEST_GLOBAL_BATCH", "32"))
opt_name = os.environ.get("TFDP_TEST_OPT", "adam")
save_freq = os.environ.get("TFDP_TEST_SAVE_FREQ", "5")
save_freq = save_freq if save_freq == "epoch" else int(save_freq)
pace = float(os.environ.get("TFDP_TEST_PACE_MS", "0")) / 1000.0

if os.environ.get("TFDP_TEST_JIT"):
    import logging
    logging.basicConfig(format="%(message)s")
    logging.getLogger("tfdp").setLevel(logging.INFO)
strategy = tfdp.DataParallelStrategy()
rank = strategy.cluster.rank
print(f"slot {slot} rank {rank} attempt {attempt}: {strategy.cluster.num_workers} workers, "
      f"{strategy.num_replicas_in_sync} replicas", flush=True)
x, y = classification_data(n=n)
w0 = initial_weights(mlp)


def optimizer():
    if opt_name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    adam = keras.optimizers.Adam(0.01, global_clipnorm=0.5)
    return tfdp.ShardedOptimizer(adam) if opt_name == "sharded_adam" else adam


compute_s = float(os.environ.get("TFDP_TEST_COMPUTE_MS", "0")) / 1000.0
slow_s = float(os.environ.get("TFDP_TEST_SLOW_MS", "20")) / 1000.0
slow_phases = [(kind, int(s_), int(a), int(b)) for kind, s_, a, b in
               (item.split(":") for item in os.environ.get("TFDP_TEST_SLOW", "").split(",") if item)]
iteration_now = [0]  # this worker's optimizer iteration, updated after every step


def slowed(kind):
    return any(k == kind and s_ == slot and a <= iteration_now[0] < b for k, s_, a, b in slow_phases)


def spin(_):
    end = time.perf_counter() + compute_s + (slow_s if slowed("compute") else 0.0)
    while time.perf_counter() < end:
        pass
    return 0.0


def slow_parse(x, y):
    def parse(value):
        if slowed("input"):
            time.sleep(slow_s / global_batch)
        return value

    x = tf.numpy_function(parse, [x], tf.float32, stateful=True)
    x.set_shape(x_shape)
    return x, y


def heavy(x):
    done = tf.py_function(spin, [x], tf.float32)
    with tf.control_dependencies([done]):
        return tf.identity(x)


with strategy.scope():
    model = mlp()
    if compute_s or any(k == "compute" for k, *_ in slow_phases):
        model = keras.Sequential([keras.layers.Lambda(heavy)] + model.layers)
        model.build((None, x.shape[1]))
    model.set_weights(w0)
    model.compile(optimizer=optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=bool(os.environ.get("TFDP_TEST_JIT")))

x_shape = x.shape[1:]
source = tf.data.Dataset.from_tensor_slices((x, y))
if any(k == "input" for k, *_ in slow_phases):
    source = source.map(slow_parse)  # every worker: the same pipeline, slowed on one only
train = tfdp.data.distribute(strategy, source, global_batch,
                             shuffle_buffer=n if os.environ.get("TFDP_TEST_SHUFFLE") else None,
                             seed=11)
backup = tfdp.callbacks.BackupAndRestore(os.environ["TFDP_TEST_BACKUP"], save_freq=save_freq,
                                         dataset=train) \
    if os.environ.get("TFDP_TEST_BACKUP") else None


def spec(name):
    value = os.environ.get(name)
    return value.split(":") if value else None


class Record(keras.callbacks.Callback):
    """Records the steps really run, holds or fails where the test asks."""

    def __init__(self):
        super().__init__()
        self.file = open(os.path.join(out, f"steps-slot{slot}.txt"), "a")
        self.hold, self.fail = spec("TFDP_TEST_HOLD"), spec("TFDP_TEST_FAIL")

    def on_train_batch_end(self, batch, logs=None):
        iteration = int(self.model.optimizer.iterations.numpy())
        iteration_now[0] = iteration
        self.file.write(f"{attempt} {rank} {iteration} {time.time():.4f}\n")
        self.file.flush()
        if pace:
            end = time.perf_counter() + pace
            while time.perf_counter() < end:  # busy host work, as a heavier step would be
                pass
        if attempt == 0 and self.fail and int(self.fail[0]) == slot and int(self.fail[1]) == iteration:
            print(f"slot {slot}: failing ({self.fail[2]}) after iteration {iteration}", flush=True)
            if self.fail[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)

    def on_train_batch_begin(self, batch, logs=None):
        upcoming = int(self.model.optimizer.iterations.numpy()) + 1
        if attempt == 0 and self.hold and int(self.hold[0]) == slot and int(self.hold[1]) == upcoming:
            with open(os.path.join(out, f"held-{slot}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(out, f"held-{slot}.tmp"), os.path.join(out, f"held-{slot}"))
            received = threading.Event()
            while not backup._watcher.requested:  # wait for the test's SIGTERM
                received.wait(0.01)


# Record first: a step is recorded even when BackupAndRestore ends fit right after it.
callbacks = [Record()] + ([backup] if backup else [tfdp.callbacks.DatasetEpoch(train)])
monitor = None
if os.environ.get("TFDP_TEST_MONITOR"):
    monitor = tfdp.callbacks.StragglerMonitor(window=int(os.environ["TFDP_TEST_MONITOR"]),
                                              evict=bool(os.environ.get("TFDP_TEST_EVICT")))
    callbacks.append(monitor)
start = time.monotonic()
history = model.fit(train, epochs=epochs, verbose=0, callbacks=callbacks)
elapsed = time.monotonic() - start
if monitor is not None:
    with open(os.path.join(out, f"monitor-attempt{attempt}-rank{rank}.json"), "w") as f:
        json.dump({"history": monitor.history, "stragglers": sorted(monitor.stragglers)}, f)
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights())
print(f"slot {slot} rank {rank}: done in {elapsed:.1f} s", flush=True)
