"""Where this process sits in a job -> ``ClusterConfig``. Pure Python, no TensorFlow import.

One module per source, each returning a plain ``Layout`` (``layout.py``): ``tf_config``
(TF_CONFIG), ``vertex`` (CLUSTER_SPEC), ``sagemaker`` (SM_HOSTS), ``slurm`` (an srun step),
``kubernetes`` (a pod of an indexed Job or JobSet), ``resolver`` (a ClusterResolver);
``gpus`` says which GPUs each of several workers on one host takes; ``placement`` gives
Horovod's ranks (local, cross) from the worker addresses; ``ray_train`` puts Ray Train's
workers on 127.0.0.1 when they share this host.
``errors`` is the leaf they share; ``config`` builds ``ClusterConfig`` and states the order in
which ``from_env`` tries the sources.
"""

from tfdp.cluster.config import ClusterConfig
from tfdp.cluster.errors import DEFAULT_PORT_BASE, ClusterConfigError, port_base

__all__ = ["ClusterConfig", "ClusterConfigError", "DEFAULT_PORT_BASE", "port_base"]

# The launcher protocol's names have one home, tfdp.protocol; 0.2.0 defined them here and the
# 0.3.0 changelog promised they stay importable from tfdp.cluster.
from tfdp.protocol import (ATTEMPT_ENV, CONTROL_DIR_ENV, CPU_REPLICAS_ENV,  # noqa: F401 (re-exported, 0.3.0's promise)
                           EVICT_FILE, EXIT_PREEMPTED, EXIT_RESTART_REQUESTED, GRACE_ENV,
                           MIN_WORKERS_ENV, PORT_BASE_ENV, RANK_ENV, READY_FILE_ENV,
                           RESTARTS_LEFT_ENV, SLOT_ENV, progress_file)
