"""Every TensorFlow- and Keras-private symbol tfdp touches, in one place.

A TensorFlow or Keras upgrade that moves one of these breaks here, and
``tests/test_tf_private.py`` pins each one, so the failure names the symbol instead of
surfacing as a confusing error deep inside training.

Each entry says why no public API serves. The chief-writes half (Keras saving, TensorBoard,
checkpoints) lives in ``_tf_private_saving.py`` and is re-exported here: callers use this module.
"""

from __future__ import annotations

# --- TensorFlow -------------------------------------------------------------------------

# Why: tf.distribute has no public way to build a Strategy with a custom extended object.
# CollectiveAllReduceExtended is the engine under MultiWorkerMirroredStrategy: it mirrors
# variables over local devices and spans workers with TensorFlow's collective runtime over
# gRPC. tfdp subclasses it to choose the local devices (logical CPUs per worker, which the
# stock class never uses) and its communication options.
from tensorflow.python.distribute.collective_all_reduce_strategy import (  # noqa: E402
    CollectiveAllReduceExtended,
)

# Why: the public MultiWorkerMirroredStrategy constructor always builds its own extended
# object from TF_CONFIG; tfdp calls the base Strategy constructor with its own extended.
from tensorflow.python.distribute.distribute_lib import Strategy as StrategyBase  # noqa: E402

# Why: the per-replica values Keras hands to Strategy.reduce are instances of this class;
# there is no public isinstance check for "PerReplica".
from tensorflow.python.distribute.values import DistributedValues  # noqa: E402


# --- Keras ------------------------------------------------------------------------------

# Why: Keras 3 reduces gradients only inside the TensorFlow optimizer backend, *after*
# clipping them (so clipnorm/global_clipnorm act on local gradients). No public hook
# lets a strategy reduce earlier, so tfdp patches two methods of this class (see
# tfdp/collectives.py, install_keras_gradient_hooks).
from keras.src.backend.tensorflow.optimizer import TFOptimizer  # noqa: E402

# Why: LossScaleOptimizer decides "finite or not" from replica 0's local gradients; tfdp
# patches check_finite to agree across all replicas (see collectives.py).
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer  # noqa: E402


__all__ = [
    "CollectiveAllReduceExtended",
    "StrategyBase",
    "DistributedValues",
    "TFOptimizer",
    "LossScaleOptimizer",
]


def set_distributed_dataset_cardinality(distributed_dataset, steps: int) -> None:
    """Makes ``distributed_dataset.cardinality`` the number of global steps per epoch.

    Why: for ``distribute_datasets_from_function`` TensorFlow reports the cardinality of
    one worker's dataset (per-replica batches), which Keras reads as steps per epoch; it
    then keeps stepping past the end, and TensorFlow's partial-batch handling feeds one
    extra step of empty dummy batches, which still moves momentum/Adam state and the
    iteration counter. No public API sets the cardinality of a distributed dataset.
    """
    distributed_dataset._cardinality = steps  # noqa: SLF001


def skip_end_of_data_agreement(distributed_dataset) -> bool:
    """Makes the iterators of ``distributed_dataset`` take batches without the workers'
    end-of-data agreement; returns False (and changes nothing) for objects without it.

    Why: in multi-worker mode TensorFlow's distributed iterator all-reduces, on every
    ``get_next``, how many replicas still have data (``_calculate_replicas_with_values``),
    unless the per-worker dataset is infinite: one cross-worker collective per step. tfdp.data
    turns it off only where every worker's pipeline yields exactly the same number of
    batches (tfdp/data/pipeline.py), so the workers run out together without agreeing. No
    public API turns the agreement off for a finite dataset.
    """
    if not hasattr(distributed_dataset, "_enable_get_next_as_optional"):
        return False
    distributed_dataset._enable_get_next_as_optional = False  # noqa: SLF001
    return True


