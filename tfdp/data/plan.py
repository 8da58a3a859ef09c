"""The plan: how each input pipeline builds its stream, decided once per ``distribute`` call.

Rules:

* Steps per epoch come, in order, from TensorFlow's cardinality; the record counts stored next
  to the files (when the pipeline keeps one element per record); a user-given ``num_examples``
  (a contradiction with a known count raises). Nothing else is read; where nothing is known the
  steps are unknown.
* A dataset's unseeded random transformations (``shuffle(n)``) are seeded from ``seed`` where
  the sharding needs every worker to draw the same order (``policy.unseeded_random_action``:
  DATA sharding across workers), on every worker alike, before any collective; where tfdp
  cannot rebuild the dataset it refuses, naming the fixes.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfdp.data import graph as graph_lib
from tfdp.data.errors import DataShardingError, log_once
from tfdp.data.policy import (choose_shard_policy, split_elements, unseeded_random_action,
                              unseeded_random_error, unseeded_random_matters)
from tfdp.data.records import record_counts
from tfdp.data.sources import Files


@dataclasses.dataclass
class Plan:
    """How each input pipeline builds its stream, decided once in ``distribute``."""
    kind: str                     # "files", "dataset", "function"
    policy: str
    reason: str
    source: object                # Files, Dataset (unbatched), or input function
    files: list | None = None
    native_files: bool = False    # a tf.data.Dataset sharded by TensorFlow's FILE rewrite
    counts: list | None = None    # elements per worker per epoch, when known
    counts_exact: bool = False    # counts from TensorFlow or the index, not num_examples
    count_note: str = ""          # why counts are unknown
    batched_per_replica: bool = False
    seeded: tuple = ()            # the source's unseeded random transformations tfdp seeded


# Off only in the guard test that shows what an unseeded shuffle does to DATA sharding.
_SEED_UNSEEDED = True


def make_plan(source, requested, num_workers, global_batch_size, per_replica,
              num_examples, seed=0, service=False) -> Plan:
    """The plan for a ``Files``, a ``tf.data.Dataset`` or an input function (``seed``: tfdp's
    shared seed; ``service``: the plan of a tf.data service's global stream)."""
    if isinstance(source, Files):
        return _plan_files(source, requested, num_workers, num_examples)
    if isinstance(source, tf.data.Dataset):
        return _plan_dataset(source, requested, num_workers, global_batch_size, per_replica,
                             num_examples, seed, service)
    if requested not in ("auto", "off"):
        raise DataShardingError(
            f"shard_policy={requested!r} with an input function: the function receives "
            "the InputContext and must shard itself; use shard_policy='auto' or 'off'.")
    plan = Plan("function", "off", "the input function shards with its InputContext", source)
    plan.count_note = "the input function's elements per worker are known only to it"
    return plan


def service_plan(source, service, num_workers, global_batch_size, per_replica,
                 num_examples, seed=0) -> Plan:
    """The plan for ``service=``: the global stream of a DATA plan, handed out by the service."""
    plan = make_plan(source, "data", num_workers, global_batch_size, per_replica, num_examples,
                     seed, service=True)
    plan.policy, plan.counts, plan.counts_exact = "service", None, False
    plan.reason = (f"tf.data service at {service.address} (distributed_epoch): each element "
                   "goes to exactly one trainer")
    plan.count_note = "a tf.data service assigns elements to trainers at run time"
    return plan


def check_num_examples(num_examples, known, where):
    if num_examples is not None and known is not None and num_examples != known:
        raise DataShardingError(
            f"num_examples={num_examples} but {where} says {known} elements per epoch; "
            "drop num_examples or fix it.")


def _plan_files(source: Files, requested, num_workers, num_examples) -> Plan:
    files = source.filenames()
    policy, reason = choose_shard_policy(requested, num_workers, len(files))
    per_file = record_counts(files) if source.reader_class() is not None else None
    plan = Plan("files", policy, reason, source, files=files)
    if per_file is not None:
        if policy == "file":
            plan.counts = [sum(per_file[w::num_workers]) for w in range(num_workers)]
        else:
            plan.counts = split_elements(sum(per_file), policy, num_workers)
        check_num_examples(num_examples, sum(per_file), "the record-count index")
        plan.counts_exact = True
    elif num_examples is not None and policy != "file":
        plan.counts = split_elements(num_examples, policy, num_workers)
    else:
        plan.count_note = ("no current record counts next to the files (write them with "
                           "tfdp.data.write_tfrecord_shards or tfdp.data.count_records)")
    return plan


def _plan_dataset(dataset, requested, num_workers, global_batch_size, per_replica,
                  num_examples, seed=0, service=False) -> Plan:
    cardinality = int(dataset.cardinality())
    needs_files = requested == "file" or (requested == "auto" and num_workers > 1)
    maybe_batched = graph_lib.maybe_batched(dataset.element_spec)
    facts = None
    if needs_files or maybe_batched or cardinality < 0:
        facts = graph_lib.analyze(dataset)
    batching = facts.batching if facts is not None and maybe_batched else None
    if batching is not None:
        graph_lib.check_batching(batching, global_batch_size, per_replica, "the dataset")
    files = facts.files if facts is not None else None
    not_by_file = facts.not_by_file if facts is not None else None
    policy, reason = choose_shard_policy(requested, num_workers,
                                         len(files) if files else None, not_by_file)
    dataset, seeded = seed_unseeded(dataset, facts, "service" if service else policy,
                                    num_workers, seed)
    elements = dataset.unbatch() if batching is not None else dataset
    plan = Plan("dataset", policy, reason, elements, files=list(files) if files else None,
                native_files=policy == "file", seeded=seeded)
    _count_dataset(plan, facts, batching, cardinality, num_workers, num_examples)
    return plan


def seed_unseeded(dataset, facts, policy, num_workers, seed):
    """(``dataset``, ()) or, where the sharding needs every worker to draw the same order, the
    dataset with its unseeded random transformations seeded from ``seed`` and what was seeded.
    Raises ``DataShardingError`` naming the fixes where tfdp cannot rebuild the dataset."""
    if not _SEED_UNSEEDED or not unseeded_random_matters(policy, num_workers):
        return dataset, ()  # one worker, FILE, OFF, service: no graph read for this
    graph = facts.graph if facts is not None else graph_lib.dataset_graph(dataset)
    if graph is None:
        log_once("tfdp.data: tfdp cannot read the dataset's graph, so it cannot check it for "
                 "shuffles without a seed; with DATA sharding over %d workers every shuffle in "
                 "it needs the same seed on every worker (shuffle(n, seed=S)).", num_workers)
        return dataset, ()
    unseeded = [op.describe() for op in graph_lib.random_ops(graph) if op.unseeded]
    action, why = unseeded_random_action(policy, num_workers, unseeded)
    if action == "keep":
        return dataset, ()
    try:
        rebuilt, seeded = graph_lib.with_seeds(dataset, seed)
    except (tf.errors.OpError, ValueError, TypeError) as e:
        raise DataShardingError(unseeded_random_error(
            unseeded, num_workers, f"rebuilding the dataset failed: {str(e).splitlines()[0]}")
        ) from e
    if int(rebuilt.cardinality()) != int(dataset.cardinality()):
        raise DataShardingError(unseeded_random_error(
            unseeded, num_workers, "the rebuilt dataset has another cardinality"))
    log_once("tfdp.data: seeded %s with seed=%d, the same on every worker: %s.",
             ", ".join(seeded), seed, why)
    return rebuilt, seeded


def _count_dataset(plan: Plan, facts, batching, cardinality, num_workers, num_examples):
    """Fills ``plan.counts`` (or ``plan.count_note``) for a ``tf.data.Dataset`` source."""

    def whole_batches(n):  # what the user's batching keeps of a stream of n elements
        if batching is not None and batching.drop_remainder:
            return n // batching.batch_size * batching.batch_size
        return n

    total = None
    if batching is None and cardinality >= 0:
        total = cardinality
    elif batching is not None and batching.count_preserved_above:
        if batching.drop_remainder and cardinality >= 0:
            total = cardinality * batching.batch_size
        elif batching.input_node is not None:
            below = graph_lib.count_below(facts.graph, batching.input_node)
            total = whole_batches(below) if below >= 0 else None
    per_file = None
    if (facts is not None and facts.files and facts.count_from_files
            and (batching is None or batching.count_preserved_above)):
        per_file = record_counts(facts.files)
    if plan.policy == "file":
        if per_file is not None:
            plan.counts = [whole_batches(sum(per_file[w::num_workers]))
                           for w in range(num_workers)]
            plan.counts_exact = True
        else:
            plan.count_note = ("sharded by file without current record counts next to the files "
                               "(tfdp.data.count_records writes them)")
        return
    if total is None and per_file is not None:
        total = whole_batches(sum(per_file))
    if total is not None:
        check_num_examples(num_examples, total, "the dataset")
        plan.counts_exact = True
    elif num_examples is not None:
        total = num_examples
    if total is not None:
        plan.counts = split_elements(total, plan.policy, num_workers)
    else:
        plan.count_note = ("TensorFlow does not know the dataset's size"
                           + (" and there are no current record counts next to its files"
                              if facts is not None and facts.files else ""))
