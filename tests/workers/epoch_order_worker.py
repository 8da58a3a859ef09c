"""A worker of the two-worker epoch-order test (tests/test_epoch_order.py), started by tfdp-run.

Trains the recording model of tests/epoch_order_cases.py for its epochs on the batched,
shuffled dataset (seeded unless TFDP_TEST_SEEDED=0), the global seed set first as a user's
script does, and writes the (replica, example ids) its replicas saw, step by step, to
OUT/order-<rank>.json.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras

import tfdp
import epoch_order_cases as cases

strategy = tfdp.DataParallelStrategy()
rank = strategy.cluster.rank
keras.utils.set_random_seed(1)
model = cases.model_in(strategy)
model.fit(cases.dataset(cases.TRAIN_IDS, os.environ.get("TFDP_TEST_SEEDED", "1") == "1"),
          epochs=cases.EPOCHS, verbose=0)
with open(os.path.join(os.environ["TFDP_TEST_OUT"], f"order-{rank}.json"), "w") as f:
    json.dump(cases.seen, f)
print(f"rank {rank}: {len(cases.seen)} steps recorded", flush=True)