def end_of_data_agreement(distributed_dataset) -> bool | None:
    """Whether iterators of ``distributed_dataset`` run TensorFlow's partial-batch handling
    (in multi-worker mode: the per-step end-of-data all-reduce); None when not applicable."""
    return getattr(distributed_dataset, "_enable_get_next_as_optional", None)


# Why: MirroredStrategy creates a plain (non-mirrored) variable on one device when the
# creator's colocate_with is a SingleDevice; ShardedOptimizer uses this to place each
# partition's optimizer state on its owner's device only. No public API creates a
# single-device variable inside a strategy scope.
from tensorflow.python.distribute.numpy_dataset import SingleDevice  # noqa: E402

# Why: TensorFlow exposes no all-to-all on ReplicaContext, and its reduce-scatter op has
# no CPU kernel. The op must use the strategy's own collective launcher's group key,
# instance keys and ordering token so it never clashes with TensorFlow's collectives.
from tensorflow.python.ops import collective_ops as _collective_ops  # noqa: E402


def all_to_all(launcher, value, options):
    """``t[i]`` goes to group rank i: CollectiveAllToAllV2 with ``launcher``'s keys."""
    import tensorflow as tf

    with tf.device(launcher._device):  # noqa: SLF001
        return _collective_ops.all_to_all_v2(
            value, launcher._group_size, launcher._group_key,  # noqa: SLF001
            launcher._next_instance_key(),  # noqa: SLF001
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())  # noqa: SLF001


def collective_launchers(extended):
    """The per-local-device collective launchers of a collective strategy's extended."""
    return extended._cross_device_ops._launchers  # noqa: SLF001


def all_gather(launcher, value, options):
    """Concatenation of ``value`` from every group rank along axis 0.

    Why: ReplicaContext.all_gather always goes through merge_call, which cannot run inside
    tf.cond (LossScaleOptimizer applies the inner optimizer inside one); the launcher's
    own all-gather launches the collective directly in the replica.
    """
    return launcher._all_gather(value, options)  # noqa: SLF001


def local_replica_id(replica_context) -> int:
    """The replica's index among this worker's devices, as a Python int.

    Why: ``replica_id_in_sync_group`` is a tensor inside tf.function and
    ``ReplicaContext.devices`` is empty in multi-worker mode; ShardedOptimizer needs a
    trace-time integer to know which partition this replica updates. TensorFlow indexes its
    own collective launchers with this attribute.
    """
    return replica_context._replica_id  # noqa: SLF001


# Why: tfdp refuses XLA compilation of a multi-replica CPU step with a clear message (see
# strategy.py, DataParallelStrategy.run). tf.function(jit_compile=True) marks the graph it
# traces with an XLA control-flow context; TensorFlow's own strategies read it through this
# function (mirrored_strategy._use_merge_call). No public API says "this trace is XLA".
from tensorflow.python.ops.control_flow_util import (  # noqa: E402
    GraphOrParentsInXlaContext as _graph_or_parents_in_xla_context,
)


def in_xla_context(graph) -> bool:
    """True while tracing ``graph`` (or a graph it is nested in) for XLA compilation."""
    return bool(_graph_or_parents_in_xla_context(graph))


# Why: StragglerMonitor times every collective of a training step (when its input is ready,
# when its result is), so that time spent waiting for the other workers is told apart from a
# worker's own time wherever the collective comes from: the gradient reduction, the input
# pipeline's end-of-data agreement, Keras's metric reduction, ShardedOptimizer's all-to-all.
# TensorFlow's collective launchers (cross_device_utils.CollectiveReplicaLauncher) and tfdp's
# all_to_all above build every collective by calling these functions of the private
# collective_ops module, looked up at call time; no public hook observes a collective.
COLLECTIVE_OP_FUNCTIONS = ("all_reduce_v2", "all_gather_v2", "all_to_all_v2")


