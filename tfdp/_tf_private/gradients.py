"""TensorFlow's gradient functions: which lookup each row of a sparse gradient comes from, and a
traced function's forward and backward programs.

tfdp reduces a ``tf.IndexedSlices`` gradient as one device would have built it
(tfdp/strategy/sparse_gradients.py), and that depends on the lookups behind its rows: one row
per id of each lookup, in the lookups' order. No public API says which lookups a gradient's
rows come from; the graph that TensorFlow's registered gradient functions build does.

ZeRO-3's compiled units (tfdp/strategy/zero3/units_xla.py) run a unit's backward program on
parameters gathered again, fed with what its forward program kept (``SplitGradient``).
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf
from tensorflow.python.eager import backprop_util, record
from tensorflow.python.eager.polymorphic_function import atomic_function
from tensorflow.python.framework import ops

__all__ = ["lookup_ids", "GATHER_GRADIENT_OPS", "SplitGradient", "split_gradient",
           "PASS_THROUGH_OPS", "SHAPE_OPS", "tape_is_recording"]

# Why: TensorFlow 2.21 builds an axis-0 gather's gradient (``_GatherV2Grad`` in
# tensorflow/python/ops/array_grad.py, ``_GatherGrad`` for ResourceGather) as
# ``IndexedSlices(reshape(grad, [size(ids), ...]), reshape(ids, [size(ids)]))``: the indices are a
# ``Reshape`` whose first input is the lookup's ids, with their shape. Where a table is looked up
# several times, the tape (``backprop_util.AggregateIndexedSlicesGradients``) concatenates the
# pieces' indices and values in one order (``ConcatV2`` on axis 0), first casting int32 indices
# to int64 (``Cast``) when the pieces' dtypes differ. Keras's own steps between the tape and
# the optimizer (casts, loss-scale division) keep the indices tensor as it is. Anything else
# (an eager tensor, another op) is "not known": the caller falls back to TensorFlow's own
# reduction. tests/test_tf_private.py pins the structure.
GATHER_GRADIENT_OPS = {"reshape": "Reshape", "aggregate": "ConcatV2", "widen": "Cast",
                       "pass": "Identity"}


def lookup_ids(slices, max_depth: int = 16):
    """The ids tensor of each lookup whose rows ``slices`` (a ``tf.IndexedSlices`` traced in
    a graph) holds, in row order: piece k is ``tf.size(ids[k])`` rows. None where the indices
    were not built by TensorFlow's gather gradient and aggregation as described above."""
    return _pieces(slices.indices, max_depth)


def _pieces(indices, depth):
    if depth <= 0 or not hasattr(indices, "op") or tf.executing_eagerly():
        return None
    try:
        op = indices.op
    except AttributeError:  # an eager tensor
        return None
    kind = op.type
    if kind == GATHER_GRADIENT_OPS["reshape"]:
        ids = op.inputs[0]
        if not ids.dtype.is_integer:
            return None
        return [ids]
    if kind in (GATHER_GRADIENT_OPS["widen"], GATHER_GRADIENT_OPS["pass"]):
        return _pieces(op.inputs[0], depth - 1)
    if kind == GATHER_GRADIENT_OPS["aggregate"]:
        axis = tf.get_static_value(op.inputs[-1])
        if axis is None or int(axis) != 0:
            return None
        pieces = []
        for part in op.inputs[:-1]:
            found = _pieces(part, depth - 1)
            if found is None:
                return None
            pieces += found
        return pieces
    return None


# Ops between a program's argument and a value its backward program reads that the caller can
# apply to the argument again itself, outside the program: each takes the value as its first
# input and constants (a shape, a permutation, an axis) as the others (a mixed-precision
# layer's cast of its kernel, EinsumDense's reshape of it, a tied embedding's transpose).
PASS_THROUGH_OPS = {
    "Cast": lambda x, op: tf.cast(x, op.get_attr("DstT")),
    "Identity": lambda x, op: x,
    "Reshape": lambda x, op, shape: tf.reshape(x, shape),
    "Transpose": lambda x, op, perm: tf.transpose(x, perm),
    "ExpandDims": lambda x, op, axis: tf.expand_dims(x, axis),
    "Squeeze": lambda x, op: tf.squeeze(x, op.get_attr("squeeze_dims") or None),
}


