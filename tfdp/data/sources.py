"""What ``distribute`` reads: ``Files``, a ``Service`` address, and source normalisation.

Rule: a source is a ``tf.data.Dataset`` (unbatched, or batched by ``global_batch_size``), a
``Files`` (patterns globbed and sorted, read with a reader, parsed after sharding and
skipping), a pattern or list of files with ``parse_fn`` (made a ``Files``), or a function of
``tf.distribute.InputContext``; anything else is refused by name.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Sequence

import tensorflow as tf

from tfdp import _tf_private
from tfdp.data import records
from tfdp.data.errors import DataShardingError


@dataclasses.dataclass(frozen=True)
class Files:
    """A file-based source: file patterns (globbed, sorted) and a parse function.

    Args:
        patterns: a pattern or list of patterns/paths (``tf.io.gfile.glob`` syntax). tfdp's
            record-count index (``INDEX_FILENAME``) is never taken as a data file.
        parse_fn: maps one serialized record to one element; None yields raw records.
        reader: ``"tfrecord"`` or ``"text"``; or a callable ``filename -> Dataset``.
        compression_type: passed to the reader (``""``, ``"GZIP"``, ``"ZLIB"``).

    Steps per epoch come from the record counts stored next to the files
    (``write_tfrecord_shards``, ``count_records``) or ``distribute(..., num_examples=)``;
    nothing is read before training.

    Example: ``tfdp.data.Files("data/train-*.tfrecord", parse_fn=parse)``.
    """

    patterns: Sequence[str] | str
    parse_fn: Callable | None = None
    reader: str | Callable = "tfrecord"
    compression_type: str = ""

    def filenames(self) -> list[str]:
        return records.match_files(self.patterns)

    def reader_class(self):
        return records.reader_class(self.reader)

    def open(self, filenames) -> tf.data.Dataset:
        if callable(self.reader):
            # The reader is the user's: AutoGraph on, as for any function given to tf.data,
            # although tfdp opens the files inside its own unconverted pipeline function.
            return filenames.interleave(_tf_private.autograph_user_function(self.reader),
                                        num_parallel_calls=tf.data.AUTOTUNE,
                                        deterministic=True)
        cls = self.reader_class()
        return filenames.interleave(lambda f: cls(f, compression_type=self.compression_type),
                                    cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE,
                                    deterministic=True)

    def get_config(self):
        return {"patterns": self.patterns, "parse_fn": self.parse_fn, "reader": self.reader,
                "compression_type": self.compression_type}


@dataclasses.dataclass(frozen=True)
class Service:
    """Where a tf.data service dispatcher runs, for ``distribute(..., service=...)``.

    Args:
        address: ``"grpc://host:port"`` (or ``"host:port"``) of the dispatcher.
        job_name: the shared job all trainers read; default: a name the workers agree on
            at ``distribute`` time (unique per call, so a long-lived service never hands a
            finished job of an earlier run to a new one).
        connect_timeout_seconds: how long ``distribute`` waits for the dispatcher before
            raising ``DataShardingError`` naming the address.

    Example: ``distribute(strategy, ds, 256, service=Service("grpc://10.0.0.5:5050"))``.
    """

    address: str
    job_name: str | None = None
    connect_timeout_seconds: float = 30.0

    def __post_init__(self):
        protocol, _, rest = self.address.rpartition("://")
        if protocol not in ("", "grpc") or not re.fullmatch(r"[^:/\s]+:\d+", rest):
            raise DataShardingError(
                f"service={self.address!r} is not a tf.data service address; use "
                "'grpc://host:port' (the dispatcher's address, e.g. 'grpc://10.0.0.5:5050').")

    @property
    def target(self) -> str:
        return "grpc://" + self.host_port

    @property
    def host_port(self) -> str:
        return self.address.rpartition("://")[2]

    def get_config(self):
        return {"address": self.address, "job_name": self.job_name,
                "connect_timeout_seconds": self.connect_timeout_seconds}


def normalise_source(dataset_or_fn, parse_fn):
    """A ``Files``, a ``tf.data.Dataset`` or an input function; errors name what else to pass."""
    if isinstance(dataset_or_fn, (str, os.PathLike)) or (
            isinstance(dataset_or_fn, (list, tuple)) and dataset_or_fn
            and all(isinstance(p, (str, os.PathLike)) for p in dataset_or_fn)):
        return Files(dataset_or_fn, parse_fn=parse_fn)
    if parse_fn is not None:
        raise DataShardingError("parse_fn applies to file sources only; map the dataset yourself "
                                "or pass tfdp.data.Files(patterns, parse_fn).")
    if isinstance(dataset_or_fn, (tf.data.Dataset, Files)) or callable(dataset_or_fn):
        return dataset_or_fn
    raise DataShardingError(
        f"cannot distribute a {type(dataset_or_fn).__name__}; pass a tf.data.Dataset, a "
        "tfdp.data.Files, a list of files with parse_fn, or a function of InputContext.")


def normalise_service(service, source):
    """The ``Service`` for ``service=``; refuses sources the service cannot run."""
    service = service if isinstance(service, Service) else Service(str(service))
    if not isinstance(source, (tf.data.Dataset, Files)):
        raise DataShardingError(
            "service= needs a tf.data.Dataset or tfdp.data.Files: the service runs the whole "
            "pipeline, so an input function (which shards itself per worker) cannot be sent.")
    return service
