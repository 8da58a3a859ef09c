"""ZeRO-3's units: which layers gather their parameters together, and for how long.

Rule. With ``shard_parameters=True`` and ``reshard_after_forward=True`` (the default), a
*unit* runs under a custom gradient (``Unit``). Its forward pass gathers its parameters,
computes its outputs and keeps nothing gathered (``Unit.forward``: the custom gradient's
inputs are the slices, so the gathered tensors are released when the forward pass ends); its
backward pass, once the gradients of its outputs exist, gathers the parameters again,
recomputes the unit's forward pass under a tape, and returns the gradients of its inputs and of
its parameters' slices (reduce-scattered inside the gather's own gradient:
``Unit.backward``). A unit's forward gathers start only after the unit two before it has
produced its outputs (``Trace.prefetch_gate``): while one unit computes, the next one's
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

Under XLA (``jit_compile=True``, or tfdp's default on GPUs) each unit is compiled on its own
(units_xla.py): its gathers and reduce-scatters run outside XLA, between the units, and two
XLA programs per unit compute its forward and backward pass from the gathered parameters
passed in as arguments; the forward program keeps the unit's activations, so the backward
pass re-gathers the parameters without recomputing the forward pass
(``checkpoint_activations=True``: compiled units recompute too, keeping only their inputs).

Sharded parameters read outside any unit (``reshard_after_forward=False``, a layer that is
not pure, a custom loop running eagerly, ``tfdp.compile_gradients``, which reads parameters
before its compiled part) are gathered where they are read and kept until the backward pass
has used them; results are the same, the peak holds more.
"""

from __future__ import annotations

import logging
import threading

import tensorflow as tf

from tfdp import _tf_private, said_once
from tfdp.strategy.zero3 import units_xla
from tfdp.strategy.zero3.config import config_of
from tfdp.strategy.zero3.layout import is_sharded, reading_given_slices

__all__ = ["install_keras_hooks", "is_unit", "Unit", "Trace", "PREFETCH_DEPTH"]

log = logging.getLogger("tfdp")

# How many units ahead of the one computing may gather: a unit's gathers wait for the outputs
# of the unit PREFETCH_DEPTH + 1 before it.
PREFETCH_DEPTH = 1

# Per replica (each replica traces its step in a thread of its own): how deep inside units the
# current call is, and the trace of the graph being built.
_state = threading.local()


def _named(layer, unit_layers) -> bool:
    for item in unit_layers:
        if isinstance(item, str):
            if any(c.__name__ == item for c in type(layer).__mro__):
                return True
        elif isinstance(layer, item):
            return True
    return False


def is_unit(layer, unit_layers=()) -> bool:
    """Whether ``layer`` is a unit under the rule above (its weights must exist).

    Args:
        layer: a built Keras layer.
        unit_layers: the strategy's ``unit_layers`` (classes or class names).
    """
    named = _named(layer, unit_layers)
    if not named and not any(is_sharded(v) for v in _tf_private.own_trainable_variables(layer)):
        return False
    if not any(is_sharded(v) for v in layer.trainable_variables):
        return False
    if layer.non_trainable_variables:
        if named and said_once.first_time("unit_layers", type(layer).__name__):
            log.warning("tfdp: %s is named in unit_layers but holds non-trainable state "
                        "(BatchNorm statistics or a random seed), which recomputing it in the "
                        "backward pass would update twice; its sublayers are units instead.",
                        type(layer).__name__)
        return False
    return True


def _active_config():
    """The ZeRO-3 settings whose units apply to the current call, or None."""
    if tf.executing_eagerly() or getattr(_state, "depth", 0):
        return None
    if _tf_private.in_keras_stateless_scope() or _tf_private.in_keras_symbolic_scope():
        return None
    if tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy():
        return None
    config = config_of(tf.distribute.get_strategy())
    return config if config.gathers_per_unit else None


