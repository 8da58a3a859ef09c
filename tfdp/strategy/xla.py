"""XLA under a tfdp strategy: each replica's forward/backward compiled, reduction outside.

Rule. With ``model.compile(jit_compile=True)`` (or ``"auto"`` resolved to True) and more
than one replica in sync, a training step is split in two, inside every replica:

1. one XLA-compiled function computes the forward pass, the loss, the gradients and the
   metric updates. It takes the replica's variable values as arguments and returns the
   gradients and the new values of the state it updated (metrics, BatchNorm statistics,
   seed generators): it reads no variable, so it never touches another replica's (XLA's
   "Trying to access resource .../replica_1/... located in device GPU:1" with several GPUs
   in one process), and it holds no collective (which XLA cannot compile across CPU
   replicas, nor across several GPUs in one process);
2. outside it, in the same replica, the new state values are assigned and the optimizer
   applies the gradients: the reduction (buckets, compression, ShardedOptimizer's
   reduce-scatter), clipping, gradient accumulation and the update run exactly as without
   XLA.

With ``shard_parameters=True`` (ZeRO-3, ``reshard_after_forward=True``) the step is not split:
compiling the forward/backward whole would take every gathered parameter as an argument at
once. Instead each ZeRO-3 unit is compiled on its own, its gathers and reduce-scatters
between the programs (plan ``"units"``, tfdp/strategy/zero3/units_xla.py); the rest of the
step runs without XLA (said once). ``reshard_after_forward=False`` keeps every gathered
parameter to the backward pass by definition and keeps the split step.

Evaluation steps are split the same way (compiled forward, loss and metrics). With one
replica in sync, Keras compiles the whole step as it does without a strategy (it holds no
collective). A model that overrides ``train_step``/``test_step`` cannot be split: its step runs
without XLA (one warning); inside a custom ``train_step`` or a custom loop,
``tfdp.compile_gradients`` gives the same per-replica compilation. ``jit_compile=False``
turns all of it off.

``jit_compile="auto"`` resolves as Keras would on one device (``resolve_auto_jit_compile``):
True on GPU replicas when every layer supports XLA and op determinism is off, False on CPUs
(Keras turns XLA off on CPU-only hosts); Keras itself resolves it to False under any
tf.distribute strategy.
"""

from __future__ import annotations

import logging
import weakref

import keras
import tensorflow as tf

from tfdp import _tf_private, said_once
from tfdp.strategy import deadline, is_data_parallel, riders, sparse_gradients, timing
from tfdp.strategy.zero3 import gradients as zero3_gradients
from tfdp.strategy.zero3 import layout as zero3_layout
from tfdp.strategy.zero3 import units_xla as zero3_units_xla
from tfdp.strategy.zero3.config import config_of as zero3_config_of

__all__ = ["compile_gradients", "CompiledGradients", "compiled_train_step",
           "resolve_auto_jit_compile", "step_plan", "rides_metrics", "install_keras_hooks",
           "STEP_PLANS"]

log = logging.getLogger("tfdp")

# What a Keras step does under tfdp (step_plan): Keras's own step (no XLA, or XLA around the
# whole step of one replica), tfdp's split step, or Keras's step without XLA.
STEP_PLANS = ("keras", "split", "no_xla", "units")


def resolve_auto_jit_compile(device_type: str, model_supports_jit: bool,
                             num_replicas_in_sync: int = 1, keras_step: bool = True) -> bool:
    """What ``jit_compile="auto"`` means under a tfdp strategy; pure policy.

    As Keras decides on one device: XLA on GPU replicas when the model supports it (every
    layer XLA-capable, op determinism off: Keras's ``model_supports_jit``), never on CPUs
    (Keras turns XLA off on CPU-only hosts) or TPUs (tf.distribute's TPU path is not tfdp's).
    A model with its own ``train_step``/``test_step`` and several replicas cannot be split
    (see the module docstring), so "auto" leaves XLA off for it.

    Args:
        device_type: ``"GPU"``, ``"CPU"`` or ``"TPU"``, the type of the local replicas.
        model_supports_jit: Keras's verdict for the model.
        num_replicas_in_sync: replicas over all workers.
        keras_step: the model uses Keras's own ``train_step`` and ``test_step``.
    """
    if device_type != "GPU" or not model_supports_jit:
        return False
    return num_replicas_in_sync == 1 or keras_step


