"""A worker for the ZeRO-2 multi-worker test, started by tfdp-run (real processes).

For each case, trains tests/helpers.py's deep MLP with a ShardedOptimizer whose wrapped
optimizer accumulates gradients over 4 micro-batches, then saves a checkpoint the way every
worker must (the chief to OUT/<case>/ckpt.weights.h5, the others to a temporary path) and
writes this worker's final weights (and every replica's copy) to OUT/<case>/weights-<rank>.npz.
One job trains every case, each on a model and optimizer of its own: the start-up is paid once.

Env knobs: TFDP_TEST_OUT, TFDP_TEST_CASE (keys of MW_CASES in tests/zero2_cases.py, comma
separated), TFDP_TEST_EPOCHS.
"""

import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import tfdp
from helpers import classification_data, deep_mlp, initial_weights
from zero2_cases import MICRO_BATCH, MW_CASES, compile_for

rank = int(os.environ.get("TFDP_RANK", "0"))
out = os.environ["TFDP_TEST_OUT"]
cases = os.environ["TFDP_TEST_CASE"].split(",")
epochs = int(os.environ.get("TFDP_TEST_EPOCHS", "2"))

strategy = tfdp.DataParallelStrategy()
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas, chief={strategy.cluster.is_chief}",
      flush=True)
x, y = classification_data()


def run(case):
    case_out = os.path.join(out, case)
    os.makedirs(case_out, exist_ok=True)
    with strategy.scope():
        model = deep_mlp()
        model.set_weights(initial_weights(deep_mlp))
        compile_for(model, MW_CASES[case](sharded=True))

    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                 MICRO_BATCH)
    history = model.fit(train, epochs=epochs, verbose=0)

    # Saving gathers the sharded state over the network: every worker saves.
    target = tfdp.callbacks.write_path(os.path.join(case_out, "ckpt.weights.h5"), strategy)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    model.save_weights(target)
    if not strategy.cluster.is_chief:
        shutil.rmtree(os.path.dirname(target), ignore_errors=True)

    replicas = {f"var{i}_replica{j}": np.asarray(c)
                for i, v in enumerate(model.trainable_variables)
                for j, c in enumerate(strategy.experimental_local_results(v.value))}
    np.savez(os.path.join(case_out, f"weights-{rank}.npz"), *model.get_weights(),
             loss=np.asarray(history.history["loss"]), **replicas)
    print(f"rank {rank}: {case} done, loss {history.history['loss']}", flush=True)


for case in cases:
    run(case)
