"""ZeRO-3 and Keras's optimizer: slices updated one at a time, norms over whole tensors.

Rule. The optimizer's update (``extended.update``) hands ``update_step`` this replica's slice
and its state's slices: elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...) update slices
as they would the whole tensor; optimizers whose update needs the whole tensor (Keras's Lamb,
Muon, Adafactor) are refused when they first apply (``check_optimizer``). Each replica updates
its slices one variable at a time (``one_update_at_a_time``), so the update's temporaries exist
for one slice. Norms over whole tensors (``clipnorm``, ``global_clipnorm``) add each replica's
squared slice norms in one scalar all-reduce (``clip_gradients``), so clipping equals one
device's; the squared norm of a sparse gradient is that of its entries (``squared_norm``), as
Keras takes it. Keras's EMA (``use_ema=True``) writes each replica's slice of the averages
(``install_moving_average_hook``). gradient_hooks.py calls ``clip_gradients`` and
``check_optimizer`` where Keras clips and applies.
"""

from __future__ import annotations

import threading

import keras
import tensorflow as tf

from tfdp import _tf_private
from tfdp.strategy import collectives

__all__ = ["one_update_at_a_time", "check_optimizer", "WHOLE_TENSOR_OPTIMIZERS",
           "clip_gradients", "install_moving_average_hook", "squared_norm", "sum_over_replicas"]

# --- Updates one slice at a time ----------------------------------------------------------------
_updates = threading.local()


class one_update_at_a_time(object):  # a context manager
    """Around one variable's update in a replica: its ops run after the previous sharded
    variable's update in this replica's traced step. Keras's optimizer builds every variable's
    update independently, and a graph runs independent updates at once: their temporaries
    (Adam's new moments, the step) would then all exist together, several bytes per parameter
    of the whole model at the end of every step. One at a time, they exist for one slice."""

    def __enter__(self):
        graph = tf.compat.v1.get_default_graph()
        if getattr(_updates, "graph", None) is not graph:
            _updates.graph, _updates.last = graph, None
        self._graph, self._first = graph, _tf_private.operation_count(graph)
        self._deps = tf.control_dependencies([] if _updates.last is None else [_updates.last])
        self._deps.__enter__()

    def __exit__(self, *exc):
        self._deps.__exit__(*exc)
        if exc[0] is None and not tf.executing_eagerly():
            created = _tf_private.operations_since(self._graph, self._first)
            if created:
                _updates.last = tf.group(*created)


# --- Which optimizers can update slices --------------------------------------------------------
# Keras optimizers whose update of a variable needs the whole tensor: a norm over it (Lamb's
# trust ratio), its matrix shape (Muon's orthogonalisation) or factored moments (Adafactor).
# On a slice they would run and silently compute something else, so they are refused.
# tfdp's own LARS and LAMB take their norms over whole tensors (optimizers/_layerwise.py).
WHOLE_TENSOR_OPTIMIZERS = tuple(getattr(keras.optimizers, name) for name in
                                ("Lamb", "Muon", "Adafactor") if hasattr(keras.optimizers, name))


def check_optimizer(optimizer) -> None:
    """Raises ValueError when ``optimizer`` cannot update slices of sharded parameters.

    Args:
        optimizer: the Keras optimizer about to apply gradients to sharded variables.
    """
    if isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS):
        name = type(optimizer).__name__
        raise ValueError(
            f"tfdp: keras.optimizers.{name} cannot train sharded parameters "
            "(shard_parameters=True): its update of a variable needs the whole tensor (a norm, "
            "a matrix shape or factored moments), and each replica holds a slice. Use "
            "tfdp.optimizers.LAMB / tfdp.optimizers.LARS (their norms span replicas) or an "
            "elementwise optimizer (SGD, Adam, AdamW, RMSprop, Lion, ...), or "
            f"shard_parameters=False with tfdp.ShardedOptimizer({name}(...)).")


# --- Keras's moving averages (use_ema=True) ---------------------------------------------------