def step_plan(jit_compile: bool, num_replicas_in_sync: int, keras_step: bool,
              sharded_units: bool = False) -> str:
    """How a Keras train/test step runs under a tfdp strategy; pure policy.

    Returns one of ``STEP_PLANS``: ``"keras"`` (Keras's own step: without XLA, or compiled
    whole when one replica holds no collective), ``"split"`` (per-replica compiled
    forward/backward, reduction and update outside), ``"no_xla"`` (an overridden step with
    several replicas: Keras's step without XLA) or ``"units"`` (``sharded_units``: ZeRO-3
    with ``reshard_after_forward=True``; Keras's step without XLA around ZeRO-3 units each
    compiled on its own, so no program holds every gathered parameter).
    """
    if not jit_compile or num_replicas_in_sync == 1:
        return "keras"
    if sharded_units:
        return "units"
    return "split" if keras_step else "no_xla"


def rides_metrics(kind: str, num_workers: int, keras_step: bool) -> bool:
    """Whether a Keras step's logs ride in its gradient all-reduce; pure policy.

    Keras averages the logs (metric results) of every multi-worker step with an all-reduce of
    their own: one more cross-host round trip per step. In Keras's own train step the metrics
    depend on the forward pass only, so tfdp computes them before the update and sends them
    with the gradients (``riders.LogsRider``): one collective per step instead of two.
    Not for test steps (no gradients), one worker (Keras averages its replicas' logs locally,
    without a collective) or an overridden ``train_step`` (its order is the user's).
    """
    return kind == "train" and num_workers > 1 and keras_step


class CompiledGradients:
    """``fn``'s value and its gradients, computed by one compiled function per replica.

    Made by ``compile_gradients``; call it with ``fn``'s arguments inside ``strategy.run``
    (or anywhere: without a strategy it is one device). Each call reads the current
    replica's values of ``variables`` and ``state_variables``, runs ``fn`` on them inside
    ``tf.function(jit_compile=...)`` under a ``keras.StatelessScope`` (so the compiled code
    reads no variable), assigns the new values of the state variables ``fn`` updated, and
    returns ``(value, gradients)``.

    Attributes:
        function: the ``tf.function`` that is compiled (its
            ``experimental_get_compiler_ir`` shows the XLA program).
    """

    def __init__(self, fn, variables, state_variables=(), has_aux=False, jit_compile=True):
        self.fn = fn
        self.variables = _keras_variables(variables, "variables")
        self.state_variables = _keras_variables(state_variables, "state_variables")
        self.has_aux = has_aux
        self._checked = False
        self.function = tf.function(self._stateless, jit_compile=jit_compile,
                                    reduce_retracing=True)

    def _stateless(self, values, state_values, args, kwargs):
        mapping = (list(zip(self.variables, values))
                   + list(zip(self.state_variables, state_values)))
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(values)
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                before = [scope.get_current_value(v) for v in self.state_variables]
                out = self.fn(*args, **kwargs)
        loss = out[0] if self.has_aux else out
        grads = tape.gradient(loss, values) if values else []
        # Which lookups a sparse gradient's rows come from is known here only (sparse_gradients).
        self._sparse_plans = sparse_gradients.lookup_plans(grads)
        updated = []
        for variable, old in zip(self.state_variables, before):
            new = scope.get_current_value(variable)
            updated.append(None if new is old else tf.cast(new, old.dtype))
        return out, grads, updated

    def __call__(self, *args, **kwargs):
        values = [_read(v) for v in self.variables]
        state_values = [_read(v) for v in self.state_variables]
        self._check_captures(values, state_values, args, kwargs)
        out, grads, updated = self.function(values, state_values, args, kwargs)
        sparse_gradients.remember_plans(grads, getattr(self, "_sparse_plans", None))
        for variable, new in zip(self.state_variables, updated):
            if new is not None:
                variable.assign(new)
        # shard_parameters=True: the compiled function took gathered parameters (gathered
        # by _read, outside XLA); their gradients are reduce-scattered outside it too.
        return out, [zero3_gradients.slice_gradient(v, g)
                     if g is not None and zero3_layout.is_sharded(v) else g
                     for v, g in zip(self.variables, grads)]


    def _check_captures(self, values, state_values, args, kwargs):
        """Warns once when fn reads a variable it was not given (captured by the compiled
        function): XLA may then touch another replica's variable on GPUs."""
        if self._checked:
            return
        self._checked = True
        concrete = self.function.get_concrete_function(values, state_values, args, kwargs)
        captured = [t for t in concrete.captured_inputs if t.dtype == tf.resource]
        if captured:
            log.warning(
                "tfdp.compile_gradients: %s reads %d variable(s) not among its variables or "
                "state_variables; the compiled function captures them, which XLA cannot do "
                "for several GPUs in one process. Pass them in state_variables.",
                getattr(self.fn, "__name__", "fn"), len(captured))


