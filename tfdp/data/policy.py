"""The sharding policy as pure functions: which policy, how many steps, whether a resume is
exact, whether the workers can end an epoch without agreeing on it. No TensorFlow.

Rules:

* ``"file"``: worker w reads files w, w+W, ... (needs at least W files); ``"data"``: every
  worker reads everything and keeps elements w, w+W, ... of one global order; ``"auto"``: FILE
  when the source reads at least W files and FILE sharding is exactly once, else DATA;
  ``"off"``: no sharding (sources already split per worker).
* Within a worker each of the L local replicas takes consecutive batches of
  ``global_batch_size / num_replicas`` elements, so with DATA sharding step s trains on
  elements [s*B, (s+1)*B) of the global order whatever the number of workers.
* An epoch lasts while any worker has data (the others get empty batches); with
  ``drop_remainder`` only steps where every replica has a full batch count.
* A random transformation in the source without a seed (``shuffle(n)``: TensorFlow draws its
  seeds in every process) breaks DATA sharding across workers: each worker keeps elements
  w, w+W, ... of its *own* order, so some elements are trained on twice and others never. tfdp
  seeds them from its shared ``seed`` there (``unseeded_random_action``), and refuses naming the
  fixes where it cannot (``unseeded_random_error``). Elsewhere they are safe and left alone: one
  worker (a single pipeline split among its replicas), FILE sharding (a worker shuffles only its
  own files), no sharding (every worker reads everything), a tf.data service (each split goes to
  one service worker and each element to one trainer).
* When every worker's element count is exact (TensorFlow's cardinality or the record-count
  index), every worker's pipeline is given exactly ``steps_per_epoch * L`` per-replica batches
  (cut, or padded with the empty batches TensorFlow's end-of-data agreement would substitute),
  so the workers run out together without that per-step cross-worker collective.
"""

from __future__ import annotations

from typing import Sequence

from tfdp.data.errors import DataShardingError

SHARD_POLICIES = ("auto", "file", "data", "off")


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """``global_batch_size / num_replicas``, or an error naming both when it is not whole.

    Example: ``per_replica_batch_size(256, 8) == 32``; ``(100, 8)`` raises, suggesting 96 or 104.
    """
    if (isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
            or global_batch_size < 1):
        raise DataShardingError(f"global_batch_size={global_batch_size!r} must be a positive integer.")
    if global_batch_size % num_replicas:
        lower = global_batch_size // num_replicas * num_replicas
        raise DataShardingError(
            f"global_batch_size={global_batch_size} is not divisible by the "
            f"{num_replicas} replicas in sync; use a multiple of {num_replicas}, e.g. "
            f"{lower or num_replicas} or {lower + num_replicas}.")
    return global_batch_size // num_replicas


def choose_shard_policy(requested: str, num_workers: int, num_files: int | None,
                        not_by_file: str | None = None) -> tuple[str, str]:
    """Returns (policy, reason). Pure.

    Args:
        requested: the ``shard_policy`` argument.
        num_workers: workers in the cluster.
        num_files: files the source reads, or None when it reads no list of files tfdp sees.
        not_by_file: why sharding this source by file would not be exactly once (None: it
            would be, given enough files).

    Example: ``choose_shard_policy("auto", 2, 8) == ("file", "8 files >= 2 workers")``.
    """
    if requested not in SHARD_POLICIES:
        raise DataShardingError(f"shard_policy={requested!r} is not one of {SHARD_POLICIES}.")
    if requested == "file":
        if num_files is None or not_by_file:
            raise DataShardingError(
                "shard_policy='file' needs a file source (tfdp.data.Files, or a dataset that reads "
                "a list of files, e.g. TFRecordDataset(files)); "
                f"{not_by_file or 'this source is a dataset of elements'}. "
                "Use shard_policy='data' or 'auto'.")
        if num_files < num_workers:
            raise DataShardingError(
                f"shard_policy='file' with {num_files} file(s) for {num_workers} workers would "
                f"leave workers without data. Write at least {num_workers} files "
                "(tfdp.data.write_tfrecord_shards) or use shard_policy='data'.")
        return "file", f"{num_files} files for {num_workers} workers"
    if requested in ("data", "off"):
        return requested, "requested"
    if num_workers == 1:
        return "off", "one worker: nothing to shard across workers"
    if num_files is None or not_by_file:
        why = not_by_file or "the source is a dataset of elements, not a list of files"
        return "data", f"{why}: every worker reads it and keeps 1/{num_workers}"
    if num_files >= num_workers:
        return "file", f"{num_files} files >= {num_workers} workers"
    return "data", (f"only {num_files} file(s) for {num_workers} workers: every worker reads "
                    f"all files and keeps 1/{num_workers} of the records")


def unseeded_random_matters(policy: str, num_workers: int) -> bool:
    """Whether an unseeded random transformation in the source can lose or duplicate elements:
    only under DATA sharding across workers (see ``unseeded_random_action``). Pure."""
    return policy == "data" and num_workers > 1


