"""Units of ZeRO-3: which layers gather their parameters together, and for how long.

Rule. With ``shard_parameters=True`` and ``reshard_after_forward=True`` (the default), a
*unit* runs under a custom gradient. Its forward pass gathers its parameters, computes its
outputs and keeps nothing gathered; its backward pass, once the gradients of its outputs
exist, gathers the parameters again, recomputes the unit's forward pass under a tape, and
returns the gradients of its inputs and of its parameters' slices (reduce-scattered inside
the gather's own gradient). A unit's forward gathers start only after the unit two before it
has produced its outputs (a control dependency): while one unit computes, the next one's
parameters may already be gathering (prefetch of depth one), so a replica holds the gathered
parameters of about two units at a time, in the forward pass and in the backward pass alike.
This is FSDP's ``reshard_after_forward=True`` with the backward re-gather done by
recomputation, because a TensorFlow graph keeps every tensor a gradient function reads.

A unit is, by default, a layer that owns sharded weights (Dense, Conv, Embedding,
EinsumDense). ``unit_layers=`` names layer classes (or class names) to treat as one unit each,
such as a transformer block: one gather for all its weights. A layer is a unit only if its
output is a pure function of its inputs and its trainable weights: without non-trainable
state (BatchNorm statistics, a Dropout's seed generator), because the recomputation must not
draw or update again. A named class that is not pure is not a unit, its sublayers are (tfdp
warns once). Units nest: inside a unit, layers are part of it.

Under XLA (``jit_compile=True``, or tfdp's default on GPUs) each unit is compiled on its own:
its gathers and reduce-scatters run outside XLA, between the units, and one XLA program per
unit computes its forward pass (and, differentiated, the recomputation of its backward pass)
from the gathered parameters passed in as arguments. So a replica holds what it holds without
XLA (its slices, about two units' gathered parameters, one unit's whole gradient), where
compiling the whole step would take every gathered parameter as an argument at once (2.85x
the theory's memory on a GPU, docs/zero.md). Why per unit: XLA cannot compile collectives
across CPU replicas or across several GPUs of one process, and a program cannot free its
arguments before it ends. What lies outside every unit (the loss, metrics, layers without
sharded weights or that are not pure) runs without XLA; tfdp says so once.

Sharded parameters read outside any unit (``reshard_after_forward=False``, a layer that is
not pure, a custom loop running eagerly, ``tfdp.compile_gradients``, which reads parameters
before its compiled part) are gathered where they are read and kept until the backward pass
has used them; results are the same, the peak holds more.
"""

from __future__ import annotations

import logging
import threading
import weakref

import keras
import tensorflow as tf

from tfdp import _tf_private, said_once
from tfdp.strategy import sharded_parameters

__all__ = ["install_keras_hooks", "is_unit", "resolve_unit_layers", "compile_units_here",
           "compiles_units"]

log = logging.getLogger("tfdp")

# Per replica (each replica traces its step in a thread of its own): how deep inside units the
# current call is, and the outputs of the last units of the graph being traced.
_state = threading.local()


# The step graphs whose units are compiled (a train or test step traced under XLA, xla.py):
# each replica traces its part of the step in a thread of its own, into the same graph.
_compiling_graphs = weakref.WeakSet()


def compile_units_here():
    """Units traced from now on into the current graph (a step being traced) are compiled by
    XLA, each on its own (see the module's rule)."""
    _compiling_graphs.add(tf.compat.v1.get_default_graph())


def compiles_units() -> bool:
    """Whether units traced into the current graph are compiled."""
    return tf.compat.v1.get_default_graph() in _compiling_graphs


def resolve_unit_layers(unit_layers) -> tuple:
    """``unit_layers`` as a tuple of Keras layer classes or class names; checked. Pure."""
    if unit_layers is None:
        return ()
    if isinstance(unit_layers, (str, type)):
        unit_layers = (unit_layers,)
    out = []
    for item in unit_layers:
        if isinstance(item, str) or (isinstance(item, type)
                                     and issubclass(item, keras.layers.Layer)):
            out.append(item)
        else:
            raise ValueError(f"unit_layers: {item!r} is neither a Keras layer class nor a "
                             "class name; pass e.g. unit_layers=(TransformerBlock,) or "
                             "unit_layers=('TransformerBlock',).")
    return tuple(out)


