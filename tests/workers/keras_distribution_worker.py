"""Keras's distributed-training guide (tests/keras_distribution_guide.py) on several workers:
its DataParallel and ModelParallel parts over ``keras.distribution.list_devices()``, the job's
devices. The script is the guide's with ``import tfdp`` added; run by
tests/test_keras_distribution.py under ``tfdp-run --workers 2 --cpu-replicas 2``, or as two
plain processes given ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` / ``_NUM_PROCESSES`` /
``_PROCESS_ID`` (argument ``initialize``: the script calls ``keras.distribution.initialize()``,
as Keras's guide does for several processes; under tfdp-run it finds the job known).

Writes OUT/rank-<process_id>.npz: the DataParallel and ModelParallel weights (``dp_<k>``,
``mp_<k>``), their evaluate losses, ``devices`` (list_devices(), JSON), the paths of the
variables stored sharded (``sharded``) and each part's replicas in sync (``replicas``).
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np

import tfdp  # noqa: F401  (the one added line)

import keras_distribution_guide as guide

if sys.argv[1:] == ["initialize"]:
    keras.distribution.initialize()  # KERAS_DISTRIBUTION_* from the environment

devices = keras.distribution.list_devices()
rank = keras.distribution.DataParallel(devices=devices).data_shard_id  # the process id
dp_model, dp_loss = guide.data_parallel(devices)
mp_model, mp_loss = guide.model_parallel(devices)
out = {f"dp_{k}": w for k, w in enumerate(dp_model.get_weights())}
out.update({f"mp_{k}": w for k, w in enumerate(mp_model.get_weights())})
sharded = [v.path for v in mp_model.weights if type(v.value).__name__ == "ShardedVariable"]
np.savez(os.path.join(os.environ["TFDP_TEST_OUT"], f"rank-{rank}.npz"), dp_loss=dp_loss,
         mp_loss=mp_loss, devices=json.dumps(devices), sharded=json.dumps(sharded),
         replicas=[dp_model.distribute_strategy.num_replicas_in_sync,
                   mp_model.distribute_strategy.num_replicas_in_sync], **out)
print("keras_distribution_worker done", rank, devices, flush=True)
