"""Every TensorFlow- and Keras-private symbol tfdp touches, in one package, one module per area.

The rule: no module of tfdp outside this package imports ``tensorflow.python``, ``keras.src``
or ``tf.__internal__``, reads an underscore attribute of a TensorFlow or Keras object, or
replaces one of their attributes; it calls a named entry of this package instead. Each entry
says why no public API serves (a ``Why:`` comment or docstring), and ``tests/test_tf_private.py``
pins each one against the installed versions, so a TensorFlow or Keras upgrade that moves one
breaks here, in one place, and the failure names the symbol instead of surfacing as a
confusing error deep inside training.

The areas:

* ``core``: how a private name is reached (``get_private``, ``require_attributes``: a missing
  one is a ``PrivateAPIError`` naming it and what tfdp used it for) and how an attribute is
  replaced process-wide (``patch_attribute``, ``replace_attribute``, ``provide_attribute``),
  recorded so that ``restore_patches()`` puts TensorFlow and Keras back exactly as they were;
  ``patched()`` lists what is replaced.
* ``distribute``: tf.distribute internals: the strategy engine tfdp extends, its collective
  launchers and ops, the XLA-trace test, collective timing and abort.
* ``data``: tf.data internals: a distributed dataset's cardinality and end-of-data agreement,
  dataset ops' flat types, AutoGraph for a user's pipeline function.
* ``coordination``: TensorFlow's coordination service (key-value store, barrier).
* ``compile_cache``: the names traced functions get (the keys of XLA's persistent cache).
* ``keras_trainer``: Keras's trainer: tfdp's XLA step patches, pieces of Keras's train step,
  the epochs of a resumed job.
* ``keras_optimizer``: Keras's TensorFlow optimizer backend: gradient-reduction and
  LossScaleOptimizer patches, hooks and state ShardedOptimizer and LARS/LAMB use.
* ``keras_random``: Keras's random draws and seeds (each replica draws what one device draws).
* ``gradients``: TensorFlow's gradient functions: which lookup each row of a sparse
  (IndexedSlices) gradient comes from; a traced function's forward and backward programs.
* ``sharded_variable``: the distributed variable of ``shard_parameters=True`` (ZeRO-3): a
  MirroredVariable whose components hold slices, and how the strategy's scope creates one.
* ``profiler``: the profiler's trace format (XSpace), read offline by tools/profile_step.py.
* ``keras_distribution``: Keras's distribution API on the TensorFlow backend
  (``keras.distribution`` through tfdp: the backend's functions, ``set_distribution``, which
  Keras variable a ``tf.Variable`` is made for).
* ``keras_saving``: Keras saving and callbacks, TensorFlow's file writers and checkpoints
  (only the chief writes; agreed decisions).

Callers import this package, never an area module: ``from tfdp import _tf_private;
_tf_private.some_name(...)``. The area modules import ``core`` and nothing else of tfdp, so
each imports on its own.
"""

from __future__ import annotations

from tfdp import process_state
from tfdp._tf_private.core import (
    PrivateAPIError,
    get_private,
    patch_attribute,
    patched,
    provide_attribute,
    replace_attribute,
    require_attributes,
    restore_patches,
)
from tfdp._tf_private.keras_random import (
    KERAS_INPUT_DRAWS,
    KERAS_SHAPED_DRAWS,
    drawn_seed,
    keras_draw_seed,
    patch_keras_random,
)
from tfdp._tf_private.distribute import (
    COLLECTIVE_OP_FUNCTIONS,
    convert_like_strategy_run,
    patch_autograph_leaves_module,
    EXTENDED_HOOKS,
    CollectiveAllReduceExtended,
    DistributedValues,
    SingleDevice,
    StrategyBase,
    abort_collective_ops,
    add_control_input,
    operation_count,
    operations_since,
    all_gather,
    broadcast,
    all_reduce,
    all_to_all,
    collective_launchers,
    communication_options,
    extended_num_workers,
    in_xla_context,
    local_replica_id,
    map_distributed,
    one_pass_graph_optimization,
    patch_collective_ops,
    run_independently,
    set_collective_key_base,
    tf_collective_ops,
)
from tfdp._tf_private.data import (
    autograph_user_function,
    dataset_flat_types_and_shapes,
    end_of_data_agreement,
    patch_device_datasets_without_autotune,
    patch_per_device_generators_traced_once,
    set_distributed_dataset_cardinality,
    skip_end_of_data_agreement,
)
from tfdp._tf_private.compile_cache import align_function_names
from tfdp._tf_private.coordination import (
    COLLECTIVE_RUNTIME_CONTEXT_METHODS,
    coordination_service_configured,
    eager_context_initialized,
    preconfigure_collective_runtime,
    publish_to_coordination_service,
    delete_from_coordination_service,
    read_from_coordination_service,
    reuse_running_collective_server,
    tf_eager_context,
    wait_at_coordination_barrier,
)

