"""The strategy and its parts, one module per mechanism.

* ``data_parallel``: ``DataParallelStrategy`` itself (a ``tf.distribute.Strategy``).
* ``options``: the pure resolution of the constructor's arguments (communication, devices,
  deadlines, checks).
* ``devices``: local devices, ``configure_cpu_replicas``, GPUs shared between replicas.
* ``collectives``: the gradient all-reduce (buckets, launch order, pacing); ``buckets``: the
  bucket plan; ``wire``: dtypes, compression and options of every collective; ``riders``:
  values that ride with the gradients; ``replica_ops``: all-gather, reduce-scatter and
  broadcast in replica order, replica ids.
* ``xla``: the compiled per-replica step under the strategy.
* ``gradient_hooks``: tfdp's hooks in Keras's optimizer (gradients reduced before clipping,
  one overflow decision); ``sparse_gradients``: ``tf.IndexedSlices`` reduced into one device's
  form; ``replica_batch``: the replica function running in this thread and its batch.
* ``source_pipeline``: a distributed dataset's source pipeline without tf.data's autotune
  thread.
* ``deadline``: the per-step deadline that turns a missing peer into an error.
* ``agreement``: every worker learns the same small vector (one all-reduce, under the deadline).
* ``timing``: when a step's collectives wait and its batch is in hand (for the straggler
  monitor), a no-op unless something listens.
* ``randomness``: each replica draws what one device draws for its rows of the global batch.
* ``lifecycle``: the worker's side of the launcher protocol (ready files, SIGTERM, leaving
  together at exit).
* ``zero3``: ZeRO-3, a package of one rule per module (its ``__init__`` states them): ``config``
  (the settings), ``partition`` (the partition rule, pure), ``layout`` and ``gradients`` (what a
  read is), ``parameters`` (creation), ``optimizer`` (updates, clipping), ``units`` and
  ``units_xla`` (units gathered per layer), ``whole_reads`` (whole-tensor reads on several
  workers, led by the chief).
* ``keras_integration``: the one entry that installs (and uninstalls) tfdp's Keras patches.
* ``chief_writes``, ``consensus``: what those patches do for stock Keras saving, callbacks and
  decisions on several workers.

Importing this package does not import TensorFlow (``tfdp.resilience`` uses ``deadline``,
``agreement`` and ``timing`` without it); ``DataParallelStrategy`` loads on first use.
"""

import importlib as _importlib

__all__ = ["DataParallelStrategy", "is_data_parallel"]


def is_data_parallel(strategy) -> bool:
    """Whether ``strategy`` is a ``DataParallelStrategy``: the one test tfdp's modules use.

    A marker attribute rather than ``isinstance``, so that the strategy's own parts
    (collectives, xla) can ask without importing the module that imports them.
    """
    return bool(getattr(strategy, "_is_tfdp_strategy", False))


def __getattr__(name):
    if name == "DataParallelStrategy":
        return _importlib.import_module("tfdp.strategy.data_parallel").DataParallelStrategy
    raise AttributeError(f"module 'tfdp.strategy' has no attribute {name!r}")
