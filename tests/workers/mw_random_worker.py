"""Per-replica random draws on several workers (tfdp-run, 2 CPU replicas per worker).

Each worker runs one step of Dropout, GaussianNoise and RandomFlip on its replicas' rows of a
fixed global batch, inside ``strategy.run``, and then two epochs of ``fit`` of a small MLP with
Dropout 0.3 on the same global batches, through tfdp.data and again on the plain batched
dataset (TensorFlow's distribution); it writes its replicas' outputs (in global replica
order) and the trained weights of both to ``$TFDP_TEST_OUT/rank<r>.npz``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np

import helpers
import tfdp

from random_cases import dropout_mlp, replica_draws, train_dropout

strategy = tfdp.DataParallelStrategy()
rank = strategy.cluster.rank
local = replica_draws(strategy)
model_fn = dropout_mlp if os.environ.get("TFDP_TEST_MODEL") != "mlp" else helpers.mlp
weights = train_dropout(strategy, model_fn)
# The same training on the plain batched dataset: TensorFlow's own distribution of it.
plain = train_dropout(strategy, model_fn, plain_input=True)
np.savez(os.path.join(os.environ["TFDP_TEST_OUT"], f"rank{rank}.npz"),
         **local, **{f"w{i}": w for i, w in enumerate(weights)},
         **{f"p{i}": w for i, w in enumerate(plain)})
print("RANDOM_DONE", rank, flush=True)
