"""tfdp: data-parallel training for TensorFlow 2 and Keras 3.

Public names only; see README.md for the tour and DESIGN.md for the contract.
"""

from tfdp import callbacks, data, optimizers, schedules
from tfdp.cluster import ClusterConfig, ClusterConfigError
from tfdp.devices import configure_cpu_replicas
from tfdp.schedules import scale_learning_rate
from tfdp.sharding import ShardedOptimizer
from tfdp.strategy import DataParallelStrategy

__version__ = "0.1.0"

__all__ = [
    "callbacks",
    "ClusterConfig",
    "ClusterConfigError",
    "configure_cpu_replicas",
    "data",
    "DataParallelStrategy",
    "optimizers",
    "scale_learning_rate",
    "schedules",
    "ShardedOptimizer",
]
