"""ZeRO-3's units under XLA: each unit its own program, its collectives outside it.

Rule. In a step traced under XLA (``jit_compile=True``, or tfdp's default on GPUs; xla.py's
plan ``"units"`` calls ``compile_units_here``) each unit (units.py) is compiled on its own:
its gathers and reduce-scatters run outside XLA, between the units, and two XLA programs per
unit compute its forward pass and its backward pass from the gathered parameters passed in as
arguments (``CompiledUnit``). The forward program also returns the values its gradient reads
(activations inside the unit, never the parameters): the backward program runs on them and on
the parameters gathered again, so the backward pass does not recompute the forward pass
(FSDP's order). A unit where such a value would be computed from its parameters alone (other
than a cast, reshape or transpose of one, applied again to the re-gathered parameter) keeps
nothing and recomputes its forward pass instead. So a replica holds
what it holds without XLA (its slices, about two units' gathered parameters, one unit's whole
gradient), where compiling the whole step would take every gathered parameter as an argument
at once (2.85x the theory's memory on a GPU, docs/zero.md). Why per unit: XLA cannot compile
collectives across CPU replicas or across several GPUs of one process, and a program cannot
free its arguments before it ends. What lies outside every unit (the loss, metrics, layers
without sharded weights or that are not pure) runs without XLA; tfdp says so once. A unit
called on integer ids or on a masked input runs uncompiled (``compilable``). The losses a unit
adds (``add_loss``, an activity regularizer) are outputs of its program and join the model's
losses outside it.
"""

from __future__ import annotations

import logging
import weakref

import keras
import tensorflow as tf

from tfdp import _tf_private, said_once
from tfdp.strategy.zero3 import gradients

__all__ = ["compile_units_here", "compiles_units", "compilable", "CompiledUnit", "static_key",
           "compiled_calls", "backward_kinds"]

log = logging.getLogger("tfdp")

# The step graphs whose units are compiled (a train or test step traced under XLA, xla.py):
# each replica traces its part of the step in a thread of its own, into the same graph.
_compiling_graphs = weakref.WeakSet()

# layer -> {the call's static part (static_key): its XLA-compiled call}: every replica's trace
# of a unit (and its backward recomputation) calls one tf.function, traced once. Public so that
# a test can see which layers were compiled.
compiled_calls = weakref.WeakKeyDictionary()

# layer -> how its compiled unit's backward passes ran: {"kept"} (the backward program on what
# the forward program kept), {"recomputed"} (the forward pass computed again), or both.
# Public so that a test can see which.
backward_kinds = weakref.WeakKeyDictionary()


def compile_units_here():
    """Units traced from now on into the current graph (a step being traced) are compiled by
    XLA, each on its own (see the module's rule)."""
    _compiling_graphs.add(tf.compat.v1.get_default_graph())


def compiles_units() -> bool:
    """Whether units traced into the current graph are compiled."""
    return tf.compat.v1.get_default_graph() in _compiling_graphs


def static_key(args, kwargs, flat, positions):
    """What a compiled call is traced for besides its tensors' types: where every argument
    sits in the call's structure (``f(x, mask=m)`` is not ``f(x, m)``) and the value of each
    non-tensor one. None where one cannot be hashed: no sharing between calls.

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments.
        flat: ``tf.nest.flatten((args, kwargs))``.
        positions: the indices of ``flat`` that are tensors.
    """
    structure = repr(tf.nest.map_structure(lambda _: 0, (args, kwargs)))
    try:
        key = (structure, tuple((i, v) for i, v in enumerate(flat) if i not in positions))
        hash(key)
        return key
    except TypeError:
        return None


def compilable(layer, tensors) -> bool:
    """Whether a unit's call can run as its own XLA program: not where an input carries a
    Keras mask (a traced function's arguments do not) or an input is integer (ids: an
    Embedding's lookup, whose gradient is sparse rows; a compiled program returns them without
    the graph that tells per-example lookups from lookups shared by the batch, so they could
    not be reduced as one device has them, sparse_gradients.py); those run uncompiled (said
    once).

    Args:
        layer: the unit's layer.
        tensors: the call's tensor inputs.
    """
    masked = any(getattr(t, "_keras_mask", None) is not None for t in tensors)
    ids = any(t.dtype.is_integer for t in tensors)
    if not masked and not ids:
        return True
    if said_once.first_time("uncompiled_unit", type(layer).__name__):
        log.info("tfdp: ZeRO-3 under XLA: %s runs uncompiled (%s).", type(layer).__name__,
                 "an input carries a Keras mask" if masked
                 else "it is called on integer ids: a lookup, whose gradient is sparse")
    return False


def _distinct(variables) -> list:
    out = []  # each once, also when a layer lists a shared variable twice
    for variable in variables:
        if all(variable is not w for w in out):
            out.append(variable)
    return out