def run_independently(op) -> None:
    """Exempts ``op`` (stateful, no resource inputs) from tf.function's program-order chain.

    Why: tf.function's automatic control dependencies chain every stateful op without
    resource inputs in creation order, across replicas (auto_control_deps.py,
    ``last_write_to_resource[None]``). A timestamp after replica 0's collective would then
    precede replica 1's timestamp before the same collective: a deadlock with two or more
    local replicas. The graph's ``experimental_acd_manager`` (None outside tf.function's
    tracing) offers ``run_independently``: the op still runs before the function returns,
    in parallel with the rest. No public API marks an op order-independent.
    """
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is not None:
        _get(manager, "run_independently", "timing collectives (StragglerMonitor)")(op)


def patch_collective_ops(make) -> None:
    """Replaces each of ``COLLECTIVE_OP_FUNCTIONS`` by ``make(original)`` once (same
    signature: the tensor first)."""
    for name in COLLECTIVE_OP_FUNCTIONS:
        _patch(_collective_ops, name, make, "timing collectives (StragglerMonitor)")


# Why: tfdp builds each epoch's pipeline inside a tf.data function of its own (the per-iterator
# ``flat_map`` of tfdp/data/pipeline.py), which it marks with the public ``do_not_convert``:
# AutoGraph's conversion of tfdp's own pipeline code cost 0.7 s of ``distribute()``'s 0.8 s on
# this host (cProfile), and that code has no tensor-dependent Python control flow. But the mark
# holds for every function traced beneath it, so a user's ``Files`` parse function or reader
# would lose AutoGraph (a Python ``if`` on a tensor would fail) where the same function passed
# to ``Dataset.map`` is converted. Public APIs only turn conversion off; turning it back on for
# the user's function needs AutoGraph's control-status context.
from tensorflow.python.autograph.core import ag_ctx as _ag_ctx  # noqa: E402
from tensorflow.python.autograph.impl import api as _autograph_api  # noqa: E402


def autograph_user_function(fn):
    """``fn`` as tf.data traces a user's function (AutoGraph on, recursively), also under a
    ``do_not_convert`` function of tfdp's; ``None`` stays ``None``."""
    if fn is None:
        return None

    def converted(*args, **kwargs):
        enabled = _ag_ctx.ControlStatusCtx(status=_ag_ctx.Status.ENABLED)
        return _autograph_api.tf_convert(fn, enabled)(*args, **kwargs)

    return converted


# --- How a moved private name fails --------------------------------------------------------
# Every private attribute and class patch below goes through _get / require_attributes /
# _patch, so a TensorFlow or Keras upgrade that renames one fails with PrivateAPIError naming
# the attribute and what tfdp used it for, at the first use (import time for class hooks).

class PrivateAPIError(AttributeError):
    """A TensorFlow/Keras private name tfdp relies on is missing in the installed version."""


def _versions() -> str:
    import keras
    import tensorflow as tf

    return f"TensorFlow {tf.__version__} / Keras {keras.__version__}"


def _missing(owner, name, used_for) -> PrivateAPIError:
    where = owner if isinstance(owner, str) else getattr(owner, "__qualname__", repr(owner))
    return PrivateAPIError(
        f"tfdp relies on the private {where}.{name} ({used_for}), which the installed "
        f"{_versions()} does not have: this version moved or renamed it. Install the "
        "TensorFlow and Keras versions tfdp supports (setup.cfg's install_requires), or a "
        "tfdp release made for yours; tfdp/_tf_private.py is the one place to adapt.")


def _get(obj, name, used_for):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(type(obj).__qualname__, name, used_for) from None


def require_attributes(owner, names, used_for) -> None:
    """Raises PrivateAPIError naming the first of ``names`` the class ``owner`` lacks."""
    for name in names:
        if not hasattr(owner, name):
            raise _missing(owner, name, used_for)


def _patch(cls, name, make, used_for):
    """Replaces ``cls.name`` by ``make(original)`` once; returns the original."""
    current = getattr(cls, name, None)
    if current is None:
        raise _missing(cls, name, used_for)
    if getattr(current, "_tfdp_patch", False):
        return current.__wrapped__
    replacement = make(current)
    replacement._tfdp_patch = True
    replacement.__wrapped__ = current
    setattr(cls, name, replacement)
    return current


