"""A Horovod-style script that reads horovodrun's variables before importing tfdp, then
what hvd.init() reports; writes both to $TFDP_TEST_OUT/env-<rank>.json."""

import json
import os

NAMES = ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
         "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "OMPI_COMM_WORLD_RANK",
         "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
         "TF_FORCE_GPU_ALLOW_GROWTH"]
before = {name: os.environ.get(name) for name in NAMES}
print("before import:", json.dumps(before), flush=True)

import tfdp.horovod as hvd  # noqa: E402  (after reading the variables it may set)

hvd.init()
reported = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size()}
with open(os.path.join(os.environ["TFDP_TEST_OUT"], f"env-{hvd.rank()}.json"), "w") as f:
    json.dump({"env": before, "hvd": reported}, f)
