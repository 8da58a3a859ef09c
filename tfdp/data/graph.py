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
* Random transformations (``shuffle``, ``Dataset.random``, ``sample_from_datasets``) whose
  seeds are both 0 in the graph (TensorFlow's record of "no seed": no op seed and no global
  seed) draw other seeds in every process. ``random_ops`` finds them, in the graph and in its
  functions, in an order fixed by the graph's structure; ``with_seeds`` rebuilds the dataset
  with them seeded from tfdp's ``seed`` (public ops only: ``DatasetToGraphV2``,
  ``DatasetFromGraph``, ``from_variant``), so that every worker draws the same order.
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


# Random transformations: (the API that builds it, the input index of seed, of seed2, of its
# seed-generator resource or None). ShuffleDatasetV2 keeps its seeds in a resource, not in the
# graph; TensorFlow 2.21 builds V3 (V1 in TF1 graphs).
RANDOM_OPS = {
    "ShuffleDataset": ("shuffle", 2, 3, None),
    "ShuffleDatasetV3": ("shuffle", 2, 3, 4),
    "ShuffleAndRepeatDataset": ("shuffle_and_repeat", 2, 3, None),
    "ShuffleAndRepeatDatasetV2": ("shuffle_and_repeat", 2, 3, 5),
    "RandomDataset": ("Dataset.random/sample_from_datasets", 0, 1, None),
    "RandomDatasetV2": ("Dataset.random/sample_from_datasets", 0, 1, 2),
    "ExperimentalRandomDataset": ("Dataset.random/sample_from_datasets", 0, 1, None),
}


@dataclasses.dataclass(frozen=True)
class RandomOp:
    """One random transformation in a dataset graph and the seeds it holds."""
    op: str
    node: str
    function: str | None      # the graph function it is in (an interleave's, ...); None: top level
    seeds: tuple              # (seed, seed2), each an int where it is a constant, else None
    buffer_size: int | None = None

    @property
    def unseeded(self) -> bool:
        """Both seeds 0: TensorFlow draws fresh seeds for it in every process."""
        return self.seeds == (0, 0)

    def describe(self) -> str:
        api = RANDOM_OPS[self.op][0]
        if api.startswith("shuffle"):
            api = f"{api}({self.buffer_size if self.buffer_size is not None else '...'})"
        return api + (f" inside the function {self.function}" if self.function else "")


def _functions_named(attr):
    kind = attr.WhichOneof("value")
    if kind == "func":
        return [attr.func.name]
    return [f.name for f in attr.list.func] if kind == "list" else []


def _graph_order(graph):
    """([(scope, node)], {scope: {name: node}}): every node the output depends on, in an order
    fixed by the graph's structure (inputs in order, then the functions its attributes name;
    scope: the function a node is in, None at top level), never by names, which may differ
    between processes that built the same pipeline."""
    functions = {f.signature.name: f for f in graph.library.function}
    scopes = {None: {n.name: n for n in graph.node}}
    stack = [(None, next(n for n in graph.node if n.op == "_Retval"))]
    seen, order = set(), []
    while stack:
        scope, node = stack.pop()
        if (scope, node.name) in seen:
            continue
        seen.add((scope, node.name))
        order.append((scope, node))
        children = [(scope, scopes[scope][input_name(ref)]) for ref in node.input
                    if input_name(ref) in scopes[scope]]
        for key in sorted(node.attr):
            for name in _functions_named(node.attr[key]):
                fn = functions.get(name)
                if fn is None:
                    continue
                body = scopes.setdefault(name, {n.name: n for n in fn.node_def})
                children += [(name, body[input_name(fn.ret[arg.name])])
                             for arg in fn.signature.output_arg
                             if input_name(fn.ret[arg.name]) in body]
        stack.extend(reversed(children))
    return order, scopes


def random_ops(graph) -> list:
    """The ``RandomOp``s of a dataset graph, in ``_graph_order``'s order."""
    order, scopes = _graph_order(graph)
    found = []
    for scope, node in order:
        if node.op not in RANDOM_OPS:
            continue
        _, seed_at, seed2_at, _ = RANDOM_OPS[node.op]
        seeds = tuple(None if v is None else int(v) for v in
                      (const(node.input[seed_at], scopes[scope]),
                       const(node.input[seed2_at], scopes[scope])))
        size = const(node.input[1], scopes[scope]) if seed_at == 2 else None
        found.append(RandomOp(node.op, node.name, scope, seeds,
                              None if size is None else int(size)))
    return found


def _seed_op(nodes, op: RandomOp, seeds, k):
    """Points ``op``'s seed inputs in ``nodes`` (a graph's or a function's) at new constants
    ``seeds`` and its seed generator at a new dummy one."""
    target = next(n for n in nodes if n.name == op.node)
    _, seed_at, seed2_at, generator_at = RANDOM_OPS[op.op]
    in_function = op.function is not None
    for value, at, name in ((seeds[0], seed_at, f"tfdp_seed_{k}"),
                            (seeds[1], seed2_at, f"tfdp_seed2_{k}")):
        node = tf.compat.v1.NodeDef(name=name, op="Const")
        node.attr["dtype"].type = tf.int64.as_datatype_enum
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int64(value)))
        nodes.append(node)  # a copy: complete it first
        target.input[at] = name + (":output:0" if in_function else "")
    if generator_at is not None:
        # The serialized seed generator is the original's resource (a constant handle), which
        # keeps drawing from the original's random seeds; a dummy one makes the op create its
        # own from the seeds above.
        name = f"tfdp_seed_generator_{k}"
        nodes.append(tf.compat.v1.NodeDef(name=name, op="DummySeedGenerator"))
        target.input[generator_at] = name + (":handle:0" if in_function else "")


def with_seeds(dataset, seed: int):
    """``dataset`` rebuilt with its unseeded random transformations seeded: the k-th of them in
    ``random_ops``' order gets seeds (``seed``, k + 1), the same on every worker that built the
    same pipeline. Returns (the dataset, descriptions of what was seeded). Raises TensorFlow's
    error where the graph cannot be rebuilt.

    The rest of the graph is unchanged: a shuffle keeps its ``reshuffle_each_iteration`` (a new
    order per iterator, the same on every worker, as ``shuffle(n, seed=S)``).
    """
    serialized = tf.raw_ops.DatasetToGraphV2(
        input_dataset=tf.data.experimental.to_variant(dataset), external_state_policy=1,
        strip_device_assignment=False)
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized.numpy())
    # Devices cleared here rather than by strip_device_assignment, which leaves '/device::0'
    # on a py_function's EagerPyFunc, which then fails to run (measured, TF 2.21).
    for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
        node.device = ""
    unseeded = [op for op in random_ops(graph) if op.unseeded]
    bodies = {f.signature.name: f.node_def for f in graph.library.function}
    for k, op in enumerate(unseeded):
        _seed_op(graph.node if op.function is None else bodies[op.function], op, (seed, k + 1), k)
    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
    rebuilt = tf.data.experimental.from_variant(variant, dataset.element_spec)
    # Kept alive with it: the graph may name state the original's Python objects own (the
    # callbacks of from_generator and py_function, resources). TensorFlow kept those callbacks
    # registered after the original was collected (measured), but does not promise it.
    rebuilt._tfdp_unseeded_source = dataset
    return rebuilt, tuple(op.describe() for op in unseeded)


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