# --- tf.distribute internals (strategy.py, collectives.py) ---------------------------------

# Why: tfdp's extended object (strategy.py, _DataParallelExtended) overrides these hooks of
# CollectiveAllReduceExtended: which local devices are replicas, merge-call-free collectives,
# variable creation (ONLY_FIRST_REPLICA counters), and the two reduction entry points (to cast
# dtypes TensorFlow's collectives cannot sum). tf.distribute has no public extension points.
EXTENDED_HOOKS = ("_initialize_local_devices", "_use_merge_call", "_create_variable",
                  "_reduce_to", "_replica_ctx_all_reduce")
require_attributes(CollectiveAllReduceExtended, EXTENDED_HOOKS,
                   "hooks tfdp's DataParallelStrategy overrides")


def set_collective_key_base(strategy, base: int) -> None:
    """Where this strategy's collective group/instance keys start.

    Why: CollectiveAllReduceExtended reads the container strategy's ``_collective_key_base``
    when it builds its key allocator; TensorFlow's own strategies all start at 0, so two in
    one process clash. No public argument sets it.
    """
    strategy._collective_key_base = base  # noqa: SLF001


def extended_num_workers(extended) -> int:
    """Workers of a collective strategy's extended object. Why: no public attribute;
    ``num_replicas_in_sync`` counts local devices too."""
    return _get(extended, "_num_workers", "counting workers")


def communication_options(extended):
    """The ``CommunicationOptions`` a collective strategy was built with.

    Why: no public getter; tfdp's own collectives (buckets, all-to-all) reuse its timeout and
    implementation. The object is shared with the strategy's collective launchers, so setting
    its ``implementation`` before the first collective switches all of them (the shared-GPU
    fallback to ring does so).
    """
    return _get(extended, "_communication_options", "collective timeout and implementation")


def map_distributed(fn, value):
    """``fn`` applied to each component of a PerReplica/Mirrored value, on its device; a
    plain tensor gets ``fn`` directly.

    Why: casting every replica's component (dtypes collectives cannot reduce) needs a new
    value of the same kind; the public API builds PerReplica values only from datasets or
    from ``strategy.run``, which cannot be called inside a reduction.
    """
    import tensorflow as tf

    if not isinstance(value, DistributedValues):
        return fn(value)
    parts = []
    for component in value.values:
        with tf.device(component.device):
            parts.append(fn(component))
    return type(value)(tuple(parts))


# --- Keras optimizer internals (sharding.py, collectives.py) -------------------------------

# Why: ShardedOptimizer (a keras.optimizers.Optimizer subclass) replaces these steps of Keras's
# apply(): the per-call body (reduce-scatter, owned update, all-gather), the clipping and the
# weight decay (both act on the reduced, owned gradients instead), and looks variables up with
# Keras's own index. Keras documents none of them as overridable.
OPTIMIZER_HOOKS = ("_backend_apply_gradients", "_clip_gradients", "_apply_weight_decay",
                   "_use_weight_decay", "_get_variable_index", "_var_key")
require_attributes(TFOptimizer, OPTIMIZER_HOOKS, "hooks ShardedOptimizer overrides or calls")


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
    return _get(optimizer, "_iterations", "the micro-batch counter")


def optimizer_own_variables(optimizer) -> list:
    """The list of variables a Keras optimizer saves by position (``save_own_variables``).

    Why: ``variables`` is a read-only copy; ShardedOptimizer removes the wrapped optimizer's
    sharded slots from what it saves by position (it saves them consolidated itself).
    """
    return _get(optimizer, "_variables", "the variables an optimizer saves")


def set_optimizer_own_variables(optimizer, variables) -> None:
    _get(optimizer, "_variables", "the variables an optimizer saves")
    optimizer._variables = list(variables)  # noqa: SLF001


def gradient_accumulators(optimizer) -> list:
    """The accumulators of ``gradient_accumulation_steps``, one per model variable, in the
    model variables' order. Why: no public getter."""
    return _get(optimizer, "_accumulated_gradients", "gradient accumulators")


