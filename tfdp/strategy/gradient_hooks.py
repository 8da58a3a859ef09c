"""tfdp's hooks in Keras's optimizer: gradients reduced before clipping, one overflow
decision for every replica, an optimizer built outside the traced step.

Rule. Under a tfdp strategy, in a replica context, Keras's ``_clip_gradients`` (called on every
real update, after gradient accumulation) first sums the gradients over all replicas
(collectives.all_reduce_gradients), and the later ``_all_reduce_sum_gradients`` passes them
through; under any other strategy, or none, Keras runs as it would without tfdp. Installed by
``keras_integration.require("gradients")``.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import collectives, is_data_parallel
from tfdp.strategy.zero3 import optimizer as zero3_optimizer

__all__ = ["install"]


def _tfdp_strategy_in_replica_context(optimizer):
    strategy = _tf_private.optimizer_strategy(optimizer)
    if not is_data_parallel(strategy):
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        return None
    return strategy


def _build_outside_the_step(optimizer, strategy, variables):
    """Builds ``optimizer`` for ``variables`` eagerly, in ``strategy``'s scope, from inside a
    traced replica step (``_tf_private.patch_keras_optimizer_apply`` says why): once, in
    cross-replica context (``merge_call``), out of the function being traced."""
    variables = list(variables)

    def build(_):
        if not optimizer.built:
            with tf.init_scope(), strategy.scope():
                optimizer.build(variables)

    tf.distribute.get_replica_context().merge_call(build)


def install():
    """Makes Keras reduce gradients *before* clipping under a tfdp strategy.

    Keras 3 clips (``clipnorm``, ``global_clipnorm``, ``clipvalue``) local gradients and
    only then all-reduces them, so distributed clipping differs from single-device
    clipping. Under a tfdp strategy the hooks reduce in ``_clip_gradients`` (which Keras
    calls on every real update, after gradient accumulation) and make the later
    ``_all_reduce_sum_gradients`` a pass-through. Under any other strategy Keras behaves
    exactly as before. ``LossScaleOptimizer.check_finite`` is made to agree across
    replicas, so one replica's overflow skips the step everywhere. Idempotent (the patches
    go through ``_tf_private``'s registry); installed by ``keras_integration.install``.
    """
    def make_clip_gradients(original_clip):
        def _clip_gradients(self, grads):
            strategy = _tfdp_strategy_in_replica_context(self)
            if strategy is None or getattr(self, "_tfdp_reduces_itself", False):
                return original_clip(self, grads)
            variables = _tf_private.applying_variables()
            sharded = ([_tf_private.is_sharded_variable(v) for v in variables]
                       if variables is not None and len(variables) == len(grads) else [])
            if not any(sharded):
                return original_clip(self, collectives.all_reduce_gradients(grads, strategy))
            # shard_parameters=True: a sharded parameter's gradient is its slice, reduced
            # already (reduce-scattered in the backward pass); norms span replicas.
            mirrored = [i for i, s in enumerate(sharded) if not s]
            reduced = collectives.all_reduce_gradients([grads[i] for i in mirrored], strategy)
            grads = list(grads)
            for i, g in zip(mirrored, reduced):
                grads[i] = g
            return zero3_optimizer.clip_gradients(self, grads, variables, original_clip)
        return _clip_gradients

    def make_apply_gradients(original_apply):
        def _backend_apply_gradients(self, grads, trainable_variables):
            if (_tfdp_strategy_in_replica_context(self) is not None
                    and any(_tf_private.is_sharded_variable(v) for v in trainable_variables)):
                zero3_optimizer.check_optimizer(self)
                # Last layers first: backprop produces their gradients first, and with
                # sharded variables updated one at a time (zero3/optimizer.py) each update
                # then runs, and frees its gradient, while backprop goes on. Keras finds a
                # variable's state by key, so the order changes no result.
                grads, trainable_variables = list(grads)[::-1], list(trainable_variables)[::-1]
            # The optimizer's step reads sharded parameters as this replica's slices
            # (shard_parameters=True: Keras's EMA update reads the model variables).
            with _tf_private.applying(trainable_variables), _tf_private.reading_slices():
                return original_apply(self, grads, trainable_variables)
        return _backend_apply_gradients

    def make_all_reduce_sum_gradients(original_all_reduce):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            if _tfdp_strategy_in_replica_context(self) is not None:
                return list(grads_and_vars)  # reduced in _clip_gradients already
            return original_all_reduce(self, grads_and_vars)
        return _all_reduce_sum_gradients

    def make_check_finite(original_check_finite):
        def check_finite(self, grads):
            finite = original_check_finite(self, grads)
            strategy = _tfdp_strategy_in_replica_context(self)
            if strategy is None:
                return finite
            bad = collectives.all_reduce(tf.cast(tf.logical_not(finite), tf.float32))
            return tf.equal(bad, 0.0)
        return check_finite

    _tf_private.patch_keras_gradient_reduction(make_clip_gradients,
                                               make_all_reduce_sum_gradients)
    def make_apply(original_apply):
        def apply(self, grads, trainable_variables=None):
            strategy = _tfdp_strategy_in_replica_context(self)
            if (strategy is not None and not self.built and trainable_variables is not None
                    and tf.inside_function()):
                _build_outside_the_step(self, strategy, trainable_variables)
            return original_apply(self, grads, trainable_variables)
        return apply

    _tf_private.patch_keras_apply_gradients(make_apply_gradients)
    _tf_private.patch_keras_optimizer_apply(make_apply)
    _tf_private.patch_loss_scale_check_finite(make_check_finite)
