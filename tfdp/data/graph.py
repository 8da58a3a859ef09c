"""Reading a ``tf.data.Dataset``'s graph: the files it reads, whether FILE sharding is exactly
once, and its outermost batching.

Rules:

* tfdp reads the dataset's graph (TensorFlow's ``DatasetToGraphV2``) to find a reader
  (TFRecord, text line, fixed-length records) over a list of names, as
  ``TFRecordDataset(files)``, ``Dataset.list_files(...).interleave(reader)`` or
  ``from_tensor_slices(files).interleave(reader)`` build.
* FILE sharding is TensorFlow's own auto-shard rewrite (``AutoShardDataset`` with
  ``AutoShardPolicy.FILE``), used only where it is exactly once: the names are a constant list
  (counted before any collective) and between the reader and the output there are only
  transformations that treat elements alike (map, filter, shuffle, cache, prefetch, repeat,
  batch); ``take``, ``skip``, ``shard``, ``window``, ``zip`` or an unknown op there would act
  per worker.
* An outermost ``batch``/``map_and_batch`` of ``global_batch_size`` is undone (unbatch, then
  batch per replica); another size, ``padded_batch``, bucketing or ``rebatch`` are refused.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import tensorflow as tf

from tfdp import _tf_private
from tfdp.data.errors import DataShardingError, log_once
from tfdp.data.records import INDEX_FILENAME

# Transformations that treat every element alike and keep the element count.
ELEMENTWISE = {
    "MapDataset", "ParallelMapDataset", "PrefetchDataset", "OptionsDataset", "ModelDataset",
    "OptimizeDataset", "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
    "ExperimentalMaxIntraOpParallelismDataset", "ExperimentalPrivateThreadPoolDataset",
    "ShuffleDataset", "CacheDataset", "AssertNextDataset", "AssertPrevDataset",
    "ParseExampleDataset", "Identity", "AssertCardinalityDataset",
}
# Per-element (or whole-stream) decisions: sharding by file keeps exactly-once, counts change.
COUNT_CHANGING = {"FilterDataset", "RepeatDataset", "UnbatchDataset", "ShuffleAndRepeatDataset",
                  "IgnoreErrorsDataset"}
BATCHING = {"BatchDataset", "ParallelBatchDataset", "PaddedBatchDataset", "MapAndBatchDataset",
            "ExperimentalMapAndBatchDataset"}
OTHER_BATCHING = {"RebatchDataset": "rebatch", "GroupByWindowDataset": "group_by_window/"
                  "bucket_by_sequence_length", "DenseToSparseBatchDataset": "dense_to_sparse_batch",
                  "GroupByReducerDataset": "group_by_reducer"}
FUNC_DATASETS = {"FlatMapDataset", "InterleaveDataset", "ParallelInterleaveDataset",
                 "LegacyParallelInterleaveDataset", "ExperimentalParallelInterleaveDataset"}
READERS = {"TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset"}
BATCH_API_NAME = {"BatchDataset": "batch", "ParallelBatchDataset": "batch",
                  "PaddedBatchDataset": "padded_batch", "MapAndBatchDataset": "map_and_batch",
                  "ExperimentalMapAndBatchDataset": "map_and_batch"}
# Transformations that act on positions in the stream: per worker they would pick other
# elements than on the whole stream.
POSITIONAL = {"TakeDataset": "take", "SkipDataset": "skip", "ShardDataset": "shard",
              "WindowDataset": "window", "ZipDataset": "zip/enumerate",
              "ConcatenateDataset": "concatenate", "ScanDataset": "scan"}


@dataclasses.dataclass(frozen=True)
class Batching:
    """The outermost batching of a dataset."""
    api: str                      # "batch", "padded_batch", "map_and_batch", "rebatch", ...
    batch_size: int | None
    drop_remainder: bool | None
    input_node: str | None        # the node it batches (to count the unbatched elements)
    count_preserved_above: bool   # only element-wise transformations after it

    def describe(self) -> str:
        args = [str(self.batch_size) if self.batch_size is not None else "?"]
        if self.drop_remainder:
            args.append("drop_remainder=True")
        return f"{self.api}({', '.join(args)})"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What tfdp reads from a dataset's graph."""
    files: tuple | None           # files read, in the order FILE sharding deals them out
    reader: str | None
    not_by_file: str | None       # why FILE sharding would not be exactly once
    count_from_files: bool        # one output element per record read (before any batching)
    batching: Batching | None
    graph: object = dataclasses.field(repr=False, default=None)


def base_op(op: str) -> str:
    return re.sub(r"V\d+$", "", op)


def input_name(ref: str) -> str:
    return ref.lstrip("^").split(":")[0]


def dataset_graph(dataset):
    """The dataset's GraphDef, or None when TensorFlow cannot serialize it (e.g. > 2 GB)."""
    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=1,  # IGNORE: tfdp only reads the graph
            strip_device_assignment=True)
        graph = tf.compat.v1.GraphDef()
        graph.ParseFromString(serialized.numpy())
        return graph
    except (tf.errors.OpError, ValueError) as e:
        log_once("tfdp.data: cannot read the dataset's graph (%s); treating it as a dataset of "
                 "unbatched elements that reads no files tfdp can see.", str(e).split("\n")[0])
        return None