def _named(layer, unit_layers) -> bool:
    for item in unit_layers:
        if isinstance(item, str):
            if any(c.__name__ == item for c in type(layer).__mro__):
                return True
        elif isinstance(layer, item):
            return True
    return False


def is_unit(layer, unit_layers=()) -> bool:
    """Whether ``layer`` is a unit under the rule above (its weights must exist)."""
    named = _named(layer, unit_layers)
    if not named and not any(sharded_parameters.is_sharded(v)
                             for v in _tf_private.own_trainable_variables(layer)):
        return False
    if not any(sharded_parameters.is_sharded(v) for v in layer.trainable_variables):
        return False
    if layer.non_trainable_variables:
        if named and said_once.first_time("unit_layers", type(layer).__name__):
            log.warning("tfdp: %s is named in unit_layers but holds non-trainable state "
                        "(BatchNorm statistics or a random seed), which recomputing it in the "
                        "backward pass would update twice; its sublayers are units instead.",
                        type(layer).__name__)
        return False
    return True


def _active_strategy():
    """The strategy whose units apply to the current call, or None."""
    if tf.executing_eagerly() or getattr(_state, "depth", 0):
        return None
    if _tf_private.in_keras_stateless_scope() or _tf_private.in_keras_symbolic_scope():
        return None
    if tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if not getattr(strategy, "shard_parameters", False):
        return None
    if not getattr(strategy, "reshard_after_forward", True):
        return None
    return strategy


def _recent_outputs():
    """The outputs of the last units traced into the current graph, in this replica."""
    graph = tf.compat.v1.get_default_graph()
    if getattr(_state, "graph", None) is not graph:
        _state.graph, _state.recent = graph, []
    return _state.recent


def _as_dense(t):
    return tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t


def _call_as_unit(layer, original, args, kwargs):
    flat = tf.nest.flatten((args, kwargs))
    positions = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor)]
    recent = _recent_outputs()
    after = recent[-2] if len(recent) >= 2 else None  # prefetch of depth one
    # The unit's sharded parameters enter its custom gradient as inputs (this replica's
    # slices, read here): their gradients are then ordinary input gradients.
    replica = _tf_private.current_replica_id()
    containers = []  # each once, also when a layer lists a shared variable twice
    for variable in layer.trainable_variables:
        container = _tf_private.sharded_container(variable)
        if container is not None and all(container is not c for c in containers):
            containers.append(container)
    specs = [c.tfdp_spec for c in containers]
    with tf.control_dependencies([] if after is None else [after]):
        slices = [c.components[replica].value() for c in containers]
    inputs = [flat[i] for i in positions]
    built = {}
    compiled = (_compiled_call(layer, original, flat, positions, args, kwargs, containers)
                if compiles_units() and _compilable(layer, inputs) else None)

    def run(tensors, slice_values):
        if compiled is not None:
            return compiled(tensors, slice_values)
        reads = sharded_parameters.reading_given_slices(dict(zip(specs, slice_values)))
        return _call_inside_unit(layer, original, flat, positions, args, kwargs, tensors, reads)

    @tf.custom_gradient
    def unit(*all_inputs):
        tensors, slice_values = all_inputs[:len(inputs)], all_inputs[len(inputs):]
        out = run(tensors, slice_values)
        built["structure"] = out
        outputs = tf.nest.flatten(out)

        def grad(*dys, variables=None):
            dys = [tf.zeros_like(o) if d is None else _as_dense(d) for o, d in zip(outputs, dys)]
            variables = list(variables or [])
            with tf.control_dependencies(dys):  # gather again only once the outputs' gradients exist
                again_inputs = [tf.identity(t) for t in all_inputs]
            with tf.GradientTape() as tape:
                tape.watch([t for t in again_inputs if t.dtype.is_floating])
                again = tf.nest.flatten(run(again_inputs[:len(inputs)],
                                            again_inputs[len(inputs):]))
            grads = tape.gradient(again, again_inputs + variables, output_gradients=dys)
            return grads[:len(all_inputs)], grads[len(all_inputs):]

        return outputs, grad

    outputs = unit(*(inputs + slices))
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    recent.append(outputs[0])
    return tf.nest.pack_sequence_as(built["structure"], list(outputs))


