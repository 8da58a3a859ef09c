"""Horovod's Keras callbacks (``horovod.tensorflow.keras.callbacks``) on tfdp.

Rules:

* ``BroadcastGlobalVariablesCallback(root_rank)`` broadcasts the model's and the optimizer's
  variables *before the first update* (``on_train_begin``, building the optimizer's
  variables first), so ranks that start from different random weights train exactly like one
  process. (Horovod broadcasts after the first batch, whose update each rank then applied to
  its own weights.) A model whose variables do not exist before its first batch (a
  subclassed model never called) is broadcast after the first batch, as Horovod does.
* ``MetricAverageCallback()`` replaces each numeric entry of the epoch's logs by its mean
  over all ranks (one all-reduce; every rank must log the same names); put it before the
  callbacks that read the logs (checkpoints, early stopping, progress).
* ``LearningRateScheduleCallback`` / ``LearningRateWarmupCallback``: Horovod's schedules,
  setting ``optimizer.learning_rate`` (Keras 3) at batch starts. Momentum correction
  applies only where the optimizer's ``momentum`` is a variable: Keras 3's ``SGD`` keeps a
  Python float, read when the step is traced, so the correction is skipped (with a warning).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdp.horovod import _runtime, collectives

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from ``root_rank``'s weights and optimizer state."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def _broadcast(self):
        variables = collectives.model_and_optimizer_variables(
            self.model, getattr(self.model, "optimizer", None))
        collectives.broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        if not model.built or not model.trainable_variables:
            return  # variables appear at the first batch: broadcast after it (Horovod's way)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's logs over all ranks."""

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items()
                       if isinstance(v, (int, float, np.number, np.ndarray, tf.Tensor))
                       and np.size(v) == 1)
        if not names:
            return
        values = tf.constant([float(np.asarray(logs[k])) for k in names], tf.float64)
        averaged = collectives.allreduce(values, op=collectives.Average).numpy()
        for k, v in zip(names, averaged):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets ``learning_rate = initial_lr * multiplier(epoch)`` from ``start_epoch`` to
    ``end_epoch`` (Horovod's semantics).

    Args:
        initial_lr: the learning rate the multiplier scales (None: the optimizer's at the
            start of training).
        multiplier: a number (then the schedule is a staircase) or ``f(epoch)``; without a
            staircase ``epoch`` is fractional (``epoch + batch / steps_per_epoch``).
        start_epoch, end_epoch: the epochs ``[start, end)`` it acts in (end None: all).
        staircase: adjust at each epoch's first batch only.
        momentum_correction: scale ``momentum`` by new_lr/old_lr for the batch (only where
            ``momentum`` is a variable; see the module docstring).
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.initial_lr = initial_lr
        self.restore_momentum = None
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if not callable(multiplier):
            self.staircase = True
            self.multiplier = lambda epoch: multiplier
        else:
            self.multiplier = multiplier
        self._warned_momentum = False

    def _optimizer(self):
        return self.model.optimizer

    def _lr(self):
        return float(keras.ops.convert_to_numpy(self._optimizer().learning_rate))

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        optimizer = self._optimizer()
        old_lr = self._lr()
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and momentum and old_lr:
            if isinstance(momentum, keras.Variable) or isinstance(momentum, tf.Variable):
                self.restore_momentum = float(keras.ops.convert_to_numpy(momentum))
                momentum.assign(self.restore_momentum * new_lr / old_lr)
            elif not self._warned_momentum:
                self._warned_momentum = True
                warnings.warn(
                    f"{type(self).__name__}: momentum_correction skipped: "
                    f"{type(optimizer).__name__}.momentum is a Python number in Keras 3, fixed "
                    "when the train step is traced; pass momentum_correction=False to silence.",
                    stacklevel=2)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            self._optimizer().momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = self._lr()
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch
                or self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up: from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, adjusted at every batch (Goyal et al., 2017)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Round numbers at the end of each epoch, as Horovod.
            epoch += 1.0 / self.steps_per_epoch
            size = _runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self._lr():g}.")