def install_moving_average_hook():
    """Keras's EMA update assigns slices of the averages of sharded parameters (idempotent)."""
    def make(original):
        def _update_model_variables_moving_average(self, trainable_variables):
            averages = _tf_private.moving_averages(self) if self.use_ema else []
            if not any(_tf_private.is_sharded_variable(a) for a in averages if a is not None):
                return original(self, trainable_variables)
            # Keras's arithmetic; the assignment goes to the TensorFlow variable, which in a
            # replica writes this replica's slice (both reads are slices in the step).
            for variable, average in zip(trainable_variables, averages):
                if average is None:
                    continue
                not_first_step = tf.not_equal(self.iterations, 0)
                momentum = tf.cast(not_first_step, variable.dtype) * self.ema_momentum
                average.value.assign(momentum * average + (1 - momentum) * variable)
        return _update_model_variables_moving_average

    _tf_private.patch_keras_moving_average_update(make)


# --- Clipping with sharded gradients -----------------------------------------------------------

def sum_over_replicas(value):
    """``value`` (a scalar: a squared norm) summed over every replica of every worker; what
    makes a slice's norm a whole tensor's (a guard test replaces it to show the difference).

    Args:
        value: this replica's tensor.
    """
    return collectives.all_reduce(value)


def squared_norm(g):
    """Keras's squared norm of a gradient: of a sparse one, of its rows (or elements) as they
    are, duplicates not added first (``ops.square`` keeps IndexedSlices), as one device
    takes it for ``global_clipnorm`` and tf.clip_by_norm for ``clipnorm``.

    Args:
        g: a dense gradient or a ``tf.IndexedSlices``.
    """
    if isinstance(g, tf.IndexedSlices):
        g = g.values
    return tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))


def clip_gradients(optimizer, grads, variables, original_clip):
    """Keras's ``_clip_gradients`` when some of ``variables`` are sharded.

    ``grads`` of sharded variables are this replica's slices, already summed over replicas;
    the others are already all-reduced. A whole tensor's squared norm is the sum of its slices'
    squared norms over all replicas: one scalar all-reduce per clipped tensor (``clipnorm``) or
    one in all (``global_clipnorm``). The arithmetic is Keras's own (tf.clip_by_norm and
    Keras's clip_by_global_norm), with the norm replaced.

    Args:
        optimizer: the Keras optimizer.
        grads: the gradients, in ``variables``' order (None where a variable has none).
        variables: the variables they update.
        original_clip: Keras's own ``_clip_gradients`` (``clipvalue``, or no clipping).
    """
    sharded = [_tf_private.is_sharded_variable(v) for v in variables]
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        out = []
        for g, is_shard in zip(grads, sharded):
            if g is None or not is_shard:
                out.append(None if g is None else optimizer._clip_by_norm(g))  # Keras's own
                continue
            l2sum = sum_over_replicas(squared_norm(g))
            out.append(_clip_by_norm_with(g, optimizer.clipnorm, l2sum))
        return out
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        mirrored = [squared_norm(g) for g, s in zip(grads, sharded) if g is not None and not s]
        slices = [squared_norm(g) for g, s in zip(grads, sharded) if g is not None and s]
        total = sum_over_replicas(tf.add_n(slices)) if slices else 0.0
        if mirrored:
            total = total + tf.add_n(mirrored)
        norm = tf.sqrt(total)
        clip = tf.cast(optimizer.global_clipnorm, norm.dtype)
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
    return original_clip(optimizer, grads)


def _clip_by_norm_with(t, clip_norm, l2sum):
    """tf.clip_by_norm's arithmetic for ``t`` whose squared norm is ``l2sum`` (a sparse ``t``
    stays sparse, its values clipped, as tf.clip_by_norm keeps it)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(_clip_by_norm_with(t.values, clip_norm, l2sum), t.indices,
                                t.dense_shape)
    l2sum = tf.cast(l2sum, t.dtype)
    positive = l2sum > 0
    safe = tf.where(positive, l2sum, tf.ones_like(l2sum))
    l2norm = tf.where(positive, tf.sqrt(safe), l2sum)
    clip_norm = tf.cast(clip_norm, t.dtype)
    return t * clip_norm / tf.maximum(l2norm, clip_norm)