def moving_averages(optimizer) -> list:
    """The EMA copies of ``use_ema=True``, one per model variable (None where not averaged).
    Why: no public getter."""
    return _get(optimizer, "_model_variables_moving_average", "EMA copies")


def has_own_weight_decay(optimizer) -> bool:
    """True when the optimizer's class replaces Keras's decoupled weight decay (LARS/LAMB
    apply theirs inside the update). Why: only the overridden method tells."""
    return type(optimizer)._apply_weight_decay is not TFOptimizer._apply_weight_decay  # noqa: SLF001


def apply_weight_decay(optimizer, variables) -> None:
    """The optimizer's own weight-decay step on ``variables`` (Keras calls it before updates)."""
    optimizer._apply_weight_decay(variables)  # noqa: SLF001


def uses_weight_decay(optimizer, variable) -> bool:
    """Keras's exclusion rule (``exclude_from_weight_decay``) for one variable."""
    return bool(optimizer._use_weight_decay(variable))  # noqa: SLF001


def variable_index(optimizer, variable) -> int:
    """Index of a model variable among those the optimizer was built with (Keras's key)."""
    return optimizer._get_variable_index(variable)  # noqa: SLF001


def variable_key(optimizer, variable):
    """Keras's identity for a model variable inside an optimizer (stable across replicas)."""
    return optimizer._var_key(variable)  # noqa: SLF001


def patch_keras_gradient_reduction(make_clip_gradients, make_all_reduce_sum_gradients) -> None:
    """Class patch of Keras's TensorFlow optimizer: ``make_*(original) -> replacement``.

    Why: Keras 3 reduces gradients in ``_all_reduce_sum_gradients`` only after clipping them in
    ``_clip_gradients``, so clipnorm/global_clipnorm act on local gradients. No public hook
    lets a strategy reduce first; tfdp reduces in the clip step and makes the later
    all-reduce a pass-through (collectives.install_keras_gradient_hooks).
    """
    _patch(TFOptimizer, "_clip_gradients", make_clip_gradients, "reducing before clipping")
    _patch(TFOptimizer, "_all_reduce_sum_gradients", make_all_reduce_sum_gradients,
           "skipping Keras's own all-reduce")


def patch_loss_scale_check_finite(make) -> None:
    """Class patch of LossScaleOptimizer.check_finite. Why: it decides from this replica's
    gradients only; tfdp makes every replica agree (collectives.py). No public hook."""
    _patch(LossScaleOptimizer, "check_finite", make, "agreeing on overflow across replicas")


def patch_loss_scale_saving(make_save, make_load) -> None:
    """Class patch of LossScaleOptimizer.save_own_variables/load_own_variables.

    Why: it saves every variable of the wrapped optimizer by position too; around a
    ShardedOptimizer that list depends on the topology (sharding.py). Keras's class has no
    hook to save only its own variables.
    """
    _patch(LossScaleOptimizer, "save_own_variables", make_save, "saving around ShardedOptimizer")
    _patch(LossScaleOptimizer, "load_own_variables", make_load, "loading around ShardedOptimizer")


# --- Keras trainer internals (xla.py) --------------------------------------------------------

def _keras_trainer_classes():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers.trainer import Trainer

    return Trainer, TensorFlowTrainer


def patch_keras_auto_jit_compile(make) -> None:
    """Class patch of ``Trainer._resolve_auto_jit_compile`` (what ``jit_compile="auto"`` means).

    Why: Keras resolves "auto" to False under any tf.distribute strategy; tfdp resolves it as
    Keras would on one device (xla.resolve_auto_jit_compile). ``compile`` has no hook for it.
    """
    trainer, _ = _keras_trainer_classes()
    _patch(trainer, "_resolve_auto_jit_compile", make, "jit_compile='auto' under tfdp")


