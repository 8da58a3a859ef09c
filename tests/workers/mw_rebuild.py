"""A strategy rebuilt in one process, round after round (issue 40, hang 2), run by
tests/test_rebuild.py under ``tfdp-run --workers 2 --cpu-replicas 4``.

Each round builds a ``tfdp.DataParallelStrategy``, fits a small MLP with
``tfdp.ShardedOptimizer(Adam)``, ``tfdp.callbacks.BackupAndRestore`` and
``tfdp.callbacks.StragglerMonitor`` (what notebooks, sweeps and tuners do), then calls
``tfdp.strategy.keras_integration.uninstall()``. Each round's weights go to
OUT/round<k>-<rank>.npz (every round starts from the same initial weights: one device's
result is the same for every round).

Env knobs: TFDP_TEST_OUT; TFDP_TEST_ROUNDS (default 6); TFDP_TEST_EPOCHS (default 2);
TFDP_TEST_TIMEOUT: the strategies' timeout_seconds; TFDP_TEST_NO_MODEL=rank: that rank never
builds round 0's model (it stays alive, waiting); TFDP_TEST_CHIEF_VARIABLE=1: the chief alone
creates one more variable in scope after round 0's model; TFDP_TEST_LATE="rank:seconds": that rank waits before building each strategy after the first (the
other workers' runtime then reaches the new round first); TFDP_TEST_KEYS=1: every collective key this process takes (group, instance, device, caller) is
logged to OUT/keys-<rank>.txt, to compare the workers' key sequences after a hang;
TFDP_TEST_RESET=1: each round ends with ``tfdp.reset()`` instead of ``uninstall()``, and what the
process holds after each reset (tfdp's process state, threads, signal handlers, patches,
``sys.exit``) and each fit's duration go to OUT/reset-<rank>.json.
"""

import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp.cluster import ClusterConfig
from helpers import classification_data, initial_weights, mlp

out = os.environ["TFDP_TEST_OUT"]
rounds = int(os.environ.get("TFDP_TEST_ROUNDS", "6"))
epochs = int(os.environ.get("TFDP_TEST_EPOCHS", "2"))
rank = ClusterConfig.from_env().rank

if os.environ.get("TFDP_TEST_KEYS"):
    from tensorflow.python.distribute import cross_device_utils

    keys_file = open(os.path.join(out, f"keys-{rank}.txt"), "w", buffering=1)
    original_group, original_instance = (cross_device_utils.CollectiveKeys.get_group_key,
                                         cross_device_utils.CollectiveKeys.get_instance_key)

    def caller():
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "tensorflow/python" not in f.filename and "keras/src" not in f.filename]
        return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                          for f in frames[-4:][::-1])

    def get_group_key(self, devices):
        key = original_group(self, devices)
        keys_file.write(f"group {key} {','.join(devices)} | {caller()}\n")
        return key

    def get_instance_key(self, group_key, device):
        key = original_instance(self, group_key, device)
        keys_file.write(f"instance g={group_key} i={key} {device} | {caller()}\n")
        return key

    cross_device_utils.CollectiveKeys.get_group_key = get_group_key
    cross_device_utils.CollectiveKeys.get_instance_key = get_instance_key

x, y = classification_data(n=128)
global_batch = 32
late_rank, late_seconds = (os.environ.get("TFDP_TEST_LATE") or "-1:0").split(":")
resetting = bool(os.environ.get("TFDP_TEST_RESET"))
after = []  # per round, after tfdp.reset(): what the process holds
for k in range(rounds):
    print(f"rank {rank}: round {k}", flush=True)
    if k and rank == int(late_rank):
        time.sleep(float(late_seconds))  # the order of arrival under test, not a synchronisation
    timeout = os.environ.get("TFDP_TEST_TIMEOUT")
    strategy = tfdp.DataParallelStrategy(timeout_seconds=float(timeout) if timeout else None)
    if k == 0 and os.environ.get("TFDP_TEST_NO_MODEL") == str(rank):
        print(f"rank {rank}: not building the model", flush=True)
        time.sleep(600)  # alive (heartbeating) but never at the first variable; tfdp-run ends it
    if k == 0:
        w0 = initial_weights(mlp)  # after the first strategy: it configures TensorFlow
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        model.compile(optimizer=tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if k == 0 and rank == 0 and os.environ.get("TFDP_TEST_CHIEF_VARIABLE"):
            tf.Variable(tf.zeros([3]), name="chief_only")
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                 global_batch)
    callbacks = [tfdp.callbacks.BackupAndRestore(os.path.join(out, f"backup{k}")),
                 tfdp.callbacks.StragglerMonitor(window=2)]
    started = time.monotonic()
    model.fit(train, epochs=epochs, verbose=0, callbacks=callbacks)
    fit_seconds = time.monotonic() - started
    np.savez(os.path.join(out, f"round{k}-{rank}.npz"), *model.get_weights())
    if resetting:
        del model, train, callbacks, strategy
        tfdp.reset()
        import gc
        import signal
        import threading
        gc.collect()
        after.append({
            "fit_seconds": fit_seconds,
            "state": {name: repr(value) for name, value in tfdp.process_state.describe().items()},
            "python_threads": sorted(t.name for t in threading.enumerate()),
            "native_threads": len(os.listdir("/proc/self/task")),
            "handlers": {name: repr(signal.getsignal(getattr(signal, name)))
                         for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")},
            "patches": len(tfdp._tf_private.patched()),
            "sys_exit": repr(sys.exit)})
    else:
        tfdp.strategy.keras_integration.uninstall()
if resetting:
    import json
    with open(os.path.join(out, f"reset-{rank}.json"), "w") as f:
        json.dump(after, f, indent=1)
print(f"rank {rank}: done {rounds} rounds", flush=True)
sys.stdout.flush()