from tfdp._tf_private.keras_trainer import (
    keras_call_has_training_arg,
    keras_compute_loss,
    keras_epoch_length,
    keras_iterators_before_epoch,
    keras_loss_tracker,
    keras_make_step_function,
    keras_model_supports_jit,
    patch_keras_auto_jit_compile,
    make_draws_of_iterators,
    patch_keras_epoch_iterators,
    patch_keras_symbolic_build,
    patch_keras_step_functions,
    set_keras_epoch_length,
    set_keras_initial_epoch,
    unscale_loss_for_distribution,
    patch_keras_fit,
)
from tfdp._tf_private.gradients import (
    GATHER_GRADIENT_OPS,
    PASS_THROUGH_OPS,
    SHAPE_OPS,
    SplitGradient,
    lookup_ids,
    split_gradient,
    tape_is_recording,
)
from tfdp._tf_private.profiler import xspace_proto
from tfdp._tf_private.keras_optimizer import (
    LAYERWISE_HOOKS,
    OPTIMIZER_HOOKS,
    WHOLE_STEP_METHODS,
    LossScaleOptimizer,
    TFOptimizer,
    advance_shared_state,
    advances_shared_state,
    apply_weight_decay,
    gradient_accumulators,
    has_own_weight_decay,
    keras_clip_gradients,
    moving_averages,
    optimizer_own_variables,
    optimizer_state_lists,
    optimizer_step_counter,
    optimizer_strategy,
    overridden_step_methods,
    patch_keras_gradient_reduction,
    patch_loss_scale_check_finite,
    patch_loss_scale_saving,
    patch_keras_apply_gradients,
    patch_keras_optimizer_apply,
    patch_keras_moving_average_update,
    applying,
    applying_variables,
    replace_variable_storage,
    set_optimizer_own_variables,
    uses_weight_decay,
    variable_index,
    variable_key,
    SHARED_STATE_STEPS,
)
from tfdp._tf_private.sharded_variable import (
    SHARDED_VARIABLE_HOOKS,
    ShardedVariable,
    broadcast_initial_value,
    create_sharded_variable,
    current_replica_id,
    in_keras_stateless_scope,
    in_keras_symbolic_scope,
    in_update_context,
    is_sharded_variable,
    own_trainable_variables,
    patch_keras_layer_call,
    reading_slices,
    sharded_container,
)
from tfdp._tf_private.keras_distribution import (
    BACKEND_PROVIDED,
    BACKEND_REPLACED,
    keras_backend_distribution_lib,
    keras_distribution_base,
    keras_distribution_lib,
    patch_keras_backend_distribution,
    patch_keras_distribute_dataset,
    patch_keras_set_distribution,
    patch_keras_variable_initialize,
    set_keras_distribution_quietly,
)
from tfdp._tf_private.keras_saving import (
    KERAS_BACKUP_PATH_ATTRIBUTES,
    CheckpointManagerState,
    checkpoint_manager_state,
    keras_backup_paths,
    keras_initial_epoch,
    patch_checkpoint_manager_save,
    patch_checkpoint_write,
    patch_keras_callback,
    patch_keras_export,
    patch_keras_file_writers,
    patch_keras_makedirs,
    patch_tensorflow_file_writers,
    set_checkpoint_manager_state,
)