def patch_keras_step_functions(make_train, make_test) -> None:
    """Class patch of ``make_train_function`` / ``make_test_function`` (Keras's TF trainer).

    Why: with ``jit_compile=True`` Keras compiles the whole distributed step, collectives
    included, which XLA cannot do across CPU replicas nor for several GPUs in one process.
    tfdp builds the step itself (xla.py): per-replica compiled forward/backward, reduction and
    update outside. Keras has no public hook for the step function it builds.
    """
    _, tf_trainer = _keras_trainer_classes()
    _patch(tf_trainer, "make_train_function", make_train, "tfdp's XLA train step")
    _patch(tf_trainer, "make_test_function", make_test, "tfdp's XLA test step")


def keras_make_step_function(model, step_function):
    """Keras's own wrapping of a per-replica step (strategy.run, output reduction, the
    steps_per_execution loop, tf.function). Why: only ``_make_function`` builds it."""
    return _get(model, "_make_function", "building a step function")(step_function)


def keras_model_supports_jit(model) -> bool:
    """Keras's own test (every layer XLA-capable, op determinism off, not a Mac GPU).
    Why: a private function of keras.src.trainers.trainer, used by "auto"."""
    from keras.src.trainers.trainer import model_supports_jit

    return bool(model_supports_jit(model))


