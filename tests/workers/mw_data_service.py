"""Worker for test_data_service.py: reads two epochs of range(101) from a tf.data service
through tfdp.data.distribute (dumping the ids its replicas saw), then trains a small MLP with
model.fit from the service. Writes OUT/service-<rank>.json.

Env: TFDP_TEST_OUT, TFDP_TEST_SERVICE (the dispatcher's grpc:// address)."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
import keras

import tfdp
from data_helpers import read_epoch_with_collectives
from helpers import classification_data, initial_weights, mlp

out, service = os.environ["TFDP_TEST_OUT"], os.environ["TFDP_TEST_SERVICE"]
rank = int(os.environ["TFDP_RANK"])
strategy = tfdp.DataParallelStrategy()

dist = tfdp.data.distribute(strategy, tf.data.Dataset.range(101), 8, shuffle_buffer=16,
                            service=service)


epochs, steps = [], []
for _ in range(2):
    seen, n = read_epoch_with_collectives(strategy, dist)
    epochs.append(seen)
    steps.append(n)

x, y = classification_data(n=128)
with strategy.scope():
    model = mlp()
    model.set_weights(initial_weights(mlp))
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), 16,
                             service=service)
batches = []
model.fit(train, epochs=2, verbose=0,
          callbacks=[keras.callbacks.LambdaCallback(
              on_train_batch_end=lambda b, logs: batches.append(b))])
weights = [np.asarray(c).tolist() for v in model.trainable_variables
           for c in strategy.experimental_local_results(v.value)]
with open(os.path.join(out, f"service-{rank}.json"), "w") as f:
    json.dump({"epochs": epochs, "steps": steps, "weights": weights, "fit_batches": len(batches),
               "job": dist.sharding_info.get("service_job")}, f)
print(f"rank {rank}: service done, steps {steps}", flush=True)
