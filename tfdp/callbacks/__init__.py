"""Keras callbacks for jobs that must survive clusters: backups, preemption, stragglers.

Thin callbacks, one idea each, over the mechanisms in ``tfdp.resilience``:

* ``BackupAndRestore`` (``backup_and_restore.py``): atomic step-numbered backups (every epoch
  or every N steps), a step-exact resume (same epoch, same batch, same optimizer state and,
  with ``tfdp.data`` input, the same next element), and preemption: SIGTERM to any worker
  makes every worker back up at the same step and exit with 143 (``Preempted``). A backup
  resumes on another worker or replica count at the same global batch.
* ``StragglerMonitor`` (``straggler_monitor.py``): names the worker the others wait for and,
  with ``evict=True`` and a launcher that allows shrinking, restarts the job without it
  (``RestartRequested``, exit 75).
* ``DatasetEpoch`` (``dataset_epoch.py``): ``set_epoch`` for a ``tfdp.data`` dataset
  (``BackupAndRestore`` does it too when it knows the dataset).
* ``RayReport`` (``ray_report.py``): the chief's metrics and checkpoint in Ray Train's
  ``Result`` (``ray.train.report``); Ray is imported only when ``fit`` starts.
* ``is_chief`` / ``write_path`` (``chief.py``): only the chief writes to the real path; the
  others write to a private temporary directory and delete it, so any collective that saving
  needs still runs on every worker (TensorFlow's multi-worker convention); ``per_worker_path``
  names a path every worker writes itself (per-worker logs).

``_running`` holds the running ``fit``'s ``BackupAndRestore`` for the others to reach.
Exit codes are ``tfdp.protocol``'s.
"""

from tfdp.callbacks.backup_and_restore import BackupAndRestore, Preempted, RestartRequested
from tfdp.callbacks.chief import is_chief, write_path
from tfdp.strategy.chief_writes import per_worker_path
from tfdp.callbacks.dataset_epoch import DatasetEpoch
from tfdp.callbacks.ray_report import RayReport
from tfdp.callbacks.straggler_monitor import StragglerMonitor

__all__ = ["BackupAndRestore", "DatasetEpoch", "StragglerMonitor", "Preempted",
           "RestartRequested", "RayReport", "is_chief", "write_path", "per_worker_path"]
