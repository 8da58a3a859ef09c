"""Where this process sits in a job -> ``ClusterConfig``. Pure Python, no TensorFlow import.

See ``config.py`` for the order in which the sources are tried.
"""

from tfdp.cluster.config import DEFAULT_PORT_BASE, ClusterConfig, ClusterConfigError, port_base

__all__ = ["ClusterConfig", "ClusterConfigError", "DEFAULT_PORT_BASE", "port_base"]
