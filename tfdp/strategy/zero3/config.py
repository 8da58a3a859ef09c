"""ZeRO-3's settings: one frozen, validated value per strategy.

Rule. ``DataParallelStrategy(shard_parameters=..., shard_min_elements=...,
reshard_after_forward=..., unit_layers=..., checkpoint_activations=...)`` is resolved once into a ``Zero3Config`` before
anything changes (a bad argument fails first, naming the fix); every ZeRO-3 mechanism reads
that value and nothing else: ``enabled`` says whether parameters are sharded at all,
``gathers_per_unit`` whether units re-gather their parameters in the backward pass. Pure: no
TensorFlow; Keras is imported only to check a class given in ``unit_layers``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Zero3Config", "DEFAULT_SHARD_MIN_ELEMENTS", "DISABLED", "resolve_unit_layers",
           "config_of"]

# Variables smaller than this stay mirrored: gathering a 1,000-element bias costs a collective
# round trip and saves a few kilobytes (DeepSpeed's stage3_param_persistence_threshold is 1e5).
DEFAULT_SHARD_MIN_ELEMENTS = 16384


def resolve_unit_layers(unit_layers) -> tuple:
    """``unit_layers`` as a tuple of Keras layer classes or class names; checked. Pure.

    Args:
        unit_layers: None, a class or class name, or an iterable of them.

    Raises:
        ValueError: an item is neither a Keras layer class nor a string.
    """
    if unit_layers is None:
        return ()
    if isinstance(unit_layers, (str, type)):
        unit_layers = (unit_layers,)
    out = []
    for item in unit_layers:
        if isinstance(item, str) or (isinstance(item, type) and _is_keras_layer_class(item)):
            out.append(item)
        else:
            raise ValueError(f"unit_layers: {item!r} is neither a Keras layer class nor a "
                             "class name; pass e.g. unit_layers=(TransformerBlock,) or "
                             "unit_layers=('TransformerBlock',).")
    return tuple(out)


def _is_keras_layer_class(cls) -> bool:
    # Keras only when a class is given, so that the rest of this module stays pure.
    import keras

    return issubclass(cls, keras.layers.Layer)


@dataclasses.dataclass(frozen=True)
class Zero3Config:
    """ZeRO-3's arguments of one strategy, checked in the order the constructor takes them.

    Attributes:
        shard_parameters: True: ZeRO stage 3 (the partition rule of partition.py applies).
        shard_min_elements: the partition rule's size threshold (None: the default, 16,384
            elements); checked even when sharding is off, as the constructor always did.
        reshard_after_forward: True: a unit's gathered parameters are freed after its forward
            pass and gathered again for its backward pass (units.py).
        unit_layers: layer classes or class names gathered as one unit each (a tuple after
            construction).
        checkpoint_activations: True: every unit recomputes its forward pass in its backward
            pass, keeping only its inputs (activation checkpointing per unit); False: a unit
            compiled by XLA keeps the activations its backward program reads (units_xla.py).
            Units without XLA always recompute.

    Raises:
        ValueError: an argument of the wrong type or range, naming it and the fix.
    """

    shard_parameters: bool = False
    shard_min_elements: int | None = None
    reshard_after_forward: bool = True
    unit_layers: tuple = ()
    checkpoint_activations: bool = False

    def __post_init__(self):
        if not isinstance(self.shard_parameters, bool):
            raise ValueError(f"shard_parameters={self.shard_parameters!r} must be True or "
                             "False.")
        minimum = self.shard_min_elements
        if minimum is None:
            minimum = DEFAULT_SHARD_MIN_ELEMENTS
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise ValueError(f"shard_min_elements={minimum!r} must be an integer "
                             ">= 0 (0 shards every trainable floating-point variable).")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r} must be "
                             "True or False.")
        if not isinstance(self.checkpoint_activations, bool):
            raise ValueError(f"checkpoint_activations={self.checkpoint_activations!r} must be "
                             "True or False.")
        # Frozen: the normalised values are written once, here.
        object.__setattr__(self, "shard_min_elements", minimum)
        object.__setattr__(self, "unit_layers", resolve_unit_layers(self.unit_layers))

    @property
    def enabled(self) -> bool:
        """Whether parameters are sharded at all (ZeRO-3 on)."""
        return self.shard_parameters

    @property
    def gathers_per_unit(self) -> bool:
        """Whether units gather their parameters for the forward pass and again for the
        backward pass (units.py; xla.py's plan ``"units"``)."""
        return self.shard_parameters and self.reshard_after_forward


DISABLED = Zero3Config()


def config_of(strategy) -> Zero3Config:
    """The ZeRO-3 settings of ``strategy`` (a tfdp strategy or its extended object);
    ``DISABLED`` for any other strategy, or None.

    Args:
        strategy: any object; tfdp's strategy and its extended object carry ``_tfdp_zero3``.
    """
    config = getattr(strategy, "_tfdp_zero3", None)
    return DISABLED if config is None else config
