"""tf.distribute internals: the strategy engine tfdp extends and the collectives it launches.

What lives here: the classes under MultiWorkerMirroredStrategy that tfdp's
DataParallelStrategy subclasses and builds (tfdp/strategy/data_parallel.py), the hooks it
overrides, the collective launchers and ops tfdp's own collectives reuse
(tfdp/strategy/collectives.py and replica_ops.py, tfdp/optimizers/sharded.py), the
XLA-trace test, the collective-op patch of StragglerMonitor and the collective abort of the
step deadline. Each entry says why no public API serves; tests/test_tf_private.py pins them.
"""

from __future__ import annotations

from tfdp._tf_private.core import (get_private, patch_attribute, replace_attribute,
                                   require_attributes)

# Why: tf.distribute has no public way to build a Strategy with a custom extended object.
# CollectiveAllReduceExtended is the engine under MultiWorkerMirroredStrategy: it mirrors
# variables over local devices and spans workers with TensorFlow's collective runtime over
# gRPC. tfdp subclasses it to choose the local devices (logical CPUs per worker, which the
# stock class never uses) and its communication options.
from tensorflow.python.distribute.collective_all_reduce_strategy import (
    CollectiveAllReduceExtended,
)

# Why: the public MultiWorkerMirroredStrategy constructor always builds its own extended
# object from TF_CONFIG; tfdp calls the base Strategy constructor with its own extended.
from tensorflow.python.distribute.distribute_lib import Strategy as StrategyBase  # noqa: F401 (re-exported by the package)

# Why: the per-replica values Keras hands to Strategy.reduce are instances of this class;
# there is no public isinstance check for "PerReplica".
from tensorflow.python.distribute.values import DistributedValues

# Why: MirroredStrategy creates a plain (non-mirrored) variable on one device when the
# creator's colocate_with is a SingleDevice; ShardedOptimizer uses this to place each
# partition's optimizer state on its owner's device only. No public API creates a
# single-device variable inside a strategy scope.
from tensorflow.python.distribute.numpy_dataset import SingleDevice  # noqa: F401 (re-exported by the package)

# Why: TensorFlow exposes no all-to-all on ReplicaContext, and its reduce-scatter op has
# no CPU kernel. The op must use the strategy's own collective launcher's group key,
# instance keys and ordering token so it never clashes with TensorFlow's collectives.
from tensorflow.python.ops import collective_ops as tf_collective_ops

# Why: tfdp refuses XLA compilation of a multi-replica CPU step with a clear message (see
# strategy.py, DataParallelStrategy.run). tf.function(jit_compile=True) marks the graph it
# traces with an XLA control-flow context; TensorFlow's own strategies read it through this
# function (mirrored_strategy._use_merge_call). No public API says "this trace is XLA".
from tensorflow.python.ops.control_flow_util import (
    GraphOrParentsInXlaContext as _graph_or_parents_in_xla_context,
)

# Why: tfdp's step deadline (tfdp/strategy/deadline.py) ends a step whose collectives wait past
# timeout_seconds. TensorFlow's per-collective timeout would do it, but starts threads that
# sleep for the whole timeout for every collective (measured: a fast job dies of thread
# exhaustion). Aborting the collective executor is what TensorFlow's own peer health check
# (MultiWorkerMirroredStrategy's _check_health) does; only the eager context exposes it.
from tensorflow.python.eager import context as _eager_context


# --- The strategy's extended object (strategy.py) ------------------------------------------

# Why: tfdp's extended object (strategy.py, _DataParallelExtended) overrides these hooks of
# CollectiveAllReduceExtended: which local devices are replicas, merge-call-free collectives,
# variable creation (ONLY_FIRST_REPLICA counters, sharded parameters), the two reduction entry
# points (to cast dtypes TensorFlow's collectives cannot sum) and a replica's variable update
# (sharded variables updated one at a time). tf.distribute has no public extension points.
EXTENDED_HOOKS = ("_initialize_local_devices", "_use_merge_call", "_create_variable",
                  "_reduce_to", "_replica_ctx_all_reduce", "_replica_ctx_update")
require_attributes(CollectiveAllReduceExtended, EXTENDED_HOOKS,
                   "hooks tfdp's DataParallelStrategy overrides")