class Trace(object):
    """The units traced so far into one graph by one replica, for the prefetch."""

    def __init__(self, graph):
        self.graph = graph
        self._outputs = []  # each unit's first output, in trace order

    @classmethod
    def current(cls) -> "Trace":
        """This replica's trace of the graph being built (a new one for a new graph)."""
        graph = tf.compat.v1.get_default_graph()
        trace = getattr(_state, "trace", None)
        if trace is None or trace.graph is not graph:
            trace = _state.trace = cls(graph)
        return trace

    def prefetch_gate(self):
        """What the next unit's gathers wait for: the output of the unit PREFETCH_DEPTH + 1
        before it (None: start at once)."""
        if len(self._outputs) <= PREFETCH_DEPTH:
            return None
        return self._outputs[-(PREFETCH_DEPTH + 1)]

    def finished(self, output) -> None:
        """A unit has produced ``output`` (its first)."""
        self._outputs.append(output)


def _as_dense(t):
    return tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t


def _sharded_containers(layer) -> list:
    """The layer's sharded variables' containers, each once (a layer may list a shared
    variable twice)."""
    containers = []
    for variable in layer.trainable_variables:
        container = _tf_private.sharded_container(variable)
        if container is not None and all(container is not c for c in containers):
            containers.append(container)
    return containers