def compile_gradients(fn, variables, state_variables=(), has_aux=False, jit_compile=True):
    """XLA-compiles ``fn`` and its gradients per replica, for custom training loops.

    ``fn(*args, **kwargs)`` returns a scalar loss (or ``(loss, aux)`` with ``has_aux=True``)
    computed from Keras variables. The returned callable computes ``(value, gradients)``,
    the gradients being those of the loss with respect to ``variables`` (None where it does
    not depend on one), with ``fn``'s forward and backward pass compiled by XLA as one
    function that takes the variables' values as arguments: it reads no variable and holds
    no collective, so it works under a tfdp strategy with any number of replicas (CPU or
    GPU, one process or several workers). Reduce and apply the gradients outside it, with
    the optimizer, as usual::

        grad_fn = tfdp.compile_gradients(
            loss_fn, model.trainable_variables,
            state_variables=model.non_trainable_variables)

        @tf.function
        def train_step(batch):
            def replica_step(batch):
                loss, grads = grad_fn(batch)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.run(replica_step, args=(batch,))

    Args:
        fn: the loss function. It may call Keras models and layers and update Keras
            variables (``BatchNormalization`` statistics, seed generators, metrics); those
            variables must be in ``variables`` or ``state_variables``.
        variables: the Keras variables to differentiate with respect to.
        state_variables: other Keras variables ``fn`` reads or updates; their new values
            are assigned after the compiled call (in the replica that made the call).
        has_aux: ``fn`` returns ``(loss, aux)``; the value returned is then that pair.
        jit_compile: False runs the same function without XLA.

    Returns:
        A ``CompiledGradients``: call it with ``fn``'s arguments.
    """
    return CompiledGradients(fn, variables, state_variables, has_aux, jit_compile)


def _keras_variables(variables, name):
    variables = list(variables)
    for v in variables:
        if not isinstance(v, keras.Variable):
            raise TypeError(
                f"compile_gradients: {name} must be Keras variables (keras.Variable, e.g. "
                f"model.trainable_variables), got {type(v).__name__}: the compiled function "
                "receives their values through a keras.StatelessScope. Pass a plain "
                "tf.Variable's value to fn as an argument instead.")
    return variables


def _read(variable):
    # In a replica context this reads the replica's own component, on its device.
    return tf.convert_to_tensor(variable.value)


# --- Keras's fit/evaluate --------------------------------------------------------------------

def _batch_size(x):
    return tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0]


def _call_model(model, x, training):
    if _tf_private.keras_call_has_training_arg(model):
        return model(x, training=training)
    return model(x)


