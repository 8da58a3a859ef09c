"""A worker of the two-worker ZeRO-3 test, started by tfdp-run (real processes).

Builds ``DataParallelStrategy(shard_parameters=True, shard_min_elements=0)``, trains
tests/zero3_cases.py's model with its optimizer, saves a ``.keras`` file the way every worker
must (the chief to OUT/model.keras, the others to a temporary path: saving gathers slices
from every worker), and writes this worker's final weights (get_weights: whole tensors) and
the shape of every slice it holds to OUT/weights-<rank>.npz.

Env knobs: TFDP_TEST_OUT, TFDP_TEST_MODEL, TFDP_TEST_OPTIMIZER (keys of tests/zero3_cases.py),
TFDP_TEST_JIT=1 (compile with jit_compile=True: ZeRO-3's units compiled each on its own),
TFDP_TEST_SAVE_ON=chief (Horovod's idiom instead: only the chief saves OUT/model.keras and
reads the weights, printing ``rank 0: saving at <time>``, then ``rank 0: saved in <s> s`` or
``rank 0: <Error> at <time>: <message>``; the other workers end their script, and serve the
chief's reads from their exit, or, with TFDP_TEST_OTHER=wait, print ``rank R: waiting`` and
block, alive: the test kills them).
"""

import os
import shutil
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tfdp
from helpers import classification_data, initial_weights
from zero3_cases import MODELS, OPTIMIZERS, compile_for

rank = int(os.environ.get("TFDP_RANK", "0"))
out = os.environ["TFDP_TEST_OUT"]
model_fn = MODELS[os.environ.get("TFDP_TEST_MODEL", "dense")]
optimizer_fn = OPTIMIZERS[os.environ.get("TFDP_TEST_OPTIMIZER", "adam_global_clipnorm")]

strategy = tfdp.DataParallelStrategy(shard_parameters=True, shard_min_elements=0)
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas, chief={strategy.cluster.is_chief}",
      flush=True)
x, y = classification_data()
with strategy.scope():
    model = model_fn()
    model.set_weights(initial_weights(model_fn))
    compile_for(model, optimizer_fn(), jit_compile=os.environ.get("TFDP_TEST_JIT") == "1")

train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), 64)
history = model.fit(train, epochs=2, verbose=0)

if os.environ.get("TFDP_TEST_SAVE_ON", "all") == "chief":
    if strategy.cluster.is_chief:
        print(f"rank 0: saving at {time.time():.3f}", flush=True)
        start = time.monotonic()
        try:
            model.save(os.path.join(out, "model.keras"))
            weights = model.get_weights()
        except Exception as e:  # the test reads the type and message
            print(f"rank 0: {type(e).__name__} at {time.time():.3f}: {e}", flush=True)
            sys.exit(1)  # a failing exit (tfdp's orderly exit records sys.exit's code)
        print(f"rank 0: saved in {time.monotonic() - start:.1f} s", flush=True)
        np.savez(os.path.join(out, "weights-0.npz"), *weights)
    elif os.environ.get("TFDP_TEST_OTHER") == "wait":
        print(f"rank {rank}: waiting", flush=True)
        threading.Event().wait()  # alive, never taking part: the test kills this process
    print(f"rank {rank}: done", flush=True)
    raise SystemExit(0)

target = tfdp.callbacks.write_path(os.path.join(out, "model.keras"), strategy)
os.makedirs(os.path.dirname(target), exist_ok=True)
model.save(target)
if not strategy.cluster.is_chief:
    shutil.rmtree(os.path.dirname(target), ignore_errors=True)

slices = {f"slice{i}_{j}": np.asarray(c.shape)
          for i, v in enumerate(model.trainable_variables)
          for j, c in enumerate(getattr(v.value, "components", ()))}
np.savez(os.path.join(out, f"weights-{rank}.npz"), *model.get_weights(),
         loss=np.asarray(history.history["loss"]), **slices)
print(f"rank {rank}: done, loss {history.history['loss']}", flush=True)