class Unit(object):
    """One call of a unit layer in a replica's traced step (see the module's rule).

    Args:
        layer: the unit's layer.
        original: Keras's ``Layer.__call__``.
        args: the call's positional arguments.
        kwargs: its keyword arguments.
        checkpoint_activations: the strategy's Zero3Config.checkpoint_activations (a compiled
            unit recomputes its forward pass rather than keeping activations).
    """

    def __init__(self, layer, original, args, kwargs, checkpoint_activations=False):
        self.layer, self.original, self.args, self.kwargs = layer, original, args, kwargs
        self.checkpoint_activations = checkpoint_activations
        self.flat = tf.nest.flatten((args, kwargs))
        self.positions = [i for i, v in enumerate(self.flat) if isinstance(v, tf.Tensor)]
        self.inputs = [self.flat[i] for i in self.positions]
        self.containers = _sharded_containers(layer)
        self.specs = [c.tfdp_spec for c in self.containers]
        self.structure = None  # the outputs' nest, known once forward has run
        self.saved = None  # what a compiled unit's backward program reads (units_xla)
        self.num_losses = 0  # the losses a compiled unit's layer added (outputs, last)
        self.compiled = (units_xla.CompiledUnit(self) if units_xla.compiles_units()
                         and units_xla.compilable(layer, self.inputs) else None)

    def read_slices(self, gate):
        """This replica's slices of the unit's parameters, read once ``gate``
        (``Trace.prefetch_gate``, or None) exists: the forward pass's gathers start from them,
        so they start no earlier than the prefetch allows."""
        replica = _tf_private.current_replica_id()
        with tf.control_dependencies([] if gate is None else [gate]):
            return [c.components[replica].value() for c in self.containers]

    def call_inside(self, tensors, reads):
        """The layer's own call on ``tensors`` (at the call's tensor positions), its weights
        read as ``reads`` (a context manager) says, as part of this unit: the layers it calls
        are not units of their own."""
        values = list(self.flat)
        for i, t in zip(self.positions, tensors):
            values[i] = t
        call_args, call_kwargs = tf.nest.pack_sequence_as((self.args, self.kwargs), values)
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            with reads:
                return self.original(self.layer, *call_args, **call_kwargs)
        finally:
            _state.depth -= 1

    def gather(self, slice_values):
        """The reads under which the layer's sharded weights are whole tensors all-gathered
        from ``slice_values`` (each read gathers; its gradient is the reduce-scatter)."""
        return reading_given_slices(dict(zip(self.specs, slice_values)))

    def forward(self, tensors, slice_values):
        """``(outputs, losses)``: the unit's outputs from its inputs and slices, the parameters
        gathered inside (compiled: just before the program), and the losses a compiled unit's
        layer added (uncompiled, Keras adds them to the layer itself: ``[]``). The release is
        the custom gradient's boundary: its inputs are the slices, so nothing gathered
        outlives this call."""
        if self.compiled is not None:
            return self.compiled(tensors, slice_values)
        return self.call_inside(tensors, self.gather(slice_values)), []

    def first_forward(self, tensors, slice_values):
        """``forward``, where a compiled unit also keeps what its backward program reads (its
        activations, never its gathered parameters: units_xla.CompiledUnit.forward), so that
        its backward pass does not recompute it."""
        if self.compiled is not None and not self.checkpoint_activations:
            out, self.saved = self.compiled.forward(tensors, slice_values)
            return out
        if self.compiled is not None:
            units_xla.backward_kinds.setdefault(self.layer, set()).add("recomputed")
        return self.forward(tensors, slice_values)

    def backward(self, all_inputs, outputs, dys, variables):
        """The gradients of the unit's inputs (tensors, then slices) and of ``variables`` (its
        other weights): the slices are gathered again once the outputs' gradients exist, and
        the forward pass recomputed under a tape.

        Args:
            all_inputs: the custom gradient's inputs (the call's tensors, then the slices).
            outputs: the forward pass's flat outputs.
            dys: their gradients (None where an output has none).
            variables: the other variables the forward pass read (TensorFlow passes them).
        """
        dys = [tf.zeros_like(o) if d is None else _as_dense(d) for o, d in zip(outputs, dys)]
        variables = list(variables or [])
        with tf.control_dependencies(dys):  # gather again only once the outputs' gradients exist
            again_inputs = [tf.identity(t) for t in all_inputs]
        n = len(self.inputs)
        # Where this gradient is itself being recorded (a gradient penalty: an outer or
        # persistent tape), the kept activations would enter it as constants: recompute.
        if self.saved is not None and not _tf_private.tape_is_recording():
            return self.compiled.backward(self.saved, all_inputs[:n], again_inputs[n:], dys,
                                          variables)
        if self.saved is not None:
            units_xla.backward_kinds.setdefault(self.layer, set()).add("recomputed")
        with tf.GradientTape() as tape:
            tape.watch([t for t in again_inputs if t.dtype.is_floating])
            again = tf.nest.flatten(self.forward(again_inputs[:n], again_inputs[n:]))
        grads = tape.gradient(again, again_inputs + variables, output_gradients=dys)
        return grads[:len(all_inputs)], grads[len(all_inputs):]

    def __call__(self):
        """Runs the unit in the current replica's trace; returns the layer's outputs."""
        trace = Trace.current()
        slices = self.read_slices(trace.prefetch_gate())
        n = len(self.inputs)

        @tf.custom_gradient
        def unit(*all_inputs):
            out, losses = self.first_forward(all_inputs[:n], all_inputs[n:])
            self.structure, self.num_losses = out, len(losses)
            outputs = tf.nest.flatten((out, losses))  # the losses last

            def grad(*dys, variables=None):
                return self.backward(all_inputs, outputs, dys, variables)

            return outputs, grad

        outputs = unit(*(self.inputs + slices))
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        cut = len(outputs) - self.num_losses
        for loss in outputs[cut:]:  # a compiled unit's added losses join the model's
            self.layer.add_loss(loss)
        trace.finished(outputs[0])
        return tf.nest.pack_sequence_as(self.structure, outputs[:cut])


def install_keras_hooks():
    """Routes the call of every unit through ``Unit`` (idempotent)."""
    def make(original):
        def __call__(self, *args, **kwargs):
            config = _active_config()
            if config is None or not getattr(self, "built", False) or not is_unit(
                    self, config.unit_layers):
                return original(self, *args, **kwargs)
            return Unit(self, original, args, kwargs, config.checkpoint_activations)()
        return __call__

    _tf_private.patch_keras_layer_call(make)
