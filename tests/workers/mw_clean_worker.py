"""A worker for the clean-shutdown test, started by tfdp-run (real processes).

Trains a small MLP for one short epoch, then one worker (not the chief) keeps working
after ``fit``, so the chief finishes first: the situation in which a job that succeeded
used to print coordination-service errors from the slower worker.

Env knobs: TFDP_TEST_SLOW_RANK (default 2), TFDP_TEST_SLOW_SECONDS (default 12: longer
than the coordination service's heartbeat interval, so a heartbeat to an exited chief
would happen and fail), TFDP_TEST_VANISH_RANK (that worker leaves with os._exit(0) after
training: no exit handler runs, as for a worker that died after its last collective),
TFDP_TEST_FAIL_AFTER_FIT="rank:exit" (that worker calls sys.exit(3) after training) or
"rank:raise" (it raises RuntimeError).
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf

import tfdp
from helpers import classification_data, mlp

slow_rank = int(os.environ.get("TFDP_TEST_SLOW_RANK", "2"))
slow_seconds = float(os.environ.get("TFDP_TEST_SLOW_SECONDS", "12"))
vanish_rank = int(os.environ.get("TFDP_TEST_VANISH_RANK", "-1"))
fail_rank, _, fail_how = os.environ.get("TFDP_TEST_FAIL_AFTER_FIT", "-1:").partition(":")

strategy = tfdp.DataParallelStrategy()
rank = strategy.cluster.rank
x, y = classification_data(n=96)
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), 24)
with strategy.scope():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(train, epochs=1, verbose=0, shuffle=False)
print(f"rank {rank}: trained, loss {history.history['loss'][-1]:.4f}", flush=True)
if rank == vanish_rank:
    print(f"rank {rank}: vanishing", flush=True)
    os._exit(0)
if rank == int(fail_rank):
    print(f"rank {rank}: failing after fit ({fail_how})", flush=True)
    if fail_how == "exit":
        sys.exit(3)
    raise RuntimeError("failing after fit on purpose")
if rank == slow_rank:
    # Stands for work a worker does after training (evaluation, export) that the others do
    # not: it only has to outlast the chief. Not a synchronisation: nothing waits on it.
    time.sleep(slow_seconds)
print(f"rank {rank}: done", flush=True)
