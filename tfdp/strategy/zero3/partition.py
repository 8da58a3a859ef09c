"""ZeRO-3's partition rule: which variables are sharded, and which elements each replica holds.

Rule. A variable being created in the strategy's scope is sharded when it is a trainable (or
trainability unsaid) floating-point variable of a fully defined shape with at least
``shard_min_elements`` elements (``kind_of`` -> ``Kind.PARAMETER``), or optimizer state
created for a sharded parameter (``colocate_with`` it: ``Kind.STATE``), which must then have
its parameter's shape. Variables synchronized on read, non-trainable ones, integer ones and
smaller ones stay mirrored. A sharded variable of n elements is flattened, padded with zeros to
a multiple of R (all replicas of all workers) and cut into R equal slices: replica g (worker w,
local replica i: g = w * local_replicas + i, the order of tfdp's collectives) holds elements
``[g * S, (g + 1) * S)``, ``S = ceil(n / R)`` (``Partition``).

Pure: shapes, sizes and replica counts in, a decision out; no TensorFlow. The rule is applied
in two steps because the second needs the initial value, which is evaluated only when the
first allows sharding (``may_shard``: what the creator's arguments say), and at most once
(parameters.create).
"""

from __future__ import annotations

import dataclasses
import enum
import math

__all__ = ["Kind", "Partition", "shard_layout", "owner_of", "may_shard", "kind_of",
           "size_threshold"]


class Kind(enum.Enum):
    """What a replica's read of a sharded variable is."""

    PARAMETER = "parameter"  # the whole tensor, all-gathered (its gradient reduce-scattered)
    STATE = "state"          # optimizer state: this replica's slice


def shard_layout(num_elements: int, num_shards: int) -> tuple[int, int]:
    """``(S, pad)``: each of ``num_shards`` slices holds S elements, the last ``pad`` of the
    flattened tensor's ``num_shards * S`` being zeros. Pure.

    Args:
        num_elements: n, the whole tensor's element count.
        num_shards: R, every replica of every worker.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1.")
    size = max(1, math.ceil(num_elements / num_shards))
    return size, size * num_shards - num_elements


def owner_of(element: int, num_elements: int, num_shards: int) -> int:
    """The replica whose slice holds flat element ``element``. Pure.

    Args:
        element: a flat index into the whole tensor.
        num_elements: n.
        num_shards: R.
    """
    if not 0 <= element < num_elements:
        raise ValueError(f"element {element} is outside [0, {num_elements}).")
    return element // shard_layout(num_elements, num_shards)[0]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Where one sharded variable's elements live: R slices of S elements, this worker's
    ``local_shards`` of them starting at global replica ``first_shard``.

    Attributes:
        num_elements: n, the whole tensor's element count.
        num_shards: R, every replica of every worker.
        first_shard: the global replica id of this worker's first local replica.
        local_shards: this worker's replicas.
    """

    num_elements: int
    num_shards: int
    first_shard: int = 0
    local_shards: int = 1

    def __post_init__(self):
        shard_layout(self.num_elements, self.num_shards)  # checks num_shards
        if not 0 <= self.first_shard <= self.first_shard + self.local_shards <= self.num_shards:
            raise ValueError(f"local slices {self.first_shard}.."
                             f"{self.first_shard + self.local_shards - 1} are not among the "
                             f"{self.num_shards} slices.")

    @property
    def shard_size(self) -> int:
        """S, the elements of every slice."""
        return shard_layout(self.num_elements, self.num_shards)[0]

    @property
    def pad(self) -> int:
        """The zeros after the n elements in the last slices."""
        return shard_layout(self.num_elements, self.num_shards)[1]

    def bounds(self, local_index: int) -> tuple[int, int]:
        """``[start, stop)`` of local replica ``local_index``'s slice in the padded flat
        tensor."""
        start = (self.first_shard + local_index) * self.shard_size
        return start, start + self.shard_size

    @property
    def holds_every_slice(self) -> bool:
        """Whether this worker holds all R slices (one worker): a whole read needs no
        collective."""
        return self.first_shard == 0 and self.local_shards == self.num_shards


def may_shard(*, on_read: bool, trainable, follows_parameter: bool) -> bool:
    """The rule's first step, from the creator's arguments alone (before the initial value is
    evaluated): False for a variable that stays mirrored whatever its value.

    Args:
        on_read: synchronized on read (``tf.VariableSynchronization.ON_READ``: metrics).
        trainable: the creator's ``trainable`` (None: not said).
        follows_parameter: it is created for a sharded parameter (``colocate_with`` it).
    """
    if on_read:
        return False
    return follows_parameter or trainable is not False


def kind_of(*, shape, floating: bool, min_elements: int, parameter_shape=None,
            parameter_name: str = ""):
    """The rule's second step, from the evaluated initial value: ``Kind.PARAMETER``,
    ``Kind.STATE`` or None (mirrored).

    Args:
        shape: the value's shape as a tuple (None entries: unknown dimensions), or None
            (unknown rank).
        floating: whether its dtype is floating-point.
        min_elements: the size threshold (``size_threshold``).
        parameter_shape: for state created for a sharded parameter, that parameter's shape
            (a tuple); None otherwise.
        parameter_name: that parameter's name, for the error.

    Raises:
        ValueError: state shaped otherwise than its parameter (a factored or matrix-wise
            optimizer), naming the fix.
    """
    if not floating or shape is None or any(d is None for d in shape):
        return None
    if parameter_shape is not None:
        if tuple(shape) != tuple(parameter_shape):
            raise ValueError(
                f"tfdp: the optimizer creates state of shape {tuple(shape)} for the sharded "
                f"parameter {parameter_name} of shape {tuple(parameter_shape)}; with "
                "shard_parameters=True each replica updates only its slice, so optimizer "
                "state must be elementwise (shaped like its parameter: SGD, Adam, AdamW, "
                "RMSprop, Adagrad, Lion, ...). Factored or matrix-wise optimizers (Adafactor, "
                "Muon) cannot update a slice: use an elementwise optimizer, or "
                "shard_parameters=False with tfdp.ShardedOptimizer.")
        return Kind.STATE
    if math.prod(shape) < max(1, min_elements):
        return None
    return Kind.PARAMETER


def size_threshold(min_elements: int, layout_shards=None):
    """The size threshold ``kind_of`` applies to a parameter, or None where the parameter is
    mirrored without evaluating its value.

    Args:
        min_elements: the strategy's ``shard_min_elements``.
        layout_shards: what keras.distribution's layout map says of this parameter (True:
            shard it, whatever its size; False: mirror it); None where no layout map decides
            (no ``ModelParallel``, or optimizer state, which follows its parameter).
    """
    if layout_shards is None:
        return min_elements
    return 0 if layout_shards else None
