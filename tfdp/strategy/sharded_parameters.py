"""The name of before ``tfdp.strategy.zero3`` for ZeRO-3's sharded parameters (compatibility).

Everything here lives in the package (its ``__init__`` states the rules): the partition rule in
zero3/partition.py, the layout and reads in zero3/layout.py and zero3/gradients.py, creation and
whole reads in zero3/parameters.py, the optimizer's side (updates, clipping, EMA) in
zero3/optimizer.py. The three names of before that guard tests replace here are forwarded to
the package (zero3/compat.py).
"""

from __future__ import annotations

from tfdp.strategy import replica_ops  # noqa: F401 (read through this module by tests)
from tfdp.strategy.zero3 import compat, gradients, optimizer
from tfdp.strategy.zero3.config import DEFAULT_SHARD_MIN_ELEMENTS
from tfdp.strategy.zero3.gradients import gather_slice, slice_gradient, slice_of_gradient
from tfdp.strategy.zero3.gradients import (  # noqa: F401 (the spelling of before)
    slice_of_sparse_gradient as _slice_of_sparse_gradient)
from tfdp.strategy.zero3.layout import ShardSpec, is_sharded, reading_given_slices
from tfdp.strategy.zero3.optimizer import (WHOLE_TENSOR_OPTIMIZERS, check_optimizer,
                                           clip_gradients, one_update_at_a_time)
from tfdp.strategy.zero3.optimizer import install_moving_average_hook as install_keras_hooks
from tfdp.strategy.zero3.optimizer import (  # noqa: F401 (the spellings of before)
    squared_norm as _squared_norm, sum_over_replicas as _sum_over_replicas)
from tfdp.strategy.zero3.parameters import create, sharded_bytes_per_replica
from tfdp.strategy.zero3.partition import Kind, owner_of, shard_layout

__all__ = ["ShardSpec", "shard_layout", "owner_of", "DEFAULT_SHARD_MIN_ELEMENTS",
           "is_sharded", "clip_gradients", "sharded_bytes_per_replica", "slice_gradient",
           "gather_slice", "check_optimizer", "WHOLE_TENSOR_OPTIMIZERS", "Kind", "create",
           "reading_given_slices", "one_update_at_a_time", "install_keras_hooks",
           "slice_of_gradient"]

compat.forward_assignments(__name__, {
    "_slice_of_sparse_gradient": (gradients, "slice_of_sparse_gradient"),
    "_squared_norm": (optimizer, "squared_norm"),
    "_sum_over_replicas": (optimizer, "sum_over_replicas")})