def _call_inside_unit(layer, original, flat, positions, args, kwargs, tensors, reads):
    """The layer's own call on ``tensors`` (in the call's tensor ``positions`` of ``flat``),
    its weights read as ``reads`` (a context manager) says, as part of a unit: the layers it
    calls are not units of their own."""
    values = list(flat)
    for i, t in zip(positions, tensors):
        values[i] = t
    call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with reads:
            return original(layer, *call_args, **call_kwargs)
    finally:
        _state.depth -= 1


# layer -> {the call's static part: its XLA-compiled call}: every replica's trace of a unit
# (and its backward recomputation) calls one tf.function, traced once.
_compiled_calls = weakref.WeakKeyDictionary()


def _static_key(args, kwargs, flat, positions):
    """What a compiled call is traced for besides its tensors' types: where every argument
    sits in the call's structure (``f(x, mask=m)`` is not ``f(x, m)``) and the value of each
    non-tensor one. None where one cannot be hashed: no sharing between calls."""
    structure = repr(tf.nest.map_structure(lambda _: 0, (args, kwargs)))
    try:
        key = (structure, tuple((i, v) for i, v in enumerate(flat) if i not in positions))
        hash(key)
        return key
    except TypeError:
        return None


def _compilable(layer, tensors) -> bool:
    """Whether a unit's call can run as its own XLA program: not where an input carries a
    Keras mask (a traced function's arguments do not), the layer adds an activity
    regularizer's loss (a stateless scope keeps no losses) or an input is integer (ids: an
    Embedding's lookup, whose gradient is sparse rows; a compiled program returns them without
    the graph that tells per-example lookups from lookups shared by the batch, so they could
    not be reduced as one device has them, sparse_gradients.py); those run uncompiled (said
    once)."""
    masked = any(getattr(t, "_keras_mask", None) is not None for t in tensors)
    ids = any(t.dtype.is_integer for t in tensors)
    if not masked and not ids and getattr(layer, "activity_regularizer", None) is None:
        return True
    if said_once.first_time("uncompiled_unit", type(layer).__name__):
        log.info("tfdp: ZeRO-3 under XLA: %s runs uncompiled (%s).", type(layer).__name__,
                 "an input carries a Keras mask" if masked
                 else "it is called on integer ids: a lookup, whose gradient is sparse" if ids
                 else "it has an activity regularizer")
    return False


def _compiled_call(layer, original, flat, positions, args, kwargs, containers):
    """``run(tensors, slice_values)`` for a compiled unit: gathers the slices (outside XLA; the
    gather's gradient is the reduce-scatter) and reads the unit's other weights, then calls
    one XLA program that computes the layer from them (it reads no variable: a
    ``keras.StatelessScope`` maps each weight to its value)."""
    weights = []  # each once, also when a layer lists a shared variable twice
    for variable in layer.trainable_variables:
        if all(variable is not w for w in weights):
            weights.append(variable)
    sharded = {id(c): i for i, c in enumerate(containers)}
    owner = [sharded.get(id(_tf_private.sharded_container(w))) for w in weights]
    key = _static_key(args, kwargs, flat, positions)
    calls = _compiled_calls.setdefault(layer, {})
    function = calls.get(key) if key is not None else None
    if function is None:
        def compute(tensors, weight_values):
            reads = keras.StatelessScope(state_mapping=list(zip(weights, weight_values)))
            return _call_inside_unit(layer, original, flat, positions, args, kwargs, tensors,
                                     reads)

        function = tf.function(compute, jit_compile=True, autograph=False)
        if key is not None:
            calls[key] = function
    specs = [c.tfdp_spec for c in containers]

    def run(tensors, slice_values):
        weight_values = [
            tf.convert_to_tensor(w.value) if i is None
            else sharded_parameters.gather_slice(slice_values[i], specs[i])
            for w, i in zip(weights, owner)]
        return function(list(tensors), weight_values)

    return run


def install_keras_hooks():
    """Routes the call of every unit through ``_call_as_unit`` (idempotent)."""
    def make(original):
        def __call__(self, *args, **kwargs):
            strategy = _active_strategy()
            if strategy is None or not getattr(self, "built", False) or not is_unit(
                    self, strategy.unit_layers):
                return original(self, *args, **kwargs)
            return _call_as_unit(self, original, args, kwargs)
        return __call__

    _tf_private.patch_keras_layer_call(make)