def set_collective_key_base(strategy, base: int) -> None:
    """Where this strategy's collective group/instance keys start.

    Why: CollectiveAllReduceExtended reads the container strategy's ``_collective_key_base``
    when it builds its key allocator; TensorFlow's own strategies all start at 0, so two in
    one process clash. No public argument sets it.
    """
    strategy._collective_key_base = base


def extended_num_workers(extended) -> int:
    """Workers of a collective strategy's extended object. Why: no public attribute;
    ``num_replicas_in_sync`` counts local devices too."""
    return get_private(extended, "_num_workers", "counting workers")


def communication_options(extended):
    """The ``CommunicationOptions`` a collective strategy was built with.

    Why: no public getter; tfdp's own collectives (buckets, all-to-all) reuse its timeout and
    implementation. The object is shared with the strategy's collective launchers, so setting
    its ``implementation`` before the first collective switches all of them (the shared-GPU
    fallback to ring does so).
    """
    return get_private(extended, "_communication_options", "collective timeout and implementation")


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


def in_xla_context(graph) -> bool:
    """True while tracing ``graph`` (or a graph it is nested in) for XLA compilation."""
    return bool(_graph_or_parents_in_xla_context(graph))


# --- Collectives (collectives.py, replica_ops.py, sharded.py) ------------------------------

def all_to_all(launcher, value, options):
    """``t[i]`` goes to group rank i: CollectiveAllToAllV2 with ``launcher``'s keys."""
    import tensorflow as tf

    with tf.device(launcher._device):
        return tf_collective_ops.all_to_all_v2(
            value, launcher._group_size, launcher._group_key,
            launcher._next_instance_key(),
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())


def all_reduce(launcher, value, options):
    """The sum of ``value`` over the launcher's group: one CollectiveReduceV2, created now.

    Why: ``ReplicaContext.all_reduce`` hands its tensors to
    ``CollectiveAllReduce._all_reduce``, which reverses them before launching (a guess at
    backprop's order) and packs them itself; tfdp's gradient buckets must launch in the
    order backprop produces them (collectives.py, "Launch order"), one collective each, with
    the launcher's own keys and ordering token so they never clash with TensorFlow's.
    """
    return launcher.all_reduce(value, None, options)


def add_control_input(op, dependency) -> None:
    """Makes the existing graph op ``op`` wait for the op ``dependency``.

    Why: tfdp's gradient buckets (collectives.py, "Backward pacing") must make the backward
    pass of earlier layers, which Keras's ``tape.gradient`` has already built, wait until a
    bucket's gradients are packed; ``tf.control_dependencies`` only reaches ops created
    inside it. ``Operation._add_control_input`` is what TensorFlow's own graph rewriting
    (control flow, automatic control dependencies) uses on ops that exist.
    """
    op._add_control_input(dependency)


def operation_count(graph) -> int:
    """How many ops ``graph`` holds (``operations_since``'s bookmark)."""
    return len(get_private(graph, "operations", "reading the ops a graph holds without copying"))


def operations_since(graph, count: int) -> list:
    """The ops added to ``graph`` after it held ``count``, in order.

    Why: ZeRO-3 chains each variable's update after the previous one's ops
    (zero3.optimizer.one_update_at_a_time), once per sharded variable and replica. The
    public ``Graph.get_operations()`` copies every op of the graph (7.5 ms at 200k ops,
    measured), which made tracing grow with the square of the model (the 1B headline's 240
    layers on 8 replicas); the graph's ``operations`` list, which TensorFlow's C++ graph
    keeps and hands out without a copy (0.09 ms), gives the new ops in time linear in them.
    """
    operations = get_private(graph, "operations", "reading the ops a graph holds without copying")
    return list(operations[count:])


def collective_launchers(extended):
    """The per-local-device collective launchers of a collective strategy's extended."""
    return extended._cross_device_ops._launchers


def all_gather(launcher, value, options):
    """Concatenation of ``value`` from every group rank along axis 0.

    Why: ReplicaContext.all_gather always goes through merge_call, which cannot run inside
    tf.cond (LossScaleOptimizer applies the inner optimizer inside one); the launcher's
    own all-gather launches the collective directly in the replica.
    """
    return launcher._all_gather(value, options)