def const(ref, nodes):
    """The value of the constant ``ref`` names (through Identity nodes), else None."""
    node = nodes.get(input_name(ref))
    while node is not None and node.op == "Identity":
        node = nodes.get(input_name(node.input[0]))
    if node is None or node.op != "Const":
        return None
    proto = node.attr["value"].tensor
    # parse_tensor also reads string constants, whose packed encoding make_ndarray cannot.
    return tf.io.parse_tensor(proto.SerializeToString(), tf.dtypes.as_dtype(proto.dtype)).numpy()


def batching_of(node, nodes, count_preserved_above) -> Batching:
    op = base_op(node.op)
    if op in OTHER_BATCHING:
        return Batching(OTHER_BATCHING[op], None, None, None, count_preserved_above)
    size_ref = node.input[-3] if "MapAndBatch" in op else node.input[1]
    size, drop = const(size_ref, nodes), const(node.input[-1], nodes)
    return Batching(BATCH_API_NAME[op], None if size is None else int(size),
                    None if drop is None else bool(drop), input_name(node.input[0]),
                    count_preserved_above)


def reader_in_function(name, functions, depth=0):
    """(reader op, one element per record) when function ``name`` reads the file it is given."""
    fn = functions.get(name)
    if fn is None or depth > 4 or not fn.signature.output_arg:
        return None
    fn_nodes = {n.name: n for n in fn.node_def}
    node = fn_nodes.get(input_name(fn.ret[fn.signature.output_arg[0].name]))
    per_record = True
    while node is not None:
        op = base_op(node.op)
        if op in READERS:
            return (op, per_record) if node.input and node.input[0].startswith("args_0") else None
        if op in FUNC_DATASETS:
            inner = reader_in_function(node.attr["f"].func.name, functions, depth + 1)
            return None if inner is None else (inner[0], per_record and inner[1])
        if op in COUNT_CHANGING or op in BATCHING:
            per_record = False
        elif op not in ELEMENTWISE:
            return None
        node = fn_nodes.get(input_name(node.input[0])) if node.input else None
    return None


def file_names(ref, nodes):
    """(names, None) for a constant list of file names, else (None, reason)."""
    node = nodes.get(input_name(ref))
    # TensorFlow's FILE rewrite moves shuffles of the names after its shard.
    while node is not None and base_op(node.op) in ("ShuffleDataset", "PrefetchDataset",
                                                     "OptionsDataset"):
        node = nodes.get(input_name(node.input[0]))
    if node is None or base_op(node.op) not in ("TensorSliceDataset", "TensorDataset"):
        found = "nothing" if node is None else node.op
        return None, (f"its file names come from {found}, not a constant list tfdp can check; "
                      "pass the list itself (TFRecordDataset(files), from_tensor_slices(files), "
                      "Dataset.list_files(pattern))")
    value = const(node.input[0], nodes)
    if value is None or value.dtype.kind not in "OSU":
        return None, "its file names are computed at run time, so tfdp cannot count them"
    names = tuple(v.decode() if isinstance(v, bytes) else str(v) for v in np.ravel(value))
    return names, None


def _reader_facts(node, nodes, functions, not_by_file, per_record, batching, graph) -> Facts:
    """Facts of a dataset whose source is ``node``, an interleave/flat_map of a function."""
    reader = reader_in_function(node.attr["f"].func.name, functions)
    if reader is None:
        return Facts(None, None, f"its source is {node.op} of a function that reads no file",
                     False, batching, graph)
    files, names_reason = file_names(node.input[0], nodes)
    if files and any(os.path.basename(f) == INDEX_FILENAME for f in files):
        raise DataShardingError(
            f"the dataset reads tfdp's record-count index {INDEX_FILENAME!r} as data: its "
            "file pattern is too wide (e.g. 'dir/*'); match the data files only, e.g. "
            "'dir/*.tfrecord'.")
    return Facts(files, reader[0], not_by_file or names_reason, per_record and reader[1],
                 batching, graph)


def analyze(dataset) -> Facts:
    """Reads ``dataset``'s graph: its files, whether FILE sharding is exactly once, its batching.

    Walks from the output towards the source; ``walk`` holds what is known so far.
    """
    graph = dataset_graph(dataset)
    if graph is None:
        return Facts(None, None, "tfdp cannot read its graph", False, None, None)
    nodes = {n.name: n for n in graph.node}
    functions = {f.signature.name: f for f in graph.library.function}
    sink = next(n for n in graph.node if n.op == "_Retval")
    node = nodes.get(input_name(sink.input[0]))
    walk = _Walk()
    while node is not None:
        op = base_op(node.op)
        if op in FUNC_DATASETS:
            return _reader_facts(node, nodes, functions, walk.not_by_file, walk.per_record,
                                 walk.batching, graph)
        stop = walk.step(op, node, nodes)
        if stop is not None:
            return Facts(None, None, stop, False, walk.batching, graph)
        node = nodes.get(input_name(node.input[0])) if node.input else None
    return Facts(None, None, "tfdp found no file reader in it", False, walk.batching, graph)


