"""Pieces shared by the layer-wise adaptive optimizers (LARS, LAMB).

Pure functions for the math, and a small mixin for what both optimizers do alike: their shared
options, their per-variable state (built and looked up as Keras's own optimizers do), and the
exclusion bookkeeping that Keras optimizers already do for weight decay. Keras's private
optimizer methods are reached through ``tfdp._tf_private`` only.
"""

from __future__ import annotations

import re

import tensorflow as tf
from keras import ops

from tfdp import _tf_private
from tfdp.strategy import collectives


def norm(x, of=None):
    """Euclidean norm of a whole tensor (the "layer" norm of LARS/LAMB).

    ``of``: the variable ``x`` belongs to (the variable itself, its gradient or its update).
    When it is a slice of a sharded parameter (``shard_parameters=True``), ``x`` is this
    replica's slice and the whole tensor's squared norm is the sum over replicas: one scalar
    all-reduce, so the trust ratio equals one device's.
    """
    squared = ops.sum(ops.square(x))
    if (of is not None and tf.distribute.get_replica_context() is not None
            and _tf_private.is_sharded_variable(of)):
        squared = collectives.all_reduce(squared)
    return ops.sqrt(squared)


def trust_ratio(numerator_norm, denominator, *, clip=None):
    """``numerator_norm / denominator``, 1 where either is 0, optionally clipped to ``clip``."""
    safe = ops.where(ops.greater(denominator, 0), denominator, ops.ones_like(denominator))
    ratio = ops.where(
        ops.logical_and(ops.greater(numerator_norm, 0), ops.greater(denominator, 0)),
        numerator_norm / safe, ops.ones_like(numerator_norm))
    if clip is not None:
        ratio = ops.minimum(ratio, ops.cast(clip, ratio.dtype))
    return ratio


def dense(gradient):
    """Sparse gradients (``tf.IndexedSlices`` from Embedding) as dense tensors.

    Layer-wise norms need the whole gradient, and momentum/second-moment buffers decay on
    every row, so the update touches every row anyway; duplicate indices are summed.
    """
    if isinstance(gradient, tf.IndexedSlices):
        # keras.ops.convert_to_tensor keeps IndexedSlices sparse; TensorFlow's conversion
        # scatters (and sums) them into the dense shape.
        return tf.convert_to_tensor(gradient)
    return gradient


class LayerAdaptationMixin:
    """The base LARS and LAMB share, before ``keras.optimizers.Optimizer`` in their bases.

    ``exclude_from_layer_adaptation`` has the semantics of ``exclude_from_weight_decay``:
    until it is called, the variables excluded from weight decay are also excluded from layer
    adaptation (unless ``always_adapt`` is set).

    A subclass names its per-variable state in ``_SLOTS``, pairs of (attribute, Keras variable
    name) such as ``(("_momentums", "momentum"),)``: ``build`` creates one list per pair with
    ``add_optimizer_variables`` (the variables, their names and their order are what Keras's
    own ``build`` of Adam or SGD would make), and ``_slots_for(variable)`` returns that
    variable's entries, in ``_SLOTS`` order.
    """

    _SLOTS: tuple[tuple[str, str], ...] = ()

    def _set_layerwise_options(self, epsilon, trust_ratio_clip, always_adapt):
        """Validates and stores the options LARS and LAMB share."""
        if epsilon < 0:
            raise ValueError(f"epsilon={epsilon} must be >= 0.")
        if trust_ratio_clip is not None and trust_ratio_clip <= 0:
            raise ValueError(f"trust_ratio_clip={trust_ratio_clip} must be positive or None.")
        self.epsilon = epsilon
        self.trust_ratio_clip = trust_ratio_clip
        self.always_adapt = always_adapt

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        attributes, names = zip(*self._SLOTS)
        slots = self.add_optimizer_variables(var_list, list(names))
        for attribute, variables in zip(attributes, slots):
            setattr(self, attribute, variables)

    def _slots_for(self, variable) -> tuple:
        """The per-variable state of ``variable`` (one entry per ``_SLOTS`` pair)."""
        index = _tf_private.variable_index(self, variable)
        return tuple(getattr(self, attribute)[index] for attribute, _ in self._SLOTS)

    def exclude_from_layer_adaptation(self, var_list=None, var_names=None):
        """Exclude variables from the trust ratio (they take plain, unscaled steps).

        Must be called before the optimizer is built.

        Args:
            var_list: variables to exclude.
            var_names: strings; a variable whose name contains any of them is excluded.
        """
        if getattr(self, "built", False):
            raise ValueError("exclude_from_layer_adaptation() can only be configured before "
                             "the optimizer is built.")
        self._adaptation_exclusions_set = True
        self._exclude_adaptation_ids = {_tf_private.variable_key(self, v)
                                        for v in (var_list or [])}
        self._exclude_adaptation_pattern = (
            re.compile("|".join(re.escape(n) for n in set(var_names))) if var_names else None)
        self.exclude_from_layer_adaptation_names = list(var_names or [])

    def _uses_layer_adaptation(self, variable) -> bool:
        if getattr(self, "_adaptation_exclusions_set", False):
            if _tf_private.variable_key(self, variable) in self._exclude_adaptation_ids:
                return False
            pattern = self._exclude_adaptation_pattern
            return pattern is None or re.search(pattern, variable.name) is None
        if self.always_adapt:
            return True
        return _tf_private.uses_weight_decay(self, variable)

    def _weight_decay_for(self, variable):
        if not self.weight_decay or not _tf_private.uses_weight_decay(self, variable):
            return None
        return ops.cast(self.weight_decay, variable.dtype)

    def _apply_weight_decay(self, variables):
        # Paper form: weight decay enters the update before the trust ratio (update_step),
        # not as Keras's decoupled decay of the variables. Overrides a private Keras hook,
        # pinned as _tf_private.LAYERWISE_HOOKS (tests/test_tf_private.py).
        return
