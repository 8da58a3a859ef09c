"""What tfdp's resilience callbacks stand on, one module per mechanism.

* ``tfdp.resilience.backups``: atomic step-numbered backups on any filesystem
  ``tf.io.gfile`` reaches (``BackupStore``), the resume position, update boundaries.
* ``tfdp.resilience.preemption``: SIGTERM as a flag with a backstop (``PreemptionWatcher``),
  all workers stopping at the same step (``StopAgreement``).
* ``tfdp.resilience.stragglers``: which worker the others wait for (``StepTimer``,
  ``find_stragglers``).
* ``tfdp.resilience.elastic``: what a worker tells its launcher (``mark_progress``,
  ``request_eviction``), ``membership_allows_eviction``, ``elastic_batch_size``.
* ``tfdp.resilience.compile_cache``: XLA's persistent compilation cache for restarts (where it
  lives, its checks, its size bound).

Everything that decides (``resume_position``, ``should_back_up``, ``find_stragglers``,
``membership_allows_eviction``, ``elastic_batch_size``) is a pure function. Every name is
importable from ``tfdp.resilience`` as in earlier releases (``Agreement``, every worker
learning the same small vector, is the strategy's: ``tfdp.strategy.agreement``). Importing this package does not
import TensorFlow (the backstop and the pure functions work without it).
"""

from tfdp.protocol import DEFAULT_GRACE_SECONDS
from tfdp.strategy.agreement import Agreement
from tfdp.resilience.backups import (BackupStore, Position, is_update_boundary, resume_position,
                                     should_back_up)
from tfdp.resilience.elastic import (elastic_batch_size, mark_progress,
                                     membership_allows_eviction, request_eviction)
from tfdp.resilience.preemption import PreemptionWatcher, StopAgreement
from tfdp.resilience.stragglers import StepTimer, find_stragglers

__all__ = [
    "BackupStore", "Position", "resume_position", "is_update_boundary", "should_back_up",
    "find_stragglers", "membership_allows_eviction", "elastic_batch_size", "Agreement",
    "PreemptionWatcher", "StopAgreement", "StepTimer", "mark_progress", "request_eviction",
    "DEFAULT_GRACE_SECONDS",
]