__all__ = [
    # core (get_private and the *_attribute functions are the area modules' own tools)
    "PrivateAPIError", "require_attributes", "restore_patches", "patched", "get_private",
    "patch_attribute", "replace_attribute", "provide_attribute",
    # keras_random
    "KERAS_SHAPED_DRAWS", "KERAS_INPUT_DRAWS", "patch_keras_random", "keras_draw_seed",
    "drawn_seed", "convert_like_strategy_run",
    # distribute
    "patch_autograph_leaves_module",
    "CollectiveAllReduceExtended", "StrategyBase", "DistributedValues", "SingleDevice",
    "EXTENDED_HOOKS", "COLLECTIVE_OP_FUNCTIONS", "set_collective_key_base",
    "extended_num_workers", "communication_options", "one_pass_graph_optimization", "map_distributed", "in_xla_context",
    "all_to_all", "collective_launchers", "all_gather", "broadcast", "all_reduce", "add_control_input", "operation_count", "operations_since", "local_replica_id",
    "run_independently", "patch_collective_ops", "abort_collective_ops", "tf_collective_ops",
    # data
    "set_distributed_dataset_cardinality", "skip_end_of_data_agreement",
    "end_of_data_agreement", "dataset_flat_types_and_shapes", "autograph_user_function",
    "patch_device_datasets_without_autotune", "patch_per_device_generators_traced_once",
    "make_draws_of_iterators",
    "patch_keras_epoch_iterators",
    "patch_keras_symbolic_build",
    # coordination
    "publish_to_coordination_service", "read_from_coordination_service",
    "delete_from_coordination_service",
    "coordination_service_configured", "wait_at_coordination_barrier",
    "COLLECTIVE_RUNTIME_CONTEXT_METHODS", "eager_context_initialized", "align_function_names",
    "preconfigure_collective_runtime", "reuse_running_collective_server", "tf_eager_context",
    # keras_trainer
    "patch_keras_fit", "patch_keras_auto_jit_compile", "patch_keras_step_functions", "keras_make_step_function",
    "keras_model_supports_jit", "keras_compute_loss", "keras_call_has_training_arg",
    "keras_loss_tracker", "unscale_loss_for_distribution", "set_keras_epoch_length",
    "keras_epoch_length", "keras_iterators_before_epoch", "set_keras_initial_epoch",
    # gradients
    "GATHER_GRADIENT_OPS", "lookup_ids", "PASS_THROUGH_OPS", "SHAPE_OPS", "SplitGradient", "split_gradient",
    "tape_is_recording",
    # profiler
    "xspace_proto",
    # keras_optimizer
    "SHARED_STATE_STEPS", "keras_clip_gradients",
    "TFOptimizer", "LossScaleOptimizer", "OPTIMIZER_HOOKS", "LAYERWISE_HOOKS",
    "optimizer_strategy", "optimizer_step_counter", "optimizer_own_variables",
    "set_optimizer_own_variables", "gradient_accumulators", "moving_averages",
    "has_own_weight_decay", "apply_weight_decay", "uses_weight_decay", "variable_index",
    "variable_key", "patch_keras_gradient_reduction", "patch_loss_scale_check_finite",
    "patch_loss_scale_saving", "WHOLE_STEP_METHODS", "overridden_step_methods",
    "advances_shared_state", "advance_shared_state", "optimizer_state_lists",
    "replace_variable_storage", "patch_keras_apply_gradients", "patch_keras_optimizer_apply", "patch_keras_moving_average_update", "applying", "applying_variables",
    # sharded_variable
    "SHARDED_VARIABLE_HOOKS", "ShardedVariable", "broadcast_initial_value", "current_replica_id",
    "create_sharded_variable", "is_sharded_variable", "sharded_container", "reading_slices",
    "in_keras_symbolic_scope", "in_keras_stateless_scope", "in_update_context", "own_trainable_variables",
    "patch_keras_layer_call",
    # keras_saving
    "patch_keras_file_writers", "patch_keras_makedirs", "patch_keras_export",
    "patch_tensorflow_file_writers", "patch_checkpoint_write", "patch_checkpoint_manager_save",
    "CheckpointManagerState", "checkpoint_manager_state", "set_checkpoint_manager_state",
    "patch_keras_callback", "KERAS_BACKUP_PATH_ATTRIBUTES", "keras_backup_paths",
    "keras_initial_epoch",
    # keras_distribution
    "BACKEND_PROVIDED", "BACKEND_REPLACED", "keras_backend_distribution_lib",
    "keras_distribution_base", "keras_distribution_lib", "patch_keras_backend_distribution",
    "patch_keras_distribute_dataset", "patch_keras_set_distribution",
    "patch_keras_variable_initialize", "set_keras_distribution_quietly",
]


# The patch registry (core's) is process state: ``tfdp.reset()`` restores TensorFlow and Keras.
# Declared here, not in core, so that core imports nothing of tfdp and loads on its own (the
# area modules' rule; tools/bench_multiworker_step.py loads another commit's core by path).
process_state.register(
    "patches", "tfdp._tf_private.core",
    lambda: tuple(sorted(f"{getattr(o, '__name__', o)}.{n}" for o, n in patched())),
    restore_patches)
