"""Keras optimizer internals: the TensorFlow optimizer backend's state, hooks and class patches.

What lives here: the Keras classes tfdp patches so gradients are reduced before clipping and
overflow is agreed on (tfdp/strategy/collectives.py) and LossScaleOptimizer saves around a
ShardedOptimizer (tfdp/optimizers/sharded_state.py); the hooks ShardedOptimizer overrides and
the optimizer state it reads (tfdp/optimizers/sharded.py); and the per-variable bookkeeping
LARS and LAMB share with Keras's own optimizers (tfdp/optimizers/_layerwise.py). Each entry
says why no public API serves; tests/test_tf_private.py pins them.
"""

from __future__ import annotations

import threading

import keras

from tfdp._tf_private.core import get_private, patch_attribute, require_attributes

# Why: Keras 3 reduces gradients only inside the TensorFlow optimizer backend, *after*
# clipping them (so clipnorm/global_clipnorm act on local gradients). No public hook
# lets a strategy reduce earlier, so tfdp patches two methods of this class (see
# tfdp/strategy/gradient_hooks.py, install).
from keras.src.backend.tensorflow.optimizer import TFOptimizer

# Why: LossScaleOptimizer decides "finite or not" from replica 0's local gradients; tfdp
# patches check_finite to agree across all replicas (see collectives.py).
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer


# --- Hooks tfdp's optimizers override (sharded.py, _layerwise.py) ---------------------------

# Why: ShardedOptimizer (a keras.optimizers.Optimizer subclass) replaces these steps of Keras's
# apply(): the per-call body (reduce-scatter, owned update, all-gather), the clipping and the
# weight decay (both act on the reduced, owned gradients instead), and looks variables up with
# Keras's own index. Keras documents none of them as overridable.
OPTIMIZER_HOOKS = ("_backend_apply_gradients", "_clip_gradients", "_apply_weight_decay",
                   "_use_weight_decay", "_get_variable_index", "_var_key")
require_attributes(TFOptimizer, OPTIMIZER_HOOKS, "hooks ShardedOptimizer overrides or calls")

# Why: LARS and LAMB apply weight decay inside their update, before the trust ratio, as the
# papers do. Keras's apply() first decays the variables itself (decoupled) through this
# method and has no option to skip it, so both override it with a no-op
# (_layerwise.LayerAdaptationMixin); has_own_weight_decay below tells them apart.
LAYERWISE_HOOKS = ("_apply_weight_decay",)
require_attributes(TFOptimizer, LAYERWISE_HOOKS, "hooks LARS and LAMB override")


# --- Optimizer state (sharded.py, sharded_state.py) ----------------------------------------

def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras optimizer was created under.

    Why: Keras's TensorFlow optimizer captures it at construction and has no public getter;
    ``tf.distribute.get_strategy()`` at call time may be another (or none).
    """
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_step_counter(optimizer):
    """The optimizer's call counter (micro-batches with gradient accumulation).

    Why: the public ``iterations`` is ``floor(counter / k)`` with ``gradient_accumulation_steps
    = k``; ShardedOptimizer advances and reads the raw counter as Keras's apply does.
    """
    return get_private(optimizer, "_iterations", "the micro-batch counter")


def optimizer_own_variables(optimizer) -> list:
    """The list of variables a Keras optimizer saves by position (``save_own_variables``).

    Why: ``variables`` is a read-only copy; ShardedOptimizer removes the wrapped optimizer's
    sharded slots from what it saves by position (it saves them consolidated itself).
    """
    return get_private(optimizer, "_variables", "the variables an optimizer saves")


def set_optimizer_own_variables(optimizer, variables) -> None:
    get_private(optimizer, "_variables", "the variables an optimizer saves")
    optimizer._variables = list(variables)


def gradient_accumulators(optimizer) -> list:
    """The accumulators of ``gradient_accumulation_steps``, one per model variable, in the
    model variables' order. Why: no public getter."""
    return get_private(optimizer, "_accumulated_gradients", "gradient accumulators")


def moving_averages(optimizer) -> list:
    """The EMA copies of ``use_ema=True``, one per model variable (None where not averaged).
    Why: no public getter."""
    return get_private(optimizer, "_model_variables_moving_average", "EMA copies")


# --- What ShardedOptimizer needs to know about a wrapped optimizer (sharded.py, sharded_state.py)

# Why: ShardedOptimizer drives the wrapped optimizer through update_step, one owned variable
# at a time. A class that replaces one of these whole-step methods works on all variables at
# once (or sends them elsewhere: MultiOptimizer's apply dispatches to sub-optimizers), which
# cannot be split by owner. Keras documents none of them as overridable; only comparing the
# class's methods with Keras's tells.
WHOLE_STEP_METHODS = ("apply", "apply_gradients", "_backend_apply_gradients",
                      "_backend_update_step")
