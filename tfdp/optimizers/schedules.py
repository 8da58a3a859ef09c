"""Learning-rate scaling rules and warmup schedules for large-batch training.

Warmup length rule: warmup is given in steps (``warmup_steps``); to state it in epochs,
use ``warmup_steps = round(warmup_epochs * examples_per_epoch / global_batch_size)``
(``steps_for_epochs``). Goyal et al. (2017) use 5 epochs for ResNet-50 at batch 8k; the
LAMB paper warms up over a fixed fraction of training.

References:
    - Goyal et al., 2017. Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour.
    - Krizhevsky, 2014. One weird trick for parallelizing convolutional neural networks
      (square-root scaling).
    - You et al., 2019. Large Batch Optimization for Deep Learning: Training BERT in 76
      minutes (linear warmup then polynomial decay).
"""

from __future__ import annotations

import math

import keras
from keras import ops

__all__ = ["scale_learning_rate", "steps_for_epochs", "WarmupPolynomialDecay", "WarmupCosineDecay"]


def scale_learning_rate(base_lr: float, base_batch_size: int, global_batch_size: int,
                        rule: str = "linear") -> float:
    """The learning rate for ``global_batch_size`` given one tuned at ``base_batch_size``.

    Args:
        rule: ``"linear"`` (lr * k, Goyal et al.) or ``"sqrt"`` (lr * sqrt(k)), where
            k = global_batch_size / base_batch_size.
    """
    if base_batch_size <= 0 or global_batch_size <= 0:
        raise ValueError(f"batch sizes must be positive, got base_batch_size={base_batch_size}, "
                         f"global_batch_size={global_batch_size}.")
    k = global_batch_size / base_batch_size
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    raise ValueError(f"rule={rule!r} is not 'linear' or 'sqrt'.")


def steps_for_epochs(epochs: float, examples_per_epoch: int, global_batch_size: int) -> int:
    """Steps in ``epochs`` epochs (rounded, at least 0)."""
    return max(0, round(epochs * examples_per_epoch / global_batch_size))


class _WarmupThenDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from ``initial_learning_rate`` to ``peak_learning_rate`` over
    ``warmup_steps``, then ``self._decay(progress)`` with progress 0 -> 1 at ``total_steps``."""

    def __init__(self, peak_learning_rate, warmup_steps, total_steps, initial_learning_rate, name):
        if total_steps < warmup_steps:
            raise ValueError(f"total_steps={total_steps} must be >= warmup_steps={warmup_steps}.")
        self.peak_learning_rate = peak_learning_rate
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.initial_learning_rate = initial_learning_rate
        self.name = name

    def _decay(self, progress):
        raise NotImplementedError

    def __call__(self, step):
        step = ops.cast(step, "float32")
        progress = ops.clip((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1),
                            0.0, 1.0)
        frac = ops.minimum(step / max(float(self.warmup_steps), 1.0), 1.0)
        warm = self.initial_learning_rate + (self.peak_learning_rate - self.initial_learning_rate) * frac
        return ops.where(step < self.warmup_steps, warm, self._decay(progress))

    def get_config(self):
        return {"peak_learning_rate": self.peak_learning_rate, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps,
                "initial_learning_rate": self.initial_learning_rate, "name": self.name}


@keras.saving.register_keras_serializable(package="tfdp")
class WarmupPolynomialDecay(_WarmupThenDecay):
    """Linear warmup from ``initial_learning_rate`` to ``peak_learning_rate`` over
    ``warmup_steps``, then polynomial decay to ``end_learning_rate`` at ``total_steps``
    (LAMB paper: power 1.0). Constant at ``end_learning_rate`` after ``total_steps``.

    Args:
        peak_learning_rate: rate at the end of warmup.
        warmup_steps: number of warmup steps (0: no warmup).
        total_steps: step at which the decay ends (including warmup).
        end_learning_rate: final rate.
        power: polynomial power of the decay.
        initial_learning_rate: rate at step 0.
    """

    def __init__(self, peak_learning_rate, warmup_steps, total_steps, end_learning_rate=0.0,
                 power=1.0, initial_learning_rate=0.0, name=None):
        super().__init__(peak_learning_rate, warmup_steps, total_steps, initial_learning_rate, name)
        self.end_learning_rate = end_learning_rate
        self.power = power

    def _decay(self, progress):
        span = self.peak_learning_rate - self.end_learning_rate
        return span * (1.0 - progress) ** self.power + self.end_learning_rate

    def get_config(self):
        return {**super().get_config(), "end_learning_rate": self.end_learning_rate,
                "power": self.power}


@keras.saving.register_keras_serializable(package="tfdp")
class WarmupCosineDecay(_WarmupThenDecay):
    """Linear warmup to ``peak_learning_rate`` over ``warmup_steps``, then cosine decay to
    ``alpha * peak_learning_rate`` at ``total_steps`` (Goyal et al. warmup + Loshchilov &
    Hutter cosine).

    Args:
        peak_learning_rate: rate at the end of warmup.
        warmup_steps: number of warmup steps.
        total_steps: step at which the decay ends (including warmup).
        alpha: final rate as a fraction of the peak.
        initial_learning_rate: rate at step 0.
    """

    def __init__(self, peak_learning_rate, warmup_steps, total_steps, alpha=0.0,
                 initial_learning_rate=0.0, name=None):
        super().__init__(peak_learning_rate, warmup_steps, total_steps, initial_learning_rate, name)
        self.alpha = alpha

    def _decay(self, progress):
        cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
        return self.peak_learning_rate * ((1.0 - self.alpha) * cosine + self.alpha)

    def get_config(self):
        return {**super().get_config(), "alpha": self.alpha}