def unseeded_random_action(policy: str, num_workers: int,
                           unseeded: Sequence[str]) -> tuple[str, str]:
    """What tfdp does with the source's unseeded random transformations: ("seed", why) or
    ("keep", why). The same on every worker (it reads only what every worker computes alike).

    Args:
        policy: the chosen shard policy ("data", "file", "off") or "service".
        num_workers: workers in the cluster.
        unseeded: descriptions of the random transformations whose seeds are unset, e.g.
            ``["shuffle(96)"]``.

    Example: ``unseeded_random_action("data", 2, ["shuffle(96)"])[0] == "seed"``; with one
    worker, "keep".
    """
    if not unseeded:
        return "keep", "no unseeded random transformation"
    if unseeded_random_matters(policy, num_workers):
        return "seed", (f"DATA sharding over {num_workers} workers keeps elements w, w+W, ... of "
                        f"each worker's own order, and {', '.join(unseeded)} draws another order "
                        "on every worker (elements would be lost and duplicated)")
    if num_workers == 1 or policy == "off":
        return "keep", ("one worker: a single pipeline is split among its replicas"
                        if num_workers == 1 else "no sharding: every worker reads every element")
    if policy == "file":
        return "keep", ("FILE sharding: each worker shuffles only the records of its own files "
                        "(TensorFlow's rewrite moves a shuffle of the file names after its shard)")
    return "keep", ("a tf.data service hands each split to one service worker and each element to "
                    "one trainer, whatever order a service worker draws")


def unseeded_random_error(unseeded: Sequence[str], num_workers: int, cause: str) -> str:
    """The ``DataShardingError`` message when tfdp cannot seed ``unseeded`` itself. Pure."""
    return (f"the dataset applies {', '.join(unseeded)} without a seed, so each of the "
            f"{num_workers} workers draws its own order, and DATA sharding (worker w keeps "
            "elements w, w+W, ... of its order) would train on some elements twice and others "
            f"never; tfdp could not seed it ({cause}). Fix one of: give it a seed, the same on "
            "every worker (shuffle(n, seed=S)); or remove it and pass shuffle_buffer=n to "
            "tfdp.data.distribute (tfdp shuffles with its shared seed before sharding); or call "
            "tf.random.set_seed(S) on every worker before building the pipeline.")


def steps_per_epoch(elements_per_worker: Sequence[int], per_replica: int, local_replicas: int,
                    drop_remainder: bool) -> int:
    """Global steps in one epoch when worker w holds ``elements_per_worker[w]`` elements.

    Without ``drop_remainder`` the epoch lasts while any worker has data (the others get
    empty batches); with it, only steps where every replica has a full batch count.

    Example: ``steps_per_epoch([35, 35], 4, 2, False) == 5``; with ``True``: 4.
    """
    steps = []
    for n in elements_per_worker:
        if drop_remainder:
            steps.append(n // per_replica // local_replicas)
        else:
            steps.append(-(-(-(-n // per_replica)) // local_replicas))
    return min(steps) if drop_remainder else max(steps)


def split_elements(total: int, policy: str, num_workers: int) -> list[int]:
    """Elements per worker when the source has ``total``: DATA deals them out, else all."""
    if policy == "data":
        return [len(range(w, total, num_workers)) for w in range(num_workers)]
    return [total] * num_workers


def batches_per_pipeline(steps: int | None, counts_exact: bool, num_workers: int,
                         local_replicas: int) -> int | None:
    """Per-replica batches every worker's pipeline yields per epoch so that all workers end
    together without a per-step collective; None when they must agree at run time.

    Only for several workers (one worker needs no agreement) whose element counts are exact
    (TensorFlow's cardinality or the record-count index; not a user-given ``num_examples``,
    which tfdp cannot check). Pure.

    Example: ``batches_per_pipeline(13, True, 2, 2) == 26``; unknown counts: None.
    """
    if steps is None or not counts_exact or num_workers < 2:
        return None
    return steps * local_replicas


def order_class(info) -> tuple:
    """What fixes the sequence of global steps: one global order, or per-worker streams."""
    policy, workers = info.get("policy"), info.get("num_workers")
    if policy == "data" or (policy == "off" and workers == 1):
        return ("global order",)
    return (policy, workers)


def resume_is_exact(saved_info: dict, current_info: dict) -> tuple[bool, str]:
    """Whether resuming a job whose input was ``saved_info`` (a ``sharding_info``) with input
    ``current_info`` replays the same global steps. Pure.

    Exact: DATA sharding (or one worker) at the same global batch, seed, shuffle and
    drop_remainder, whatever the worker and replica counts; FILE or OFF sharding only with
    the same number of workers. Never with a tf.data service (elements are assigned to
    trainers at run time).

    Returns:
        (exact, reason): the reason names what differs, or why it is exact.

    Example: ``resume_is_exact(old.sharding_info, new.sharding_info)[0]``.
    """
    for key in ("global_batch_size", "seed", "shuffle", "shuffle_buffer", "drop_remainder",
                "source"):
        if saved_info.get(key) != current_info.get(key):
            return False, (f"{key} differs: saved {saved_info.get(key)!r}, "
                           f"now {current_info.get(key)!r}")
    saved_steps, steps = saved_info.get("steps_per_epoch"), current_info.get("steps_per_epoch")
    if saved_steps is not None and steps is not None and saved_steps != steps:
        return False, (f"steps per epoch differ (saved {saved_steps}, now {steps}): the data or "
                       "its sharding changed")
    if "service" in (saved_info.get("policy"), current_info.get("policy")):
        return False, ("a tf.data service assigns elements to trainers at run time, so no two "
                       "runs have the same steps")
    saved_class, current_class = order_class(saved_info), order_class(current_info)
    if saved_class != current_class:
        return False, (f"the step sequence depends on the sharding: saved {saved_class}, now "
                       f"{current_class}; use shard_policy='data' for resumes on any worker count")
    if saved_class == ("global order",):
        return True, ("DATA sharding: step s is elements [s*B, (s+1)*B) of one global order, "
                      "whatever the worker and replica counts")
    return True, f"same {saved_class[0]} sharding over {saved_class[1]} worker(s)"
