"""Horovod's ``DistributedOptimizer`` and ``DistributedGradientTape`` for Keras 3 on tfdp.

Rule: gradients are reduced across processes (``op=Average`` by default) exactly once per
optimizer update, *before* Keras clips them, so ``clipnorm``/``global_clipnorm``/
``clipvalue`` act on the global gradient as on one process (tfdp's promise; Horovod clips
after, only where the user clips the tape's gradients himself).

* ``DistributedOptimizer(optimizer, ...)`` returns an optimizer of a subclass of
  ``optimizer``'s class (same name and module, so a saved model loads as the plain
  optimizer) built from ``optimizer.get_config()``; the subclass reduces in Keras's
  ``_clip_gradients``, the step every real update passes (``model.fit``,
  ``optimizer.apply_gradients(zip(grads, vars))``, ``optimizer.apply(grads, vars)``, eager or
  traced). ``backward_passes_per_step=k`` is Keras's ``gradient_accumulation_steps=k``: the
  reduction runs once per k passes, on the accumulated gradient (Horovod's
  ``average_aggregated_gradients=False`` sums the k passes: the mean Keras accumulates is
  multiplied by k).
* ``DistributedGradientTape(tape, ...)``: its ``gradient()`` returns the reduced gradients
  (same nest); everything else is the wrapped tape's.

Both reduce with ``tfdp.horovod.grouped_allreduce`` (one bucketed reduction per update).
"""

from __future__ import annotations

import types

import keras
import tensorflow as tf

from tfdp.horovod import collectives
from tfdp.horovod.collectives import Average, Compression

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "is_distributed_optimizer"]

_SETTINGS = "_tfdp_horovod"  # the reduction settings on a distributed optimizer


def reduction_settings(compression, sparse_as_dense, op, gradient_predivide_factor,
                       backward_passes_per_step, average_aggregated_gradients, process_set):
    """Horovod's reduction arguments, checked, as the settings ``make_distributed`` and the
    tape reduce with (also ``tfdp.horovod.keras.load_model``'s)."""
    collectives.check_process_set(process_set)
    if op not in (collectives.Average, collectives.Sum):
        collectives.resolve_op(None, op)  # Adasum: its own NotImplementedError
        raise ValueError("DistributedOptimizer reduces gradients with op=hvd.Average or hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    prescale, postscale = 1.0, 1.0
    reduce_op = op
    if op == Average and gradient_predivide_factor != 1.0:
        # Horovod: divide by the factor before the sum, by size/factor after.
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    return types.SimpleNamespace(
        compression=compression, sparse_as_dense=bool(sparse_as_dense), op=reduce_op,
                prescale=prescale, postscale=postscale,
                passes=int(backward_passes_per_step),
                sum_passes=int(backward_passes_per_step) > 1 and not average_aggregated_gradients)


def _reduce(settings, grads):
    grads = list(grads)
    if settings.sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    if settings.sum_passes:
        k = settings.passes
        grads = [g if g is None else g * tf.cast(k, g.dtype) for g in grads]
    return collectives.grouped_allreduce(
        grads, op=settings.op, compression=settings.compression,
        prescale_factor=settings.prescale, postscale_factor=settings.postscale)


class _DistributedOptimizerMixin:
    """Reduces the gradients of every real update before Keras clips them."""

    def _clip_gradients(self, grads):
        return super()._clip_gradients(_reduce(getattr(self, _SETTINGS), grads))


def is_distributed_optimizer(optimizer) -> bool:
    return isinstance(optimizer, _DistributedOptimizerMixin)


def _distributed_class(cls):
    return type(cls.__name__, (_DistributedOptimizerMixin, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def make_distributed(optimizer, settings, in_place=False):
    """``optimizer`` made to reduce its gradients with ``settings``: a new optimizer from its
    config, or (``in_place``, or when the config does not round-trip) the same object."""
    if is_distributed_optimizer(optimizer):
        raise ValueError("this optimizer is a DistributedOptimizer already")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(
            "tfdp.horovod.DistributedOptimizer(LossScaleOptimizer(...)) is not supported: a "
            "step one rank skips for an overflow must be skipped on all. Use mixed precision "
            "with tfdp.DataParallelStrategy (its LossScaleOptimizer agrees across replicas).")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"tfdp.horovod.DistributedOptimizer wraps a Keras 3 optimizer "
            f"(keras.optimizers.*), got {type(optimizer).__name__}; tf.compat.v1 optimizers "
            "are not supported.")
    cls = _distributed_class(type(optimizer))
    passes = settings.passes
    current = optimizer.gradient_accumulation_steps or 1
    if passes > 1 and current not in (1, passes):
        raise ValueError(f"backward_passes_per_step={passes} but the optimizer has "
                         f"gradient_accumulation_steps={current}; give one of them")
    if passes > 1 and optimizer.built and current != passes:
        raise ValueError("backward_passes_per_step needs an optimizer that is not built yet "
                         "(its gradient accumulators are made when it is built)")
    new = None
    if not in_place and not optimizer.built:
        config = optimizer.get_config()
        if passes > 1:
            config["gradient_accumulation_steps"] = passes
        try:
            new = cls.from_config(config)
        except Exception:  # e.g. an unregistered learning-rate schedule
            new = None
    if new is None:
        new = optimizer
        new.__class__ = cls
        if passes > 1:
            new.gradient_accumulation_steps = passes
    setattr(new, _SETTINGS, settings)
    return new


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """An optimizer that averages its gradients over all ranks before updating (Horovod's).

    Args:
        optimizer: a Keras 3 optimizer, not built yet (a built one is converted in place).
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        backward_passes_per_step: update (and reduce) once per this many batches: Keras's
            ``gradient_accumulation_steps``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, divide by it before the sum and by
            ``size()/factor`` after.
        average_aggregated_gradients: with ``backward_passes_per_step > 1``, average the
            passes' gradients (True) or sum them (False, Horovod's default).
        name, use_locking, device_dense, device_sparse, num_groups, groups,
        scale_local_gradients: accepted for compatibility; tfdp buckets the gradients itself.
    """
    settings = reduction_settings(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  backward_passes_per_step, average_aggregated_gradients,
                                  process_set)
    return make_distributed(optimizer, settings)


class _DistributedGradientTape:
    """A tape whose ``gradient()`` returns the gradients reduced over all ranks."""

    def __init__(self, tape, settings):
        self._tape = tape
        self._settings = settings

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, _reduce(self._settings, flat))

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=None, scale_local_gradients=True):
    """Wraps ``gradtape`` so that ``gradient()`` returns gradients reduced over all ranks
    (``op=hvd.Average`` by default; arguments as for ``DistributedOptimizer``)."""
    settings = reduction_settings(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  1, False, process_set)
    return _DistributedGradientTape(gradtape, settings)
