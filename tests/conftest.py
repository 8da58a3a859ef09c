"""Test set-up: one process with 4 logical CPU replicas (the machine has no GPU), and the
fixtures several test modules share."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import tfdp  # noqa: E402

NUM_CPU_REPLICAS = 4
tfdp.configure_cpu_replicas(NUM_CPU_REPLICAS)

from helpers import cpu_devices  # noqa: E402  (after the devices are configured)


@pytest.fixture(scope="module")
def strategy4():
    """A DataParallelStrategy over the 4 logical CPU devices, one per test module."""
    return tfdp.DataParallelStrategy(devices=cpu_devices(NUM_CPU_REPLICAS))