def keras_compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """The loss exactly as Keras's train_step computes it (``compute_loss`` overrides with or
    without a ``training`` argument, regularisation losses). Why: only ``_compute_loss``
    handles both override signatures."""
    return _get(model, "_compute_loss", "the train step's loss")(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def keras_call_has_training_arg(model) -> bool:
    """Whether the model's ``call`` takes ``training`` (Keras's train_step passes it only
    then). Why: Keras records it in a private attribute; re-inspecting the signature could
    disagree with Keras for wrapped calls."""
    return bool(_get(model, "_call_has_training_arg", "calling the model as Keras does"))


def keras_loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` log. Why: no public getter."""
    return _get(model, "_loss_tracker", "the loss metric")


def unscale_loss_for_distribution(value):
    """Keras's undo of its 1/num_replicas loss scaling, for the loss metric. Why: a function
    of the private keras.src.losses.loss module."""
    from keras.src.losses.loss import unscale_loss_for_distribution as unscale

    return unscale(value)


# Why: the shared-GPU check of a multi-worker job (devices.py) needs every worker's host and
# GPUs before the first collective. The coordination service every worker already talks to
# has a key-value store (TensorFlow's preemption handling uses it); tf.distribute exposes no
# public exchange outside collectives, which would themselves fail on a shared GPU.
def publish_to_coordination_service(key: str, value: str) -> None:
    _eager_context.context().set_config_key_value(key, value)


def read_from_coordination_service(key: str, timeout_seconds: float) -> str:
    """Blocks until ``key`` is set (at most ``timeout_seconds``; then a tf.errors.OpError)."""
    return _eager_context.context().get_config_key_value(
        key, max(1, int(timeout_seconds * 1000)))


# Why: the orderly exit of a multi-worker job (strategy.py, "Orderly exit") waits at a
# barrier of TensorFlow's coordination service, the service MultiWorkerMirroredStrategy's
# engine starts on the chief for heartbeats and errors. TensorFlow exposes it only on the
# eager context (tf.experimental.dtensor's barrier uses the same call); there is no public
# barrier or shutdown for it.
from tensorflow.python.eager import context as _eager_context  # noqa: E402


def coordination_service_configured() -> bool:
    """True when this process takes part in a coordination service (multi-worker)."""
    return _eager_context.context().coordination_service is not None


def wait_at_coordination_barrier(barrier_id: str, timeout_seconds: float) -> None:
    """Blocks until every task of the job reaches ``barrier_id``.

    Raises a ``tf.errors.OpError`` when it times out or the service finds a task dead.
    """
    _eager_context.context().wait_at_barrier(barrier_id, max(1, int(timeout_seconds * 1000)))


# Why: tfdp's step deadline (tfdp/deadline.py) ends a step whose collectives wait past
# timeout_seconds. TensorFlow's per-collective timeout would do it, but starts threads that
# sleep for the whole timeout for every collective (measured: a fast job dies of thread
# exhaustion). Aborting the collective executor is what TensorFlow's own peer health check
# (MultiWorkerMirroredStrategy's _check_health) does; only the eager context exposes it.
def abort_collective_ops(message: str) -> None:
    """Fails every collective in flight, and every later one, with DeadlineExceededError."""
    from tensorflow.python.framework import errors

    _eager_context.context().abort_collective_ops(errors.DEADLINE_EXCEEDED, message)


# Why: a job resumed mid-epoch runs a short first epoch (its first steps were trained before
# the backup). Keras's epoch iterator (a local of Model.fit) takes the epoch length from the
# dataset's cardinality once per fit; left alone it would step past the end of the short
# epoch, and TensorFlow's partial-batch handling would feed a step of empty batches that
# still moves Adam's moments and the iteration counter (or, with unknown cardinality, it
# would record the short length and cut every later epoch to it). No public API reaches the
# iterator; BackupAndRestore finds it through the dataset it trains on and sets the length of
# the resumed epoch (EpochIterator._num_batches), then restores it.
def set_keras_epoch_length(dataset, num_batches) -> int:
    """Sets the epoch length of the Keras epoch iterators over ``dataset`` (None: unknown);
    returns how many iterators it set."""
    import gc

    from keras.src.trainers.epoch_iterator import EpochIterator

    candidates = list(gc.get_referrers(dataset))
    for referrer in list(candidates):
        if isinstance(referrer, dict):  # an instance __dict__ in some Python versions
            candidates.extend(gc.get_referrers(referrer))
    found = {id(obj): obj for obj in candidates
             if isinstance(obj, EpochIterator) and obj.steps_per_epoch is None}
    for obj in found.values():
        obj._num_batches = num_batches  # noqa: SLF001
    return len(found)


def keras_epoch_length(dataset):
    """The epoch length Keras's data adapter reports for ``dataset`` (None: unknown)."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    return TFDatasetAdapter(dataset).num_batches


# Why: tfdp.data shards native file pipelines with TensorFlow's own FILE auto-shard rewrite,
# the public op tf.raw_ops.AutoShardDataset, applied per input pipeline. The op needs the
# dataset's flat output types and shapes; for composite elements (SparseTensor from
# VarLenFeature, RaggedTensor) these are tf.data's internal variant encodings, which only this
# tf.data helper computes (Dataset._flat_structure uses it); no public API exposes them.
from tensorflow.python.data.util import structure as _data_structure  # noqa: E402


def dataset_flat_types_and_shapes(element_spec):
    """(output_types, output_shapes) of a dataset with ``element_spec``, as dataset ops take them."""
    return (_data_structure.get_flat_tensor_types(element_spec),
            _data_structure.get_flat_tensor_shapes(element_spec))


# --- Resilience (tfdp/callbacks/backup_and_restore.py) ---------------------------------------

def set_keras_initial_epoch(model, epoch: int) -> None:
    """Makes ``model.fit`` start at ``epoch`` (a resumed job).

    Why: ``fit`` reads its first epoch from ``model._initial_epoch`` when set (Keras's own
    BackupAndRestore resumes through it); a callback cannot pass ``initial_epoch`` to a
    ``fit`` call already running, and no public setter exists.
    """
    _get(model, "_initial_epoch", "resuming at an epoch")  # set by Keras's Trainer.__init__
    model._initial_epoch = int(epoch)  # noqa: SLF001


# noqa: E402 below: the saving half needs _get and _patch, defined above.
from tfdp._tf_private.keras_saving import (  # noqa: E402,F401
    patch_keras_file_writers,
    patch_keras_makedirs,
    patch_keras_export,
    patch_tensorflow_file_writers,
    patch_checkpoint_write,
    patch_checkpoint_manager_save,
    checkpoint_manager_state,
    set_checkpoint_manager_state,
    patch_keras_callback,
    keras_backup_paths,
    keras_initial_epoch,
)