# model -> the CompiledGradients of its current split train step (see compiled_train_step).
_compiled_steps = weakref.WeakKeyDictionary()


def compiled_train_step(model):
    """The ``CompiledGradients`` behind ``model``'s split train step, or None (the step is
    not split: see ``step_plan``). Its ``function.experimental_get_compiler_ir`` shows XLA's
    program."""
    return _compiled_steps.get(model)


def _train_step(model, ride_logs=False):
    """tfdp's split train step for ``model`` (Keras's TensorFlow train_step, same order of
    loss, loss tracker and metrics); ``ride_logs``: see ``rides_metrics``."""

    def forward_backward(data, loss_scale):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = _call_model(model, x, training=True)
        loss = _tf_private.keras_compute_loss(model, x, y, y_pred, sample_weight, training=True)
        _tf_private.keras_loss_tracker(model).update_state(
            _tf_private.unscale_loss_for_distribution(loss), sample_weight=_batch_size(x))
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return loss * tf.cast(loss_scale, loss.dtype), logs

    trainable = list(model.trainable_variables)
    compiled = CompiledGradients(
        forward_backward, trainable,
        list(model.non_trainable_variables) + list(model.metrics_variables), has_aux=True)
    _compiled_steps[model] = compiled

    def train_step(data):
        _observe_batch(data)
        # The optimizer's loss scale (LossScaleOptimizer's dynamic scale is a variable) is
        # read here and passed in: loss * (1 * s) == loss * s exactly.
        optimizer = model.optimizer
        loss_scale = (optimizer.scale_loss(tf.constant(1.0)) if optimizer is not None
                      else tf.constant(1.0))
        (_, logs), grads = compiled(data, loss_scale)
        return _apply_gradients(model, grads, trainable, logs, ride_logs)

    return train_step