class CompiledUnit(object):
    """A unit's forward pass as one XLA program: ``self(tensors, slice_values)`` gathers the
    slices (outside XLA; the gather's gradient is the reduce-scatter) and reads the unit's
    other weights, then calls the program, which computes the layer from them (it reads no
    variable: a ``keras.StatelessScope`` maps each weight to its value) and returns
    ``(outputs, the losses the layer added)``.

    Args:
        unit: the units.Unit being called (its layer, call and sharded containers).
    """

    def __init__(self, unit):
        self.layer = unit.layer
        self.weights = _distinct(unit.layer.trainable_variables)
        sharded = {id(c): i for i, c in enumerate(unit.containers)}
        # For each weight: the index of its slice among the unit's, or None (not sharded).
        self.owner = [sharded.get(id(_tf_private.sharded_container(w))) for w in self.weights]
        self.specs = list(unit.specs)
        self.function = self._function_for(unit)

    def _function_for(self, unit):
        """The layer's compiled call for this call's static part (shared by every replica's
        trace and the backward recomputation)."""
        key = static_key(unit.args, unit.kwargs, unit.flat, unit.positions)
        calls = compiled_calls.setdefault(unit.layer, {})
        function = calls.get(key) if key is not None else None
        if function is None:
            weights = self.weights

            def compute(tensors, weight_values):
                # The losses the layer adds (add_loss, an activity regularizer) are returned
                # with its outputs, so that they join the model's loss outside the program.
                reads = keras.StatelessScope(state_mapping=list(zip(weights, weight_values)),
                                             collect_losses=True)
                outputs = unit.call_inside(tensors, reads)
                return outputs, list(reads.losses)

            function = tf.function(compute, jit_compile=True, autograph=False)
            if key is not None:
                calls[key] = function
        return function

    def weight_values(self, slice_values) -> list:
        """The unit's weights as the program takes them: each sharded one all-gathered from
        its slice (the gather's gradient is the reduce-scatter), the others read."""
        return [tf.convert_to_tensor(w.value) if i is None
                else gradients.gather_slice(slice_values[i], self.specs[i])
                for w, i in zip(self.weights, self.owner)]

    def __call__(self, tensors, slice_values):
        return self.function(list(tensors), self.weight_values(slice_values))

    def forward(self, tensors, slice_values):
        """The unit's outputs, and what its backward pass will read (None: it recomputes).

        The forward program is TensorFlow's split of the compiled call (``_tf_private.
        SplitGradient``): it also returns the values its gradient reads (activations inside
        the unit), so the backward program runs on them and on the parameters gathered again,
        without recomputing the forward pass. A value it reads that is a parameter through
        casts, reshapes and transposes (``_tf_private.PASS_THROUGH_OPS``) is applied again to
        the re-gathered parameter, not kept. Where another value it would keep is computed
        from the parameters alone (a normalised kernel), keeping it would keep a copy of the
        gathered parameters: such a unit recomputes its forward pass instead (said once).
        """
        tensors = list(tensors)
        values = self.weight_values(slice_values)
        concrete = self.function.get_concrete_function(tensors, values)
        split = _tf_private.split_gradient(concrete)
        structure = concrete.structured_outputs
        n = len(tensors)
        why = ("it returns something other than tensors"
               if len(tf.nest.flatten(structure)) != split.num_outputs
               else "it reads a trainable variable that is not one of its weights"
               if any(v.trainable for v in concrete.graph.variables)
               else "a value its gradient reads is computed from its parameters alone; "
               "keeping it would keep them gathered"
               if split.kept_reading_only(range(n, n + len(values))) else None)
        if why is not None:
            if said_once.first_time("recomputed_unit", type(self.layer).__name__):
                log.info("tfdp: ZeRO-3 under XLA: %s recomputes its forward pass in its "
                         "backward pass (%s).", type(self.layer).__name__, why)
            backward_kinds.setdefault(self.layer, set()).add("recomputed")
            return self.function(tensors, values), None
        outputs, kept = split.forward(tensors + values)
        return tf.nest.pack_sequence_as(structure, outputs), (split, kept)

    def backward(self, saved, tensors, slice_values, output_gradients, variables):
        """The gradients of the unit's tensors, its slices and ``variables`` (its weights that
        are not sharded) from ``forward``'s saved values, the parameters gathered again from
        ``slice_values``: (inputs' gradients: tensors then slices, variables' gradients)."""
        split, kept = saved
        backward_kinds.setdefault(self.layer, set()).add("kept")
        with tf.GradientTape() as tape:
            tape.watch(slice_values)
            values = self.weight_values(slice_values)
        grads = split.backward(output_gradients, list(tensors) + values, kept)
        n = len(tensors)
        d_tensors, d_values = grads[:n], grads[n:n + len(values)]
        reached = [(v, d) for v, d in zip(values, d_values) if d is not None]
        sources = list(slice_values) + list(variables)
        d_sources = (tape.gradient([v for v, _ in reached], sources,
                                   output_gradients=[d for _, d in reached])
                     if reached else [None] * len(sources))
        m = len(slice_values)
        return list(d_tensors) + list(d_sources[:m]), list(d_sources[m:])
