"""Worker for tests/test_data_shuffle.py: ``tf.data.Dataset.range(96)`` shuffled by the user's
own pipeline, through ``tfdp.data.distribute`` on real workers (DATA sharding), one case after
the other; dumps, per case, the element ids this worker's replicas saw in each epoch and what
``sharding_info`` says, to OUT/shuffle-<rank>.json.

Cases, in this order (the global seed stays unset until the last one):

* ``unseeded``: ``shuffle(96)``, two epochs (tfdp seeds it: each epoch exactly once);
* ``guard``: the same with tfdp's seeding turned off (plan._SEED_UNSEEDED): each worker draws
  its own order, so elements are lost and duplicated;
* ``seeded``: ``shuffle(96, seed=1)``: unchanged (already the same order on every worker);
* ``shuffle_buffer``: no shuffle in the source, ``shuffle_buffer=16`` to distribute;
* ``set_seed``: ``tf.random.set_seed(7)`` on every worker, then ``shuffle(96)``: unchanged.

Env: TFDP_TEST_OUT."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

import tfdp
from data_helpers import read_epoch_with_collectives
from tfdp.data import plan as plan_lib

out = os.environ["TFDP_TEST_OUT"]
rank = int(os.environ["TFDP_RANK"])
strategy = tfdp.DataParallelStrategy()
GLOBAL_BATCH = 12  # 8 steps of 96; divides over 2 x 2 and 3 x 1 replicas


def run(name, make, epochs=1, **kwargs):
    dist = tfdp.data.distribute(strategy, make(), GLOBAL_BATCH, **kwargs)
    result[name] = {"epochs": [read_epoch_with_collectives(strategy, dist)[0]
                               for _ in range(epochs)],
                    "policy": dist.sharding_info["policy"],
                    "seeded_shuffles": dist.sharding_info["seeded_shuffles"]}


result = {}
run("unseeded", lambda: tf.data.Dataset.range(96).shuffle(96), epochs=2)
plan_lib._SEED_UNSEEDED = False
try:
    run("guard", lambda: tf.data.Dataset.range(96).shuffle(96))
finally:
    plan_lib._SEED_UNSEEDED = True
run("seeded", lambda: tf.data.Dataset.range(96).shuffle(96, seed=1))
run("shuffle_buffer", lambda: tf.data.Dataset.range(96), shuffle_buffer=16)
tf.random.set_seed(7)
run("set_seed", lambda: tf.data.Dataset.range(96).shuffle(96))

with open(os.path.join(out, f"shuffle-{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank}: shuffle done", flush=True)
