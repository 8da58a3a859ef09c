"""A worker of the two-worker KerasHub test (tests/test_keras_hub.py), started by tfdp-run.

Trains every model named in TFDP_TEST_MODELS (keys of tests/keras_hub_cases.py, comma
separated) under ``DataParallelStrategy()`` (the job's workers x the launcher's CPU replicas),
on the dataset batched to the global batch as on one device (KerasHub's task ``fit`` takes a
``tf.data.Dataset`` or arrays, not a distributed dataset: tfdp distributes it, and each
replica's Dropout mask follows the rows it holds), and writes the final weights of each to
OUT/<model>-<rank>.npz. One job trains them all: the start-up is paid once.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import tfdp
import keras_hub_cases as cases

out = os.environ["TFDP_TEST_OUT"]
strategy = tfdp.DataParallelStrategy()
rank = strategy.cluster.rank
print(f"rank {rank}: {strategy.num_replicas_in_sync} replicas, chief={strategy.cluster.is_chief}",
      flush=True)
for name in os.environ["TFDP_TEST_MODELS"].split(","):
    model = cases.train(name, cases.initial_weights(name), strategy)
    np.savez(os.path.join(out, f"{name}-{rank}.npz"), *model.get_weights())
    print(f"rank {rank}: {name} done", flush=True)