def broadcast(launcher, value, shape, dtype, options):
    """``value`` from the one replica that passes it (the others pass None) to every replica
    of the launcher's group; returns the value everywhere.

    Why: tf.distribute offers no broadcast in a replica context (``ReplicaContext`` has
    all-reduce and all-gather only; ``Strategy.broadcast`` is a cross-replica call through
    merge_call). ShardedOptimizer sends a large variable's new rows from its one owner: as an
    all-gather every other replica sends as many rows of filler, and each receives N times
    the rows it needs. TensorFlow's collective broadcast ops take the launcher's group and
    its next instance key (the same sequence on every replica, as for its all-gather); they
    take no ordering token, and tf.function's automatic control dependencies leave them
    unordered (auto_control_deps.py lists them as order-insensitive), so callers order them.
    """
    instance_key = launcher._next_instance_key()
    options = launcher._options.merge(options)
    hint = options.implementation.value
    import tensorflow as tf

    with tf.device(launcher._device):
        if value is not None:
            return tf_collective_ops.broadcast_send_v2(
                value, launcher._group_size, launcher._group_key, instance_key,
                communication_hint=hint, timeout=options.timeout_seconds)
        return tf_collective_ops.broadcast_recv_v2(
            tf.constant(list(shape), tf.int32), dtype,
            launcher._group_size, launcher._group_key, instance_key,
            communication_hint=hint, timeout=options.timeout_seconds)


def local_replica_id(replica_context) -> int:
    """The replica's index among this worker's devices, as a Python int.

    Why: ``replica_id_in_sync_group`` is a tensor inside tf.function and
    ``ReplicaContext.devices`` is empty in multi-worker mode; ShardedOptimizer needs a
    trace-time integer to know which partition this replica updates. TensorFlow indexes its
    own collective launchers with this attribute.
    """
    return replica_context._replica_id


# --- Timing and aborting collectives (stragglers.py, deadline.py) ---------------------------

# Why: StragglerMonitor times every collective of a training step (when its input is ready,
# when its result is), so that time spent waiting for the other workers is told apart from a
# worker's own time wherever the collective comes from: the gradient reduction, the input
# pipeline's end-of-data agreement, Keras's metric reduction, ShardedOptimizer's all-to-all.
# TensorFlow's collective launchers (cross_device_utils.CollectiveReplicaLauncher) and tfdp's
# all_to_all above build every collective by calling these functions of the private
# collective_ops module, looked up at call time; no public hook observes a collective.
COLLECTIVE_OP_FUNCTIONS = ("all_reduce_v2", "all_gather_v2", "all_to_all_v2", "broadcast_send_v2",
                           "broadcast_recv_v2")


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
        get_private(manager, "run_independently", "timing collectives (StragglerMonitor)")(op)


def patch_collective_ops(make) -> None:
    """Replaces each of ``COLLECTIVE_OP_FUNCTIONS`` by ``make(original)`` once (same
    signature: the tensor first)."""
    for name in COLLECTIVE_OP_FUNCTIONS:
        patch_attribute(tf_collective_ops, name, make, "timing collectives (StragglerMonitor)")


def abort_collective_ops(message: str) -> None:
    """Fails every collective in flight, and every later one, with DeadlineExceededError."""
    from tensorflow.python.framework import errors

    _eager_context.context().abort_collective_ops(errors.DEADLINE_EXCEEDED, message)


# Why: AutoGraph converts every function a converted function calls, unless the callee's module
# matches one of its conversion rules; TensorFlow lists itself and Keras there (DoNotConvert).
# tfdp is not listed, so a custom loop (``strategy.run`` inside the user's tf.function) made
# AutoGraph rewrite ``DataParallelStrategy.run`` and every tfdp helper it calls: 0.5-0.6 s of
# CPU in each process (py-spy of a 2-worker job), and tfdp's graph-mode code transformed where
# it was not written for it (the Keras path never converts it). The public
# ``tf.autograph.experimental.do_not_convert`` is no substitute: it disables AutoGraph for
# everything beneath, the user's replica function included, which ``Strategy.run`` must
# convert when the caller's status says so. No public API adds a rule; the rules are a tuple
# AutoGraph reads at each call (``conversion.is_allowlisted``), replaced here through the patch
# registry (``restore_patches`` puts TensorFlow's tuple back).
from tensorflow.python.autograph.core import config as _autograph_config  # noqa: E402 (beside the patch it serves)


