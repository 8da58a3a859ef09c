"""Epoch and position: what the next iterator yields, the same on every worker.

Rules:

* Shuffling uses the same seed on every worker and happens before DATA sharding, so the
  workers partition one global permutation. The order of epoch e is a pure function of
  (seed, e) once ``set_epoch`` (or ``tfdp.callbacks.DatasetEpoch``) tells the epoch; until then
  e counts the iterators this process started (a new order each epoch, as tf.data reshuffles).
* ``set_position(epoch, step)``: the next iterator to produce an element yields epoch
  ``epoch``'s order from global step ``step``, skipping the elements the first ``step`` steps
  consumed (DATA: step*B elements of the global order; FILE and OFF: step*L*b elements of the
  worker's own stream) before parsing where tfdp parses. Only that iterator skips. The position
  is read when an iterator produces its first element (Keras's ``fit`` draws one batch from a
  throwaway iterator before ``on_train_begin``, so set it from a callback).
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

# Epoch e's shuffle seed is seed * SEED_STRIDE + e, so the seeds of two (seed, epoch) pairs
# collide only for epochs a million apart.
SEED_STRIDE = 1_000_003


class EpochState:
    """The epoch and start step of the next iterator; the same on every worker.

    ``start`` runs (through a ``tf.py_function``) when an iterator produces its first element.

    Args:
        seed: the shuffle seed shared by all workers.
        elements_per_step: elements of this pipeline's stream one global step consumes (B for
            DATA sharding, L*b for FILE and OFF).

    Example: ``state.set_position(3, 10)``; the next iterator skips 10 steps of epoch 3.
    """

    def __init__(self, seed, elements_per_step):
        self.seed = int(seed)
        self.elements_per_step = int(elements_per_step)
        self.epoch = None
        self.iterations = 0
        self._skip_steps = 0
        self._lock = threading.Lock()

    def set_epoch(self, epoch):
        if isinstance(epoch, bool) or int(epoch) != epoch or epoch < 0:
            raise ValueError(f"set_epoch({epoch!r}): the epoch must be an integer >= 0.")
        self.epoch = int(epoch)

    def set_position(self, epoch, step):
        self.set_epoch(epoch)
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise ValueError(f"set_position({epoch!r}, {step!r}): the step must be an integer >= 0.")
        with self._lock:
            self._skip_steps = int(step)

    def start(self):
        with self._lock:
            if self.epoch is None:
                epoch, self.iterations = self.iterations, self.iterations + 1
            else:
                epoch = self.epoch
            skip, self._skip_steps = self._skip_steps * self.elements_per_step, 0
        return np.asarray([self.seed * SEED_STRIDE + epoch, skip], np.int64)

    def tensor(self):
        """(seed of this epoch, elements to skip), evaluated once per new iterator."""
        state = tf.py_function(self.start, [], tf.int64)
        state.set_shape([2])
        return state
