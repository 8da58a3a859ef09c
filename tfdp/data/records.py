"""Record counts stored next to the files, and TFRecord writing and parsing.

Rule: steps per epoch never need a pass over the data. ``write_tfrecord_shards`` and the
opt-in ``count_records`` store each file's record count and byte size in the directory's
``INDEX_FILENAME``; ``record_counts`` trusts an entry only while its file keeps the recorded
size, and reads no record.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import tensorflow as tf

from tfdp.data.errors import DataShardingError, log

INDEX_FILENAME = ".tfdp-record-counts.json"
# Readers ``Files(reader=...)`` and ``count_records(reader=...)`` name.
READERS = {"tfrecord": tf.data.TFRecordDataset, "text": tf.data.TextLineDataset}


def match_files(patterns) -> list[str]:
    """Sorted file names matching one pattern or a list (``tf.io.gfile.glob`` syntax); the
    record-count index is never a data file; a pattern matching nothing raises."""
    patterns = [patterns] if isinstance(patterns, (str, os.PathLike)) else patterns
    names = []
    for p in patterns:
        matched = [m for m in tf.io.gfile.glob(os.fspath(p))
                   if os.path.basename(m) != INDEX_FILENAME]
        if not matched:
            raise DataShardingError(f"file pattern {os.fspath(p)!r} matches no file.")
        names.extend(matched)
    return sorted(set(names))


def reader_class(reader):
    """The dataset class for a reader name, None for a callable reader."""
    if callable(reader):
        return None
    if reader not in READERS:
        raise DataShardingError(f"Files(reader={reader!r}): use one of {sorted(READERS)} "
                                "or a callable filename -> Dataset.")
    return READERS[reader]


def _index_path(directory):
    return os.path.join(directory, INDEX_FILENAME)


def _read_index(directory) -> dict:
    path = _index_path(directory)
    try:
        with tf.io.gfile.GFile(path, "r") as f:
            return json.load(f).get("files", {})
    except (tf.errors.NotFoundError, FileNotFoundError):
        return {}
    except (ValueError, AttributeError) as e:
        log.info("tfdp.data: ignoring unreadable record-count index %s (%s)", path, e)
        return {}


def _write_index(counts: dict) -> None:
    """Merges ``{path: records}`` into each directory's index (atomic replace per directory)."""
    by_dir: dict = {}
    for path, n in counts.items():
        by_dir.setdefault(os.path.dirname(os.fspath(path)) or ".", {})[os.path.basename(path)] = (
            int(n), tf.io.gfile.stat(os.fspath(path)).length)
    for directory, entries in by_dir.items():
        files = _read_index(directory)
        files.update({name: {"records": n, "bytes": size} for name, (n, size) in entries.items()})
        tmp = _index_path(directory) + f".tmp-{os.getpid()}"
        with tf.io.gfile.GFile(tmp, "w") as f:
            json.dump({"format": "tfdp-record-counts/1", "files": files}, f, indent=0,
                      sort_keys=True)
        tf.io.gfile.rename(tmp, _index_path(directory), overwrite=True)


def record_counts(files: Sequence[str]) -> list[int] | None:
    """Records per file from the stored index, or None unless every file has a current entry.

    An entry counts only while its file still has the recorded size. Reads no record.

    Example: ``record_counts(paths)`` after ``write_tfrecord_shards`` gives the counts written.
    """
    indexes, counts = {}, []
    for path in files:
        directory = os.path.dirname(os.fspath(path)) or "."
        if directory not in indexes:
            indexes[directory] = _read_index(directory)
        entry = indexes[directory].get(os.path.basename(path))
        try:
            size = tf.io.gfile.stat(os.fspath(path)).length
        except tf.errors.NotFoundError:
            return None
        if not entry or entry.get("bytes") != size:
            return None
        counts.append(int(entry["records"]))
    return counts


