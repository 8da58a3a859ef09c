"""The Horovod save idiom under tfdp.DataParallelStrategy with a ShardedOptimizer (ZeRO):
``if is_chief: model.save(...)`` after ``fit`` on several workers. Run by
tests/test_horovod.py under tfdp-run.

The optimizer state is sharded across the workers, so saving it gathers it from every worker;
only the chief saves here. tfdp must end the job within seconds with an error that names the
fix (save on every worker), never hang. Each worker prints ``saving`` / ``not saving`` with the
time since the start of its save decision, and the chief prints ``saved`` if the save returned.

Env knobs: TFDP_TEST_OUT; HVD_SAVE_ON = "chief" (default) or "all" (every worker saves: the
fix, which must work).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import tensorflow as tf

import tfdp
from helpers import classification_data, mlp

out = os.environ["TFDP_TEST_OUT"]
strategy = tfdp.DataParallelStrategy()
with strategy.scope():
    model = mlp()
    model.compile(optimizer=tfdp.ShardedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = classification_data(n=64)
data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                            global_batch_size=16)
model.fit(data, epochs=1, verbose=0)

start = time.monotonic()
if os.environ.get("HVD_SAVE_ON", "chief") == "all" or tfdp.callbacks.is_chief(strategy):
    print(f"saving at {time.time():.3f}", flush=True)
    model.save(os.path.join(out, "model.keras"))
    print(f"saved after {time.monotonic() - start:.1f} s", flush=True)
else:
    print("not saving", flush=True)
