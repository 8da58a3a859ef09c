"""Elastic membership: what a worker tells its launcher, and the batch on a new worker count.

Rules:

* **Progress.** After its first completed training step of an attempt a worker writes
  ``tfdp.protocol.progress_file`` (``mark_progress``); a slot that fails before it exists
  "could not come back" (``tfdp.launcher.policy``).
* **Eviction.** A job may ask to shrink only when tfdp-run launched it with ``--min-workers``
  below the current worker count and restarts left (``membership_allows_eviction``). It asks
  by writing ``tfdp.protocol.EVICT_FILE`` (``request_eviction``, chief only) and exiting with
  ``tfdp.protocol.EXIT_RESTART_REQUESTED`` after a backup.
* **Batch on another replica count** (``elastic_batch_size``): by default the global batch
  stays, so a resumed job is the same computation as the uninterrupted one.

The names of the environment variables, files and exit codes are in ``tfdp.protocol``.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

from tfdp.protocol import (ATTEMPT_ENV, CONTROL_DIR_ENV, EVICT_FILE, MIN_WORKERS_ENV,
                           RESTARTS_LEFT_ENV, progress_file)

__all__ = ["membership_allows_eviction", "elastic_batch_size", "mark_progress",
           "request_eviction"]


def membership_allows_eviction(num_workers: int,
                               environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether the launcher would restart this job without one worker, and why (not).

    The job may shrink only when tfdp-run launched it with ``--min-workers`` below the current
    worker count and has restarts left.
    """
    environ = os.environ if environ is None else environ
    if MIN_WORKERS_ENV not in environ or RESTARTS_LEFT_ENV not in environ:
        return False, "not launched by tfdp-run with --min-workers/--max-restarts"
    min_workers = int(environ[MIN_WORKERS_ENV])
    restarts_left = int(environ[RESTARTS_LEFT_ENV])
    if num_workers - 1 < min_workers:
        return False, f"{num_workers} workers and --min-workers {min_workers}: cannot shrink"
    if restarts_left < 1:
        return False, "no restarts left (--max-restarts)"
    return True, (f"{num_workers - 1} workers >= --min-workers {min_workers}, "
                  f"{restarts_left} restart(s) left")


def elastic_batch_size(saved_global_batch: int, saved_replicas: int, replicas: int,
                       policy: str = "constant_global") -> tuple[int, float]:
    """The global batch and learning-rate factor for a job resumed on ``replicas`` replicas.

    Policies:

    * ``"constant_global"`` (default): keep the global batch; each replica's batch changes.
      The training is the same computation as before the resize (same steps, same updates),
      so the learning rate is unchanged (factor 1.0). Needs the global batch divisible by the
      new replica count.
    * ``"constant_per_replica"``: keep each replica's batch; the global batch scales with
      the replicas and the learning rate by the linear rule (Goyal et al.), as
      ``tfdp.scale_learning_rate`` does. Steps per epoch, the resume step and the
      optimizer's trajectory all change: the result is *not* the uninterrupted run's.

    Returns:
        ``(global_batch_size, learning_rate_factor)``.

    Example:
        >>> elastic_batch_size(24, 3, 2)
        (24, 1.0)
    """
    if policy == "constant_global":
        if saved_global_batch % replicas:
            raise ValueError(
                f"global batch {saved_global_batch} is not divisible by {replicas} replicas: the "
                f"job cannot resume on this replica count with the same global batch. Resume on "
                f"a replica count that divides {saved_global_batch}, or use "
                "policy='constant_per_replica'.")
        return saved_global_batch, 1.0
    if policy == "constant_per_replica":
        if saved_global_batch % saved_replicas:
            raise ValueError(f"global batch {saved_global_batch} was not divisible by "
                             f"{saved_replicas} replicas.")
        per_replica = saved_global_batch // saved_replicas
        return per_replica * replicas, replicas / saved_replicas
    raise ValueError(f"policy={policy!r}: use 'constant_global' or 'constant_per_replica'.")


def mark_progress(rank: int, environ: Mapping[str, str] | None = None):
    """Tells tfdp-run that this worker completed a training step in this attempt."""
    environ = os.environ if environ is None else environ
    control = environ.get(CONTROL_DIR_ENV)
    if not control:
        return
    try:
        os.makedirs(control, exist_ok=True)
        with open(progress_file(control, rank), "w") as f:
            f.write(environ.get(ATTEMPT_ENV, "0"))
    except OSError:
        pass


def request_eviction(rank: int, reason: str, environ: Mapping[str, str] | None = None) -> bool:
    """Asks tfdp-run to restart the job without ``rank`` (this attempt's numbering).

    Written by the chief before every worker exits with ``EXIT_RESTART_REQUESTED``; atomic
    (a temporary file renamed into place). Returns False when no launcher is listening.
    """
    environ = os.environ if environ is None else environ
    control = environ.get(CONTROL_DIR_ENV)
    if not control:
        return False
    os.makedirs(control, exist_ok=True)
    final = os.path.join(control, EVICT_FILE)
    with open(final + ".tmp", "w") as f:
        json.dump({"rank": int(rank), "reason": reason}, f)
    os.replace(final + ".tmp", final)
    return True