require_attributes(TFOptimizer, WHOLE_STEP_METHODS, "the steps ShardedOptimizer replaces")


def overridden_step_methods(optimizer) -> list:
    """The names of ``WHOLE_STEP_METHODS`` the optimizer's class defines anew."""
    base = keras.optimizers.Optimizer
    return [name for name in WHOLE_STEP_METHODS
            if getattr(type(optimizer), name) is not getattr(base, name)]


# Why: Keras's Nadam advances a running product (``_u_product``, one scalar for all variables)
# once per update in _backend_update_step, then runs Keras's per-variable loop. ShardedOptimizer
# calls update_step itself, so the product would stay 1.0 and every update divide by zero (NaN,
# measured). Run with no variables, that method does exactly the once-per-update part. No
# public hook advances it.
SHARED_STATE_STEPS = (keras.optimizers.Nadam._backend_update_step,)


def advances_shared_state(optimizer) -> bool:
    """True when the class's _backend_update_step only advances state shared by all
    variables once per update before Keras's per-variable loop (Keras's Nadam)."""
    return type(optimizer)._backend_update_step in SHARED_STATE_STEPS


def advance_shared_state(optimizer, learning_rate) -> None:
    """Runs the once-per-update part of such an optimizer's step (no variables updated)."""
    optimizer._backend_update_step([], [], learning_rate)


def optimizer_state_lists(optimizer) -> dict:
    """The optimizer's list attributes by name, but for Keras's own ``_variables`` and
    ``_trainable_variables``.

    Why: Keras optimizers keep per-variable state in lists indexed like the variables they
    were built with (update_step reads ``self._r[self._get_variable_index(variable)]``); that
    position is the only record of which model variable a state variable made by
    ``add_variable`` (Adafactor's factored moments) belongs to. No public API lists them.
    """
    skip = {"_variables", "_trainable_variables"}
    return {name: value for name, value in vars(optimizer).items()
            if isinstance(value, (list, tuple)) and name not in skip
            and not name.startswith("_self_")}


def replace_variable_storage(variable, storage) -> None:
    """Makes the Keras ``variable`` read and write the tf.Variable ``storage`` from now on.

    Why: ShardedOptimizer moves state the wrapped optimizer made with ``add_variable`` (on
    every replica) to its owner's device. The optimizer holds the Keras variable in its own
    lists, attributes and ``_variables``; replacing what the variable wraps moves it without
    touching those. Keras's TensorFlow Variable keeps it in ``_value`` (its ``_initialize``
    takes a tf.Variable the same way); no public API re-homes a variable.
    """
    get_private(variable, "_value", "the tf.Variable a Keras variable wraps")
    variable._value = storage


# --- Per-variable bookkeeping (sharded.py, _layerwise.py) ----------------------------------

def has_own_weight_decay(optimizer) -> bool:
    """True when the optimizer's class replaces Keras's decoupled weight decay (LARS/LAMB
    apply theirs inside the update). Why: only the overridden method tells."""
    return type(optimizer)._apply_weight_decay is not TFOptimizer._apply_weight_decay


# Why (the four below): a Keras optimizer keeps its slots in lists indexed like the variables
# it was built with, and its weight-decay exclusions by variable identity and name; the public
# API has neither a lookup of a variable's index or key nor the exclusion test. ShardedOptimizer
# and LARS/LAMB (keras.optimizers.Optimizer subclasses) use Keras's own, as Keras's optimizers
# do in their update_step.

def apply_weight_decay(optimizer, variables) -> None:
    """The optimizer's own weight-decay step on ``variables`` (Keras calls it before updates)."""
    optimizer._apply_weight_decay(variables)


def uses_weight_decay(optimizer, variable) -> bool:
    """Keras's exclusion rule (``exclude_from_weight_decay``) for one variable."""
    return bool(optimizer._use_weight_decay(variable))


def variable_index(optimizer, variable) -> int:
    """Index of a model variable among those the optimizer was built with (Keras's key)."""
    return optimizer._get_variable_index(variable)


def variable_key(optimizer, variable):
    """Keras's identity for a model variable inside an optimizer (stable across replicas)."""
    return optimizer._var_key(variable)


# Why: ShardedOptimizer clips the reduced gradients of the variables a replica owns and must
# clip them exactly as Keras does on one device: ``clipnorm`` by Keras's ``_clip_by_norm``
# (which makes a sparse gradient dense) and ``clipvalue`` by ``ops.clip``. The wrapped
# optimizer's ``_clip_gradients`` is tfdp's patch (it would reduce again); Keras's own step is
# the base class's, which nothing patches. No public API clips without applying.
from keras.src.optimizers.base_optimizer import BaseOptimizer as _KerasBase  # noqa: E402 (beside the why above)