def _riding_train_step(model):
    """Keras's TensorFlow train_step with the metrics computed before the update instead of
    after it (they read the forward pass only), so that the logs ride in the gradient
    all-reduce (``rides_metrics``)."""

    def train_step(data):
        _observe_batch(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = model.optimizer
        with tf.GradientTape() as tape:
            y_pred = _call_model(model, x, training=True)
            loss = _tf_private.keras_compute_loss(model, x, y, y_pred, sample_weight, training=True)
            _tf_private.keras_loss_tracker(model).update_state(
                _tf_private.unscale_loss_for_distribution(loss), sample_weight=_batch_size(x))
            if optimizer is not None:
                loss = optimizer.scale_loss(loss)
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        trainable = list(model.trainable_weights)
        grads = tape.gradient(loss, trainable) if trainable else []
        return _apply_gradients(model, grads, trainable, logs, ride_logs=True)

    return train_step


def _apply_gradients(model, grads, trainable, logs, ride_logs):
    """The optimizer's update; returns the logs, averaged over all replicas already where
    ``ride_logs`` and they rode in the gradient all-reduce."""
    if not trainable:
        log.warning("tfdp: the model does not have any trainable weights.")
        return logs
    rider = None
    if ride_logs:
        num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        rider = riders.LogsRider.of(logs, num_replicas)
    with riders.riding_with_gradients(rider):
        model.optimizer.apply_gradients(zip(grads, trainable))
    reduced = rider.mean_logs() if rider is not None else None
    return logs if reduced is None else reduced


def _test_step(model):
    """tfdp's split test step: compiled forward, loss and metrics."""

    def forward(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = _call_model(model, x, training=False)
        loss = _tf_private.keras_compute_loss(model, x, y, y_pred, sample_weight, training=False)
        _tf_private.keras_loss_tracker(model).update_state(
            _tf_private.unscale_loss_for_distribution(loss), sample_weight=_batch_size(x))
        return tf.constant(0.0), model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    compiled = CompiledGradients(
        forward, [], list(model.variables) + list(model.metrics_variables), has_aux=True)

    def test_step(data):
        (_, logs), _ = compiled(data)
        return logs

    return test_step


def _units_step(model, kind, ride_logs):
    """Keras's step (or tfdp's riding train step) without XLA, its ZeRO-3 units compiled each
    on its own (plan "units")."""
    if kind == "train":
        inner = _riding_train_step(model) if ride_logs else model.train_step
    else:
        inner = model.test_step
    if said_once.first_time("xla_units", id(model)):
        log.info("tfdp: ZeRO-3 under XLA: each unit (a layer with sharded weights, or a "
                 "unit_layers block) is compiled on its own, gathering between units; the "
                 "rest of %s's %s step (loss, metrics, layers outside units) runs without "
                 "XLA.", type(model).__name__, kind)

    def step(data):
        zero3_units_xla.compile_units_here()
        return inner(data)

    return step


def _tfdp_strategy_of(model):
    strategy = model.distribute_strategy
    return strategy if is_data_parallel(strategy) else None


def _keras_step(model, name) -> bool:
    """Whether ``model`` runs Keras's own ``name`` (``train_step``/``test_step``): not when its
    class or the instance overrides it, except by a wrapper marked ``_tfdp_transparent`` (it
    only observes, as StragglerMonitor's does, and tfdp's own steps do the same)."""
    own = vars(model).get(name)
    if own is not None and not getattr(own, "_tfdp_transparent", False):
        return False
    return getattr(type(model), name) is getattr(keras.Model, name)


def _observe_batch(data):
    # What StragglerMonitor's (transparent) train_step wrapper does; a no-op unless it listens.
    timing.mark_batch_in_hand(data)


def _warn_once(key, message, *args):
    if said_once.first_time("xla", key):
        log.warning(message, *args)


def _make_step_function(model, kind, original, force):
    """The patched make_train_function / make_test_function body: under a tfdp strategy, one
    step function per kind of input (``_per_input_kind``), each built by ``_build_step``."""
    strategy = _tfdp_strategy_of(model)
    attribute = f"{kind}_function"
    if strategy is None:
        return original(model, force)
    if getattr(model, attribute) is not None and not force:
        return getattr(model, attribute)

    def build():
        # Building sets the model's attribute to the bare function; whatever was there (this
        # dispatcher, or a callback's wrapper of it) stays.
        current = getattr(model, attribute)
        try:
            return _build_step(model, kind, original, strategy)
        finally:
            setattr(model, attribute, current)

    dispatch = _per_input_kind(build, strategy, kind)
    setattr(model, attribute, dispatch)
    return dispatch


def _per_input_kind(build, strategy, kind):
    """A step function that traces one ``build()`` per kind of distributed iterator: with or
    without the workers' per-step end-of-data agreement (tfdp.data turns it off where every
    worker has the same steps). TensorFlow's iterator type ignores that difference, so one
    traced function would run an input that needs the agreement without it: a worker that
    runs out first would leave the others waiting in the step's all-reduce. Each call runs
    under the strategy's step deadline (tfdp.strategy.deadline), the first one per function longer.

    Grappler optimises the step's graph in one pass of its optimisers, without TFG
    (``_tf_private.one_pass_graph_optimization``): a distributed step holds every replica's
    copy of the model, and the default second pass and TFG pipeline cost a fifth of the
    first step and gained nothing measurable in the steps after it (8 CPU replicas, ZeRO-3,
    80 Dense units: first step 89.6 -> 72.4 s, step 254 -> 257 ms; 4 replicas, a KerasHub
    GPT-2 of 4 blocks: 32.0 and 37.0 -> 28.0 and 26.9 s, step 257 and 274 -> 291 and 256 ms;
    docs/zero.md, "Trace time")."""
    functions = {}
    what = "a training step" if kind == "train" else "an evaluation step"

    def step_function(iterator):
        key = _tf_private.end_of_data_agreement(iterator)
        function = functions.get(key)
        first = function is None  # traces now: the longer, first-step deadline
        if first:
            function = functions[key] = build()
        with deadline.watching(strategy, what, first=first), \
                _tf_private.one_pass_graph_optimization():
            return function(iterator)

    return step_function


def _watched_predict(function, strategy):
    """Keras's predict function under the step deadline (several workers): its collectives
    (ZeRO-3's gathers, a metric) wait for every worker, so a worker that never predicts, or
    predicts fewer batches, ends the others' predict with an error instead of a hang."""
    first = [True]

    def predict_function(iterator):
        with deadline.watching(strategy, "a prediction step", first=first[0]):
            first[0] = False
            return function(iterator)

    predict_function._tfdp_watched = True
    return predict_function


def _build_step(model, kind, original, strategy):
    """The step function Keras (plan "keras") or tfdp's XLA split builds; returns it."""
    attribute = f"{kind}_function"
    keras_step = _keras_step(model, f"{kind}_step")
    units = zero3_config_of(strategy).gathers_per_unit
    plan = step_plan(bool(model.jit_compile), strategy.num_replicas_in_sync, keras_step, units)
    ride_logs = rides_metrics(kind, _tf_private.extended_num_workers(strategy.extended),
                              keras_step)
    # Plan "keras" with several workers never compiles (several replicas), so riding logs
    # there means tfdp's riding step without XLA.
    if plan == "keras" and not ride_logs:
        original(model, True)
        return getattr(model, attribute)
    if plan == "no_xla":
        _warn_once((type(model), kind),
                   "tfdp: %s overrides %s_step, which tfdp cannot split into a compiled "
                   "per-replica part and the cross-replica reduction, so it runs without XLA "
                   "(jit_compile=True would compile the collectives). Use "
                   "tfdp.compile_gradients inside it for XLA.", type(model).__name__, kind)
    step = None
    if plan == "units":
        step = _units_step(model, kind, ride_logs)
    elif plan == "split":
        step = _train_step(model, ride_logs) if kind == "train" else _test_step(model)
    elif plan == "keras":  # without XLA, the logs riding with the gradients
        step = _riding_train_step(model)
    jit_compile = model.jit_compile
    model.jit_compile = False  # the outer, distributed step is not compiled
    try:
        if step is None:
            original(model, True)
        else:
            setattr(model, attribute, _tf_private.keras_make_step_function(model, step))
    finally:
        model.jit_compile = jit_compile
    return getattr(model, attribute)


def install_keras_hooks():
    """Installs tfdp's XLA handling into Keras (idempotent; called by DataParallelStrategy).

    Under any other strategy, or none, Keras behaves exactly as before.
    """

    def make_resolve(original):
        def _resolve_auto_jit_compile(self):
            strategy = _tfdp_strategy_of(self)
            if strategy is None:
                return original(self)
            return resolve_auto_jit_compile(
                strategy.extended._tfdp_device_type,  # tfdp's own
                _tf_private.keras_model_supports_jit(self), strategy.num_replicas_in_sync,
                _keras_step(self, "train_step") and _keras_step(self, "test_step"))
        return _resolve_auto_jit_compile

    def make_train(original):
        def make_train_function(self, force=False):
            return _make_step_function(self, "train", original, force)
        return make_train_function

    def make_test(original):
        def make_test_function(self, force=False):
            return _make_step_function(self, "test", original, force)
        return make_test_function

    def make_predict(original):
        def make_predict_function(self, force=False):
            # Keras sets self.predict_function (and returns it only when it was there).
            function = original(self, force) or self.predict_function
            strategy = _tfdp_strategy_of(self)
            if (strategy is None or getattr(function, "_tfdp_watched", False)
                    or not strategy.cluster.is_multi_worker):
                return function
            self.predict_function = _watched_predict(function, strategy)
            return self.predict_function
        return make_predict_function

    _tf_private.patch_keras_auto_jit_compile(make_resolve)
    _tf_private.patch_keras_step_functions(make_train, make_test, make_predict)