# Ops whose output is a tensor's shape, not its values.
SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank")


def tape_is_recording() -> bool:
    """Whether a gradient tape is recording here (the gradient being built is itself
    differentiated: a gradient penalty under a persistent or outer tape).

    Why: TensorFlow's public API has no test for an active tape; ``record.could_possibly_record``
    is the one its own function calls use.
    """
    return record.could_possibly_record()


class SplitGradient(object):
    """A traced function as TensorFlow splits it to differentiate a call of it: a forward
    program that also returns the intermediate values its gradient reads, and a backward
    program that takes the outputs' gradients and those values.

    Why private: to differentiate a call of a ``tf.function`` in a graph, TensorFlow rewrites
    the call into a "forward" function with extra outputs and adds a call of a "backward"
    function fed from them (``ConcreteFunction._delayed_rewrite_functions.forward_backward()``
    in tensorflow/python/eager/polymorphic_function/concrete_function.py). No public API gives
    the pair, and no public API lets the backward program read an argument other than the
    tensor the forward call was given: the gradient keeps every argument alive until it runs.
    ZeRO-3 must not keep a unit's gathered parameters from its forward to its backward pass,
    so it feeds the backward program parameters gathered again: each value the backward
    program reads is classified by where it comes from (``sources``), and an argument, or one
    through PASS_THROUGH_OPS (a cast, a reshape, a transpose), is fed from what the caller
    gives ``backward`` rather than kept. The pair
    keeps TensorFlow's function attributes, so a ``jit_compile=True`` function's two programs
    are both compiled by XLA. tests/test_tf_private.py pins it.

    Args:
        concrete: the traced function (``tf.function(...).get_concrete_function(...)``).
    """

    def __init__(self, concrete):
        delayed = concrete._delayed_rewrite_functions  # pylint: disable=protected-access
        self.num_outputs = delayed._num_inference_outputs  # pylint: disable=protected-access
        forward, self._backward = delayed.forward_backward(self.num_outputs)
        self._captured = list(concrete.captured_inputs)
        graph = concrete.graph
        inputs = self._argument_index = {ops.tensor_id(t): k for k, t in enumerate(graph.inputs)}
        outputs = {ops.tensor_id(t): j for j, t in enumerate(graph.outputs)}
        self.num_arguments = len(graph.inputs) - len(self._captured)
        self.trainable_outputs = [backprop_util.IsTrainable(t)
                                  for t in graph.outputs[:self.num_outputs]]
        # What the backward program reads, in its order: ("argument", k): argument k (or a
        # captured input); ("replay", k, steps): argument k through PASS_THROUGH_OPS, applied
        # again by ``backward``; ("output", j): the forward program's output j; ("fixed",
        # tensor): a tensor from outside.
        self.sources = []
        self._graph = graph
        for capture in self._backward.captured_inputs:
            key = ops.tensor_id(capture)
            if key in inputs:
                self.sources.append(("argument", inputs[key]))
                continue
            if key not in outputs:
                self.sources.append(("fixed", capture))
                continue
            argument, steps = self._pass_through(capture, inputs)
            if argument is not None:
                self.sources.append(("replay", argument, steps))
            else:
                self.sources.append(("output", outputs[key]))
        # TensorFlow's forward function returns every value the backward function reads, the
        # arguments too: an XLA program copies an argument it returns (a whole gathered
        # kernel per unit). The forward program called here returns the function's outputs
        # and the kept values only.
        # The indices of TensorFlow's forward outputs kept beyond the function's own.
        self.kept_outputs = sorted({s[1] for s in self.sources if s[0] == "output"} - set(
            range(self.num_outputs)))
        returned = list(range(self.num_outputs)) + self.kept_outputs
        self._position = {j: i for i, j in enumerate(returned)}
        self._forward = _function_returning(forward, graph, [graph.outputs[j] for j in returned])

    @staticmethod
    def _pass_through(tensor, inputs):
        """(k, steps) where ``tensor`` is argument k through PASS_THROUGH_OPS only: ``steps``,
        in order from the argument, are (function, op, constant inputs); else (None, None)."""
        steps = []
        while tensor.op.type in PASS_THROUGH_OPS:
            op = tensor.op
            constants = [tf.get_static_value(t) for t in op.inputs[1:]]
            if any(c is None for c in constants) or not op.inputs:
                return None, None
            steps.append((PASS_THROUGH_OPS[op.type], op, constants))
            tensor = op.inputs[0]
            key = ops.tensor_id(tensor)
            if key in inputs:
                return inputs[key], steps[::-1]
        return None, None

    def kept_reading_only(self, arguments) -> list:
        """The kept values (forward outputs beyond the function's own) computed from the
        ``arguments`` (indices) and no other argument, that is not from the others: what the
        forward program would keep of those arguments alone.

        Args:
            arguments: indices of the function's flat arguments.
        """
        arguments = set(arguments)
        found = []
        for source in self.sources:
            if source[0] != "output" or source[1] < self.num_outputs:
                continue
            reached = self._arguments_reached(self._graph.outputs[source[1]])
            if reached and reached <= arguments:
                found.append(self._graph.outputs[source[1]])
        return found

    def _arguments_reached(self, tensor) -> set:
        """The flat arguments whose values ``tensor`` is computed from: not the captured
        inputs (constants of the trace), and not through SHAPE_OPS (a value reshaped to an
        input's shape is still the parameter's alone)."""
        inputs = self._argument_index
        seen, stack, reached = set(), [tensor], set()
        while stack:
            t = stack.pop()
            key = ops.tensor_id(t)
            if key in seen:
                continue
            seen.add(key)
            if key in inputs:
                if inputs[key] < self.num_arguments:
                    reached.add(inputs[key])
                continue
            if t.op.type not in SHAPE_OPS:
                stack.extend(t.op.inputs)
        return reached

    def forward(self, flat_arguments):
        """Calls the forward program: (the function's flat outputs, what the backward program
        will read of the forward's values)."""
        results = self._forward.call_flat(*(list(flat_arguments) + self._captured))
        kept = {s[1]: results[self._position[s[1]]] for s in self.sources if s[0] == "output"}
        return list(results[:self.num_outputs]), kept

    def backward(self, output_gradients, flat_arguments, kept):
        """Calls the backward program: the gradient of each flat argument (None where it has
        none).

        Args:
            output_gradients: one per output of the function (None: zero).
            flat_arguments: the arguments again (the same values; they may be recomputed).
            kept: ``forward``'s second result.
        """
        arguments = list(flat_arguments) + self._captured
        feeds = []
        for source in self.sources:
            if source[0] == "argument":
                feeds.append(arguments[source[1]])
            elif source[0] == "replay":
                value = arguments[source[1]]
                for function, op, constants in source[2]:
                    value = function(value, op, *constants)
                feeds.append(value)
            elif source[0] == "output":
                feeds.append(kept[source[1]])
            else:
                feeds.append(source[1])
        douts = []
        for gradient, output, trainable in zip(
                output_gradients, self._graph.outputs[:self.num_outputs],
                self.trainable_outputs):
            if not trainable:
                continue
            if gradient is None:  # zeros made here: ``output`` is a tensor of the trace
                if not output.shape.is_fully_defined():
                    raise ValueError(f"SplitGradient.backward: no gradient for output "
                                     f"{output.name} of unknown shape {output.shape}; pass "
                                     f"zeros of its shape.")
                gradient = tf.zeros(output.shape, output.dtype)
            douts.append(tf.convert_to_tensor(gradient))
        grads = self._backward._call_flat(douts, feeds)  # pylint: disable=protected-access
        return list(grads)[:self.num_arguments]


def _function_returning(forward, graph, outputs):
    """``forward`` (an AtomicFunction of ``graph``) made again returning ``outputs`` only, with
    its attributes (XLA's among them)."""
    every = graph.outputs
    graph.outputs = outputs
    try:
        name = f"{forward.name.decode() if isinstance(forward.name, bytes) else forward.name}_kept"
        return atomic_function.from_func_graph(name, graph, forward.attributes)
    finally:
        graph.outputs = every


_splits = weakref.WeakKeyDictionary()
_splits_lock = threading.Lock()


def split_gradient(concrete) -> SplitGradient:
    """The ``SplitGradient`` of ``concrete``, made once (replicas trace in threads of their own:
    TensorFlow's split adds outputs to the traced graph, which must happen once)."""
    with _splits_lock:
        split = _splits.get(concrete)
        if split is None:
            split = _splits[concrete] = SplitGradient(concrete)
        return split