require_attributes(_KerasBase, ("_clip_gradients", "_clip_by_norm"),
                   "Keras's own clipping, for ShardedOptimizer's owned gradients")


def keras_clip_gradients(optimizer, grads) -> list:
    """Keras's own clipping step of ``optimizer`` (``clipnorm``, ``global_clipnorm`` or
    ``clipvalue`` as Keras computes them on these gradients), without tfdp's reduction."""
    return list(_KerasBase._clip_gradients(optimizer, grads))


# --- Class patches (collectives.py, sharded_state.py) --------------------------------------

def patch_keras_gradient_reduction(make_clip_gradients, make_all_reduce_sum_gradients) -> None:
    """Class patch of Keras's TensorFlow optimizer: ``make_*(original) -> replacement``.

    Why: Keras 3 reduces gradients in ``_all_reduce_sum_gradients`` only after clipping them in
    ``_clip_gradients``, so clipnorm/global_clipnorm act on local gradients. No public hook
    lets a strategy reduce first; tfdp reduces in the clip step and makes the later
    all-reduce a pass-through (gradient_hooks.install).
    """
    patch_attribute(TFOptimizer, "_clip_gradients", make_clip_gradients, "reducing before clipping")
    patch_attribute(TFOptimizer, "_all_reduce_sum_gradients", make_all_reduce_sum_gradients,
           "skipping Keras's own all-reduce")


def patch_loss_scale_check_finite(make) -> None:
    """Class patch of LossScaleOptimizer.check_finite. Why: it decides from this replica's
    gradients only; tfdp makes every replica agree (collectives.py). No public hook."""
    patch_attribute(LossScaleOptimizer, "check_finite", make,
                    "agreeing on overflow across replicas")


def patch_loss_scale_saving(make_save, make_load) -> None:
    """Class patch of LossScaleOptimizer.save_own_variables/load_own_variables.

    Why: it saves every variable of the wrapped optimizer by position too; around a
    ShardedOptimizer that list depends on the topology (sharding.py). Keras's class has no
    hook to save only its own variables.
    """
    patch_attribute(LossScaleOptimizer, "save_own_variables", make_save,
                    "saving around ShardedOptimizer")
    patch_attribute(LossScaleOptimizer, "load_own_variables", make_load,
                    "loading around ShardedOptimizer")


# --- Which variables a step updates (sharded parameters, strategy/zero3/optimizer.py) -----
_applying = threading.local()


def patch_keras_apply_gradients(make) -> None:
    """Class patch of Keras's ``_backend_apply_gradients``: ``make(original) -> replacement``.

    Why: Keras's ``_clip_gradients(grads)``, where tfdp reduces and clips, is not told which
    variables the gradients belong to, and with ``shard_parameters=True`` a sharded
    parameter's gradient is reduced already and its norm is spread over replicas. The caller
    one level up has both; no public hook passes the variables down.
    """
    patch_attribute(TFOptimizer, "_backend_apply_gradients", make,
                    "knowing the variables being updated")


def patch_keras_optimizer_apply(make) -> None:
    """Class patch of Keras's ``apply`` (TensorFlow backend): ``make(original) -> replacement``.

    Why: ``apply`` builds an unbuilt optimizer where it is first called. In the tf.distribute
    custom-loop idiom (``strategy.run(step)`` inside a ``tf.function``, ``step`` ending with
    ``optimizer.apply``) that is inside the traced function, and TensorFlow's conditional
    initialisation of variables created there fails under any multi-replica strategy
    (MirroredStrategy too) with "You must feed a value for placeholder tensor ...". tfdp
    builds the optimizer outside the function first; no public hook runs before the build.
    """
    patch_attribute(TFOptimizer, "apply", make, "building an optimizer outside a traced step")


def applying_variables():
    """The variables of the ``_backend_apply_gradients`` running in this thread, or None."""
    return getattr(_applying, "variables", None)


class applying(object):  # a context manager
    """``with applying(variables):`` around Keras's ``_backend_apply_gradients``."""

    def __init__(self, variables):
        self._variables = list(variables)

    def __enter__(self):
        self._outer = getattr(_applying, "variables", None)
        _applying.variables = self._variables

    def __exit__(self, *exc):
        _applying.variables = self._outer


def patch_keras_moving_average_update(make) -> None:
    """Class patch of Keras's ``_update_model_variables_moving_average`` (``use_ema=True``).

    Why: it assigns through the Keras variable, whose shape check wants the whole tensor,
    while with ``shard_parameters=True`` a replica updates only its slice of the average.
    No public hook; tfdp's replacement does the same arithmetic on the slices
    (strategy/zero3/optimizer.py).
    """
    patch_attribute(TFOptimizer, "_update_model_variables_moving_average", make,
           "updating sharded moving averages")