def patch_autograph_leaves_module(prefix: str) -> None:
    """Adds a DoNotConvert rule for the modules ``prefix`` and ``prefix.*`` to AutoGraph's
    conversion rules, first (idempotent): AutoGraph then calls their functions as written, with
    the caller's AutoGraph status unchanged, as it calls TensorFlow's and Keras's."""
    rules = get_private(_autograph_config, "CONVERSION_RULES", "leaving tfdp's code to AutoGraph")
    if any(isinstance(rule, _autograph_config.DoNotConvert) and rule.matches(prefix)
           for rule in rules):
        return
    replace_attribute(_autograph_config, "CONVERSION_RULES",
             (_autograph_config.DoNotConvert(prefix),) + tuple(rules),
             "leaving tfdp's code to AutoGraph")


def convert_like_strategy_run(fn):
    """``fn`` converted by AutoGraph as ``Strategy.run`` converts the function it is given.

    Why: ``DataParallelStrategy.run`` wraps the user's replica function (tfdp's wrapper must
    not be converted: it is marked ``do_not_convert``), so it converts the user's function
    itself, with the control status of the caller, exactly as ``Strategy.run`` would have.
    The public ``tf.autograph.to_graph`` converts unconditionally, which ``Strategy.run`` does
    not do in eager mode.
    """
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl import api as autograph_api

    return autograph_api.tf_convert(fn, ag_ctx.control_status_ctx())


# --- How a step function's graph is optimised --------------------------------------------------

# Why: a distributed step's graph holds every replica's copy of the model, its collectives and
# its per-variable updates (42,000 nodes for 8 replicas of 40 Dense layers under ZeRO-3), and
# Grappler, which optimises a function's graph when it is first called, took 17 s of its
# 45 s first step: two passes of each optimiser (``meta_optimizer_iterations`` DEFAULT) plus
# the TFG pass pipeline (3.6 s), while the step that comes out of one pass without TFG ran as
# fast (tfdp/strategy/xla.py's notes). TensorFlow's only public switch is process-wide
# (``tf.config.optimizer.set_experimental_options``, which has neither option); the options a
# call carries are the eager context's thread-local ``function_call_options``, read when a
# function is first called (TensorFlow: "changing config_proto after the first call has no
# effect").
from tensorflow.core.protobuf import config_pb2 as _config_pb2  # noqa: E402 (beside its use)
from tensorflow.core.protobuf import rewriter_config_pb2 as _rewriter_config_pb2  # noqa: E402

_ONE_PASS_OPTIONS = {}  # the caller's serialized options -> the one-pass FunctionCallOptions


def _one_pass_options(options):
    serialized = options.config_proto_serialized
    key = (serialized, options.executor_type)
    found = _ONE_PASS_OPTIONS.get(key)
    if found is None:
        config = _config_pb2.ConfigProto()
        if serialized is not None:
            config.ParseFromString(serialized)
        rewrite = config.graph_options.rewrite_options
        if rewrite.meta_optimizer_iterations == _rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS:
            rewrite.meta_optimizer_iterations = _rewriter_config_pb2.RewriterConfig.ONE
        rewrite.disable_tfg_optimizer = True
        found = _ONE_PASS_OPTIONS[key] = _eager_context.FunctionCallOptions(
            executor_type=options.executor_type, config_proto=config)
    return found


class one_pass_graph_optimization(object):  # a context manager
    """Functions first called inside it are optimised by Grappler in one pass of its
    optimisers, without the TFG pipeline; a ``meta_optimizer_iterations`` the user set in
    ``tf.config`` is kept, as is every other option. Thread-local, like the options it sets."""

    def __enter__(self):
        context = _eager_context.context()
        self._outer = context.function_call_options
        self._inner = _one_pass_options(self._outer)
        context.function_call_options = self._inner

    def __exit__(self, *exc):
        context = _eager_context.context()
        # A config change inside (tf.config.set_soft_device_placement, ...) drops the thread's
        # options so TensorFlow recomputes them from the new config: then the caller's old
        # ones must not come back.
        local = get_private(context, "_thread_local_data", "restoring a step's call options")
        if local.function_call_options is self._inner:
            context.function_call_options = self._outer
