"""The plan: how each input pipeline builds its stream, decided once per ``distribute`` call.

Rule: steps per epoch come, in order, from TensorFlow's cardinality; the record counts stored
next to the files (when the pipeline keeps one element per record); a user-given
``num_examples`` (a contradiction with a known count raises). Nothing else is read; where
nothing is known the steps are unknown.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfdp.data import graph as graph_lib
from tfdp.data.errors import DataShardingError
from tfdp.data.policy import choose_shard_policy, split_elements
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


def make_plan(source, requested, num_workers, global_batch_size, per_replica,
              num_examples) -> Plan:
    """The plan for a ``Files``, a ``tf.data.Dataset`` or an input function."""
    if isinstance(source, Files):
        return _plan_files(source, requested, num_workers, num_examples)
    if isinstance(source, tf.data.Dataset):
        return _plan_dataset(source, requested, num_workers, global_batch_size, per_replica,
                             num_examples)
    if requested not in ("auto", "off"):
        raise DataShardingError(
            f"shard_policy={requested!r} with an input function: the function receives "
            "the InputContext and must shard itself; use shard_policy='auto' or 'off'.")
    plan = Plan("function", "off", "the input function shards with its InputContext", source)
    plan.count_note = "the input function's elements per worker are known only to it"
    return plan


def service_plan(source, service, num_workers, global_batch_size, per_replica,
                 num_examples) -> Plan:
    """The plan for ``service=``: the global stream of a DATA plan, handed out by the service."""
    plan = make_plan(source, "data", num_workers, global_batch_size, per_replica, num_examples)
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
                  num_examples) -> Plan:
    cardinality = int(dataset.cardinality())
    needs_files = requested == "file" or (requested == "auto" and num_workers > 1)
    maybe_batched = graph_lib.maybe_batched(dataset.element_spec)
    facts = None
    if needs_files or maybe_batched or cardinality < 0:
        facts = graph_lib.analyze(dataset)
    batching = facts.batching if facts is not None and maybe_batched else None
    elements = dataset
    if batching is not None:
        graph_lib.check_batching(batching, global_batch_size, per_replica, "the dataset")
        elements = dataset.unbatch()
    files = facts.files if facts is not None else None
    not_by_file = facts.not_by_file if facts is not None else None
    policy, reason = choose_shard_policy(requested, num_workers,
                                         len(files) if files else None, not_by_file)
    plan = Plan("dataset", policy, reason, elements, files=list(files) if files else None,
                native_files=policy == "file")
    _count_dataset(plan, facts, batching, cardinality, num_workers, num_examples)
    return plan


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
