"""Collectives outside a training step that one worker never reaches (issue 40, item 2), run
by tests/test_outside_step.py under ``tfdp-run --workers 2``.

Worker 1 stays alive (its heartbeats reach the coordination service, so TensorFlow finds
nothing wrong) but skips the call worker 0 makes, then blocks: worker 0 must fail within the
deadline with tfdp's message naming worker 1, and tfdp-run must end the job. Each worker
prints ``rank R: skipping <call>`` / ``rank R: calling <call>`` before it and, when the call
raised, ``rank R: <ErrorType>: <message>``; ``rank R: returned`` if it returned.

Env knobs: TFDP_TEST_CASE: ``hvd_broadcast`` (``hvd.broadcast_variables`` under ``if
hvd.rank() == 0``), ``zero3_save`` (``model.save_weights`` under ``if is_chief`` with
``shard_parameters=True``), ``zero3_predict`` (only the chief predicts with
``shard_parameters=True``), ``evaluate`` (only the chief evaluates, first evaluation);
TFDP_TEST_SKIP: ``1`` (default) worker 1 skips, ``none`` nobody
does (the guard: the same script then returns on both); TFDP_TIMEOUT_SECONDS: the deadline.
"""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp.cluster import ClusterConfig

case = os.environ["TFDP_TEST_CASE"]
skipper = os.environ.get("TFDP_TEST_SKIP", "1")
rank = ClusterConfig.from_env().rank
skips = skipper != "none" and rank == int(skipper)


def zero3_model(shard_parameters=True):
    strategy = tfdp.DataParallelStrategy(shard_parameters=shard_parameters, shard_min_elements=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.MeanSquaredError())
    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                global_batch_size=16)
    model.fit(data, epochs=1, verbose=0)  # both workers train: the call after it is the test
    return model, x


if case == "hvd_broadcast":
    import tfdp.horovod as hvd

    hvd.init()
    variables = [tf.Variable(tf.fill([3], float(hvd.rank())))]
    # Both ranks meet once first (the engine is built then, as in a script that averaged a
    # metric): the call under test is not the job's first collective.
    hvd.allreduce(tf.constant(1.0))
    def call():
        return hvd.broadcast_variables(variables, root_rank=0)
elif case == "zero3_save":
    model, _ = zero3_model()
    path = os.path.join(os.environ["TFDP_TEST_OUT"], f"weights-{rank}.weights.h5")
    def call():
        return model.save_weights(path)
elif case == "evaluate":
    model, x = zero3_model(shard_parameters=False)
    # A distributed input, as fit's.
    data = tfdp.data.distribute(model.distribute_strategy, tf.data.Dataset.from_tensor_slices(
        (x, np.zeros((len(x), 4), "float32"))), global_batch_size=16)
    def call():
        return model.evaluate(data, verbose=0)
elif case == "zero3_predict":
    model, x = zero3_model()
    def call():
        return model.predict(x, batch_size=16, verbose=0)
else:
    raise SystemExit(f"unknown TFDP_TEST_CASE={case!r}")

if skips:
    print(f"rank {rank}: skipping {case}", flush=True)
    threading.Event().wait()  # alive, never arriving: tfdp-run ends this process
print(f"rank {rank}: calling {case}", flush=True)
try:
    call()
except Exception as e:  # the test reads the type and message
    message = getattr(e, "message", None) or str(e)
    print(f"rank {rank}: {type(e).__name__}: {message}", flush=True)
    raise SystemExit(1)
print(f"rank {rank}: returned", flush=True)
