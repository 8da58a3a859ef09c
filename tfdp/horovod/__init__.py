"""``import tfdp.horovod as hvd``: Horovod's ``horovod.tensorflow`` API on tfdp.

A Horovod script (one process per replica, models built outside any strategy scope) runs
with its import changed and ``horovodrun -np N -H a:4,b:4`` replaced by
``tfdp-run -np N -H a:4,b:4``. Migration guide and the status of every name: docs/horovod.md.

One module per idea: ``_runtime`` (``init`` and the ranks; the collective engine, built at
the first collective), ``collectives`` (tensor and object collectives), ``optimizer``
(``DistributedOptimizer``, ``DistributedGradientTape``), ``callbacks`` (the Keras callbacks),
``elastic`` (``hvd.elastic``: commits and ``@run`` on tfdp-run's restarts),
``_missing`` (what is not implemented, and the tfdp way); ``tfdp.horovod.keras`` is
``horovod.tensorflow.keras``.
"""

from tfdp.horovod._missing import (BroadcastGlobalVariablesHook, ProcessSet, add_process_set,
                                   broadcast_global_variables, global_process_set,
                                   missing_attribute, remove_process_set, start_timeline,
                                   stop_timeline)
from tfdp.horovod._runtime import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                   gloo_built, gloo_enabled, init, is_homogeneous,
                                   is_initialized, local_rank, local_size, mpi_built,
                                   mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                   rocm_built, shutdown, size)
from tfdp.horovod.collectives import (Adasum, Average, Compression, Max, Min, Product, Sum,
                                      allgather, allgather_object, allreduce, alltoall, barrier,
                                      broadcast, broadcast_object, broadcast_variables,
                                      grouped_allgather, grouped_allreduce,
                                      grouped_reducescatter, join, local_rank_op,
                                      local_size_op, process_set_included_op, rank_op,
                                      reducescatter, size_op)
from tfdp.horovod.optimizer import DistributedGradientTape, DistributedOptimizer
from tfdp.horovod import elastic  # hvd.elastic

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_variables", "broadcast_object", "allgather_object", "alltoall",
    "reducescatter", "grouped_reducescatter", "barrier", "join",
    "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op",
    "DistributedOptimizer", "DistributedGradientTape",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline", "broadcast_global_variables",
    "BroadcastGlobalVariablesHook", "elastic",
]


def __getattr__(name):
    raise missing_attribute(__name__, name)