def count_records(files: Sequence[str] | str, *, reader: str = "tfrecord",
                  compression_type: str = "", write_index: bool = True) -> list[int]:
    """Counts the records of each file, in parallel, without parsing any; stores the counts.

    The one opt-in counting pass: run it once after writing files by other means, and later
    ``distribute`` calls know the steps per epoch without reading. It reads every raw record
    (the readers check framing and checksums) in parallel over files.

    Args:
        files: paths or a glob pattern.
        reader: ``"tfrecord"``, ``"text"``.
        compression_type: ``""``, ``"GZIP"``, ``"ZLIB"``.
        write_index: store the counts in ``INDEX_FILENAME`` next to the files.

    Returns:
        Records per file, in the order given (sorted for a pattern).

    Example: ``tfdp.data.count_records("data/*.tfrecord")`` once, after writing the files.
    """
    paths = (match_files(files) if isinstance(files, (str, os.PathLike))
             else [os.fspath(f) for f in files])
    cls = reader_class(reader)
    if not paths:
        return []

    def add_batch(n, records):
        return n + tf.shape(records, out_type=tf.int64)[0]

    def records_in(filename):
        # Batches of raw records: one reduce step per 4096 records, not per record.
        return cls(filename, compression_type=compression_type).batch(4096).reduce(
            tf.constant(0, tf.int64), add_batch)

    counts_ds = tf.data.Dataset.from_tensor_slices(paths).map(
        records_in, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    counts = [int(n) for n in counts_ds]
    if write_index:
        _write_index(dict(zip(paths, counts)))
    return counts


def write_tfrecord_shards(dataset: tf.data.Dataset, directory, num_shards: int, *,
                          prefix: str = "shard",
                          assign: Callable[[int], int] | None = None) -> list[str]:
    """Writes a dataset of (nests of) tensors to ``num_shards`` TFRecord files.

    Each element becomes one ``tf.train.Example`` with one bytes feature per component
    (``tf.io.serialize_tensor``); read it back with ``tfrecord_parser(dataset.element_spec)``.
    The record count of each file goes into the directory's index (``INDEX_FILENAME``), so
    ``distribute`` knows the steps per epoch without reading the files.

    Args:
        dataset: unbatched elements.
        directory: created if missing.
        num_shards: number of files.
        prefix: file name prefix; files are ``{prefix}-00000-of-00004.tfrecord``.
        assign: element index -> shard index (default round-robin ``i % num_shards``), e.g.
            to make files of uneven sizes.

    Returns:
        The file paths, in shard order.

    Example: ``paths = write_tfrecord_shards(tf.data.Dataset.range(100), "/tmp/d", 4)``.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1.")
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"{prefix}-{i:05d}-of-{num_shards:05d}.tfrecord")
             for i in range(num_shards)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    counts = [0] * num_shards
    try:
        for i, element in enumerate(dataset):
            shard = (assign or (lambda k: k % num_shards))(i)
            features = {
                f"c{j}": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[tf.io.serialize_tensor(t).numpy()]))
                for j, t in enumerate(tf.nest.flatten(element))}
            writers[shard].write(tf.train.Example(
                features=tf.train.Features(feature=features)).SerializeToString())
            counts[shard] += 1
    finally:
        for w in writers:
            w.close()
    _write_index(dict(zip(paths, counts)))
    return paths


def tfrecord_parser(element_spec):
    """The parse function for files written by ``write_tfrecord_shards``.

    Example: ``Files(paths, parse_fn=tfrecord_parser(tf.TensorSpec([], tf.int64)))``.
    """
    flat = tf.nest.flatten(element_spec)
    description = {f"c{j}": tf.io.FixedLenFeature([], tf.string) for j in range(len(flat))}

    def parse(record):
        parsed = tf.io.parse_single_example(record, description)
        tensors = [tf.ensure_shape(tf.io.parse_tensor(parsed[f"c{j}"], spec.dtype), spec.shape)
                   for j, spec in enumerate(flat)]
        return tf.nest.pack_sequence_as(element_spec, tensors)

    return parse
