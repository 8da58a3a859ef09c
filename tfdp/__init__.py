"""tfdp: data-parallel training for TensorFlow 2 and Keras 3."""

from tfdp.cluster import ClusterConfig, ClusterConfigError
from tfdp.devices import configure_cpu_replicas
from tfdp.strategy import DataParallelStrategy

__version__ = "0.1.0"

__all__ = [
    "ClusterConfig",
    "ClusterConfigError",
    "configure_cpu_replicas",
    "DataParallelStrategy",
]