@dataclasses.dataclass
class _Walk:
    """What ``analyze`` learned on its way from the output to the source."""
    batching: Batching | None = None
    batch_possible: bool = True       # a batching found now can still be the outermost
    elementwise_so_far: bool = True   # only element-wise ops between the output and here
    per_record: bool = True           # one output element per record read
    not_by_file: str | None = None

    def step(self, op, node, nodes) -> str | None:
        """Takes in one op; returns why the walk ends here (no reader below), else None."""
        if op in BATCHING or op in OTHER_BATCHING:
            self._batching(op, batching_of(node, nodes, self.elementwise_so_far))
        elif op in ELEMENTWISE:
            pass
        elif op in COUNT_CHANGING:
            self.per_record = self.elementwise_so_far = False
            self.batch_possible = self.batch_possible and op != "UnbatchDataset"
        elif op in POSITIONAL:
            self.not_by_file = self.not_by_file or (
                f"it applies {POSITIONAL[op]}(), which would act per worker")
            self.per_record = self.elementwise_so_far = False
            if op in ("WindowDataset", "ZipDataset", "ConcatenateDataset", "ScanDataset"):
                self.batch_possible = False
            if op in ("ZipDataset", "ConcatenateDataset"):
                return self.not_by_file
        else:
            return self.not_by_file or f"its source is {node.op}, not a reader of a list of files"
        return None

    def _batching(self, op, found: Batching):
        if self.batch_possible:
            self.batching, self.batch_possible = found, False
        else:
            self.per_record = False
            if found.drop_remainder is not False or op in OTHER_BATCHING:
                self.not_by_file = self.not_by_file or (
                    f"it applies {found.describe()} before its last batching, which would "
                    "drop or group elements per worker")
        self.elementwise_so_far = False


def count_below(graph, node_name) -> int:
    """TensorFlow's cardinality of the part of a dataset graph that ends at ``node_name``."""
    sub = tf.compat.v1.GraphDef()
    sub.CopyFrom(graph)
    for n in sub.node:
        if n.op == "_Retval":
            n.input[0] = node_name
    variant = tf.raw_ops.DatasetFromGraph(graph_def=sub.SerializeToString())
    return int(tf.raw_ops.DatasetCardinality(input_dataset=variant))


def file_shard(dataset, num_shards, index):
    """TensorFlow's FILE auto-shard rewrite for input pipeline ``index`` of ``num_shards``."""
    types, shapes = _tf_private.dataset_flat_types_and_shapes(dataset.element_spec)
    variant = tf.raw_ops.AutoShardDataset(
        input_dataset=tf.data.experimental.to_variant(dataset), num_workers=num_shards,
        index=index, auto_shard_policy=int(tf.data.experimental.AutoShardPolicy.FILE),
        num_replicas=0, output_types=types, output_shapes=shapes)
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def maybe_batched(spec) -> bool:
    """Whether elements of ``spec`` could be batches: every component has a leading dimension."""
    flat = tf.nest.flatten(spec)
    return bool(flat) and all(getattr(s, "shape", tf.TensorShape(None)).rank not in (None, 0)
                              for s in flat)


def check_batching(batching: Batching, global_batch_size, per_replica, where):
    """Raises unless ``batching`` can be undone exactly (unbatch, then batch per replica)."""
    fix_source = ("pass the dataset before it is batched (tfdp batches per replica), or an input "
                  "function returning per-replica batches of "
                  f"ctx.get_per_replica_batch_size({global_batch_size}) = {per_replica}")
    if batching.api not in ("batch", "map_and_batch"):
        raise DataShardingError(
            f"{where} is already batched with {batching.describe()}; tfdp cannot split those "
            f"batches into per-replica batches exactly (unbatching would keep their padding or "
            f"grouping). Fix: {fix_source}.")
    if batching.batch_size != global_batch_size:
        raise DataShardingError(
            f"{where} is already batched with {batching.describe()} but "
            f"global_batch_size={global_batch_size}. Fix: pass global_batch_size="
            f"{batching.batch_size} to train on these batches, or {fix_source}.")


def returns_per_replica_batches(dataset, global_batch_size, per_replica) -> bool:
    """Whether an input function's dataset is already batched per replica (TF's contract)."""
    if not maybe_batched(dataset.element_spec):
        return False
    batching = analyze(dataset).batching
    if batching is None:
        return False
    if batching.batch_size == per_replica:
        return True
    raise DataShardingError(
        f"the input function's dataset is batched with {batching.describe()}; return unbatched "
        f"elements (tfdp batches them) or per-replica batches of ctx.get_per_replica_batch_size("
        f"{global_batch_size}) = {per_replica}.")
