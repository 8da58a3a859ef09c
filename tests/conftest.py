"""Test set-up: one process with 4 logical CPU replicas (the machine has no GPU)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdp  # noqa: E402

NUM_CPU_REPLICAS = 4
tfdp.configure_cpu_replicas(NUM_CPU_REPLICAS)
