"""Optimizers for large-batch and sharded training, Keras 3 style (one class per idea).

* ``lars.py``, ``lamb.py``: paper-faithful LARS and LAMB; ``_layerwise.py`` their shared
  trust-ratio math and exclusions.
* ``sharded.py``: ``ShardedOptimizer`` (ZeRO-1/2): each replica keeps the state of its own
  partition of the variables; ``sharded_state.py`` gathers that state into a form any replica
  count restores; ``exchange.py`` its reduce-scatter and all-gather in rounds of bounded size,
  ``packing.py`` the flat rows (one per replica) they exchange.
* ``schedules.py``: warmup + decay learning-rate schedules and ``scale_learning_rate``
  (also importable as ``tfdp.schedules``).
"""

from tfdp.optimizers.lamb import LAMB
from tfdp.optimizers.lars import LARS
from tfdp.optimizers.sharded import ShardedOptimizer

__all__ = ["LARS", "LAMB", "ShardedOptimizer"]
