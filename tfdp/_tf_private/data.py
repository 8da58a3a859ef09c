"""tf.data internals: the distributed dataset Keras trains on and the pipelines tfdp.data builds.

What lives here: the cardinality and end-of-data agreement of a distributed dataset
(tfdp/data/distributed.py, tfdp/data/pipeline.py), the flat variant types a dataset op takes
(tfdp/data/graph.py's auto-shard rewrite), and AutoGraph for a user's pipeline function
(tfdp/data/sources.py). Each entry says why no public API serves; tests/test_tf_private.py
pins them.
"""

from __future__ import annotations

# Why: tfdp builds each epoch's pipeline inside a tf.data function of its own (the per-iterator
# ``flat_map`` of tfdp/data/pipeline.py), which it marks with the public ``do_not_convert``:
# AutoGraph's conversion of tfdp's own pipeline code cost 0.7 s of ``distribute()``'s 0.8 s on
# this host (cProfile), and that code has no tensor-dependent Python control flow. But the mark
# holds for every function traced beneath it, so a user's ``Files`` parse function or reader
# would lose AutoGraph (a Python ``if`` on a tensor would fail) where the same function passed
# to ``Dataset.map`` is converted. Public APIs only turn conversion off; turning it back on for
# the user's function needs AutoGraph's control-status context.
from tensorflow.python.autograph.core import ag_ctx as _ag_ctx
from tensorflow.python.autograph.impl import api as _autograph_api

# Why: tfdp.data shards native file pipelines with TensorFlow's own FILE auto-shard rewrite,
# the public op tf.raw_ops.AutoShardDataset, applied per input pipeline. The op needs the
# dataset's flat output types and shapes; for composite elements (SparseTensor from
# VarLenFeature, RaggedTensor) these are tf.data's internal variant encodings, which only this
# tf.data helper computes (Dataset._flat_structure uses it); no public API exposes them.
from tensorflow.python.data.util import structure as _data_structure

# Why: the per-replica pipelines of a distributed dataset (each replica's prefetch from the
# multi-device iterator) are built by this module's ``_create_device_dataset`` with default
# options, which no public option reaches (a user's options stay on the source pipeline).
# Their iterators then each run a tf.data autotune thread that sleeps up to 60 s between
# passes, and destroying the iterator (the end of every ``fit`` epoch) waits for that thread:
# it is woken by the cancellation but can check for it before the cancellation is marked
# done, and go back to sleep (measured: fit returned 25-88 s after its last step, under tfdp
# and MirroredStrategy alike; issue 41's examples, issue 44's slow tests). The source pipeline
# has the same thread; tfdp's strategy turns it off there through the public options
# (tfdp/strategy/source_pipeline.py).
from tensorflow.python.data.ops import multi_device_iterator_ops as _multi_device_iterator_ops


# --- The distributed dataset (distributed.py, pipeline.py) ---------------------------------

def set_distributed_dataset_cardinality(distributed_dataset, steps: int) -> None:
    """Makes ``distributed_dataset.cardinality`` the number of global steps per epoch.

    Why: for ``distribute_datasets_from_function`` TensorFlow reports the cardinality of
    one worker's dataset (per-replica batches), which Keras reads as steps per epoch; it
    then keeps stepping past the end, and TensorFlow's partial-batch handling feeds one
    extra step of empty dummy batches, which still moves momentum/Adam state and the
    iteration counter. No public API sets the cardinality of a distributed dataset.
    """
    distributed_dataset._cardinality = steps  # noqa: SLF001


def skip_end_of_data_agreement(distributed_dataset) -> bool:
    """Makes the iterators of ``distributed_dataset`` take batches without the workers'
    end-of-data agreement; returns False (and changes nothing) for objects without it.

    Why: in multi-worker mode TensorFlow's distributed iterator all-reduces, on every
    ``get_next``, how many replicas still have data (``_calculate_replicas_with_values``),
    unless the per-worker dataset is infinite: one cross-worker collective per step. tfdp.data
    turns it off only where every worker's pipeline yields exactly the same number of
    batches (tfdp/data/pipeline.py), so the workers run out together without agreeing. No
    public API turns the agreement off for a finite dataset.
    """
    if not hasattr(distributed_dataset, "_enable_get_next_as_optional"):
        return False
    distributed_dataset._enable_get_next_as_optional = False  # noqa: SLF001
    return True


def end_of_data_agreement(distributed_dataset) -> bool | None:
    """Whether iterators of ``distributed_dataset`` run TensorFlow's partial-batch handling
    (in multi-worker mode: the per-step end-of-data all-reduce); None when not applicable."""
    return getattr(distributed_dataset, "_enable_get_next_as_optional", None)


# --- Pipelines tfdp.data builds (graph.py, sources.py) --------------------------------------

def patch_device_datasets_without_autotune() -> None:
    """Every per-replica pipeline of a distributed dataset is built with tf.data's autotune
    off (see the import's note). It has nothing to tune: a fixed one-element prefetch from
    the multi-device iterator; the source pipeline keeps its own options."""
    import tensorflow as tf

    from tfdp._tf_private.core import _patch

    def make(original):
        def create_device_dataset(*args, **kwargs):
            options = tf.data.Options()
            options.autotune.enabled = False
            return original(*args, **kwargs).with_options(options)

        return create_device_dataset

    _patch(_multi_device_iterator_ops, "_create_device_dataset", make,
           "per-replica input without tf.data's autotune thread")


def dataset_flat_types_and_shapes(element_spec):
    """(output_types, output_shapes) of a dataset with ``element_spec``, as dataset ops take them."""
    return (_data_structure.get_flat_tensor_types(element_spec),
            _data_structure.get_flat_tensor_shapes(element_spec))


def autograph_user_function(fn):
    """``fn`` as tf.data traces a user's function (AutoGraph on, recursively), also under a
    ``do_not_convert`` function of tfdp's; ``None`` stays ``None``."""
    if fn is None:
        return None

    def converted(*args, **kwargs):
        enabled = _ag_ctx.ControlStatusCtx(status=_ag_ctx.Status.ENABLED)
        return _autograph_api.tf_convert(fn, enabled)(*args, **kwargs)

    return converted
