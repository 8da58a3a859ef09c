"""tf.data internals: the distributed dataset Keras trains on and the pipelines tfdp.data builds.

What lives here: the per-replica side of a distributed iterator (no autotune thread, generator
functions traced once), the cardinality and end-of-data agreement of a distributed dataset
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

# Why (functions): every multi-device iterator (one per epoch under Keras's ``fit``, on every
# worker) builds, per device, a generator dataset whose init, next and finalize functions
# TensorFlow's ``_PerDeviceGenerator.__init__`` defines and traces anew, six ``tf.function``
# traces per device: 37 ms each on this 2-core host, 0.15 s of every epoch at 4 replicas,
# more than ten steps of a small model. The traced graphs differ between iterators only in
# the values they capture (the iterator's string handle, its incarnation id, the source
# device), which the generator op receives as arguments in any case; and those captures tie
# the iterator's resource into reference cycles with the function graphs, so each epoch's
# iterator, its source pipeline's threads included, lives until a full garbage collection
# (tfdp/strategy/source_pipeline.py: collections that waited 90-108 s for such iterators).
# The replacement traces the three functions once per (shard, source device, device, element
# types and shapes) with the per-iterator values as arguments: the same ops, the same remote
# call to the source device, the same order of elements, nothing captured per iterator. The
# init function returns a placeholder state from the source device (the next function reads
# the handle from its own arguments). Only the eager, anonymous iterators TensorFlow's
# distributed iterators make take this path; any other construction runs TensorFlow's own
# ``__init__``. No public API reaches this.
from tensorflow.python.data.ops import dataset_ops as _dataset_ops
from tensorflow.python.framework import type_utils as _type_utils
from tensorflow.python.ops import functional_ops as _functional_ops
from tensorflow.python.ops import gen_dataset_ops as _gen_dataset_ops


# --- The distributed dataset (distributed.py, pipeline.py) ---------------------------------

def set_distributed_dataset_cardinality(distributed_dataset, steps: int) -> None:
    """Makes ``distributed_dataset.cardinality`` the number of global steps per epoch.

    Why: for ``distribute_datasets_from_function`` TensorFlow reports the cardinality of
    one worker's dataset (per-replica batches), which Keras reads as steps per epoch; it
    then keeps stepping past the end, and TensorFlow's partial-batch handling feeds one
    extra step of empty dummy batches, which still moves momentum/Adam state and the
    iteration counter. No public API sets the cardinality of a distributed dataset.
    """
    distributed_dataset._cardinality = steps


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
    distributed_dataset._enable_get_next_as_optional = False
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

    from tfdp._tf_private.core import patch_attribute

    def make(original):
        def create_device_dataset(*args, **kwargs):
            options = tf.data.Options()
            options.autotune.enabled = False
            return original(*args, **kwargs).with_options(options)

        return create_device_dataset

    patch_attribute(_multi_device_iterator_ops, "_create_device_dataset", make,
           "per-replica input without tf.data's autotune thread")


def _per_device_generator_functions(shard_num, source_device, element_spec):
    """(init, next, finalize) concrete functions of one per-device generator, traced under the
    current device with the iterator's values as arguments (see the note above)."""
    import tensorflow as tf

    types, shapes = dataset_flat_types_and_shapes(element_spec)
    fulltype = _type_utils.fulltype_list_to_product(
        _type_utils.fulltypes_for_flat_tensors(element_spec))
    string, int64 = tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.int64)

    # The generator's state: a placeholder string made on the source device and returned
    # from there, the way TensorFlow's init function returns the iterator's handle (so no
    # function on the target device makes a string of its own).
    with tf.device(source_device):
        state, source = tf.constant(""), tf.constant(source_device)

    @tf.function(input_signature=[string], autograph=False)
    def state_on_source(value):
        return value

    state_concrete = state_on_source.get_concrete_function()

    @tf.function(input_signature=[], autograph=False)
    def init():
        return _functional_ops.remote_call(target=source, args=[state], Tout=[tf.string],
                                           f=state_concrete)

    @tf.function(input_signature=[string, int64], autograph=False)
    def next_from_shard(string_handle, incarnation_id):
        iterator = _gen_dataset_ops.multi_device_iterator_from_string_handle(
            string_handle=string_handle, output_types=types, output_shapes=shapes)
        return _gen_dataset_ops.multi_device_iterator_get_next_from_shard(
            multi_device_iterator=iterator, shard_num=shard_num, incarnation_id=incarnation_id,
            output_types=types, output_shapes=shapes)

    next_concrete = next_from_shard.get_concrete_function()

    @tf.function(input_signature=[string, string, int64, string],
                 experimental_attributes={"experimental_ints_on_device": True},
                 autograph=False)
    def remote_next(unused_state, string_handle, incarnation_id, source_device):
        values = _functional_ops.remote_call(
            target=source_device, args=[string_handle, incarnation_id], Tout=types,
            f=next_concrete)
        for value in values:  # which outputs hold host-memory types (strings in variants)
            value.op.experimental_set_type(fulltype)
        return values

    @tf.function(input_signature=[string], autograph=False)
    def finalize_on_source(unused_state):
        return tf.constant(0, tf.int64)

    finalize_concrete = finalize_on_source.get_concrete_function()

    @tf.function(input_signature=[string, string], autograph=False)
    def remote_finalize(state, source_device):
        return _functional_ops.remote_call(target=source_device, args=[state],
                                           Tout=[tf.int64], f=finalize_concrete)

    return (init.get_concrete_function(), remote_next.get_concrete_function(),
            remote_finalize.get_concrete_function())


def _per_device_generator_key(shard_num, source_device, element_spec):
    from tensorflow.python.eager import context

    types, shapes = dataset_flat_types_and_shapes(element_spec)
    fulltypes = _type_utils.fulltypes_for_flat_tensors(element_spec)
    return (shard_num, source_device, context.context().device_name, tuple(types),
            tuple(None if s.rank is None else tuple(s.as_list()) for s in shapes),
            tuple(t.SerializeToString() for t in fulltypes))


def patch_per_device_generators_traced_once() -> None:
    """Class patch of ``multi_device_iterator_ops._PerDeviceGenerator.__init__``: the
    per-device functions of a distributed iterator are traced once per element structure
    and device, not once per iterator (see the note above)."""
    import threading

    import tensorflow as tf

    from tfdp._tf_private.core import patch_attribute

    generator_class = _multi_device_iterator_ops._PerDeviceGenerator
    traced: dict = {}  # key -> (init, next, finalize); dropped with the patch
    lock = threading.Lock()

    def make(original):
        def __init__(self, shard_num, multi_device_iterator_resource, incarnation_id,
                     source_device, element_spec, iterator_is_anonymous):
            if not (iterator_is_anonymous and tf.executing_eagerly()
                    and hasattr(source_device, "numpy")):
                return original(self, shard_num, multi_device_iterator_resource,
                                incarnation_id, source_device, element_spec,
                                iterator_is_anonymous)
            source = source_device.numpy().decode()
            key = _per_device_generator_key(shard_num, source, element_spec)
            with lock:
                if key not in traced:
                    traced[key] = _per_device_generator_functions(shard_num, source,
                                                                  element_spec)
                functions = traced[key]
            self._element_spec = element_spec
            self._name = f"device_generator_{shard_num}"
            self._init_func, self._next_func, self._finalize_func = functions
            self._init_captured_args = self._init_func.captured_inputs
            handle = _gen_dataset_ops.multi_device_iterator_to_string_handle(
                multi_device_iterator_resource)
            # The resource rides along (as in TensorFlow's own) so the iterator lives as long
            # as its per-device datasets.
            self._next_captured_args = [handle, incarnation_id, source_device,
                                        multi_device_iterator_resource]
            self._incarnation_id_index = 1
            self._finalize_captured_args = [source_device]
            variant_tensor = _gen_dataset_ops.generator_dataset(
                self._init_captured_args, self._next_captured_args,
                self._finalize_captured_args, init_func=self._init_func,
                next_func=self._next_func, finalize_func=self._finalize_func,
                **self._flat_structure)
            _dataset_ops.DatasetV2.__init__(self, variant_tensor)

        __init__.traced = traced
        return __init__

    patch_attribute(generator_class, "__init__", make,
           "per-replica input functions traced once, not per epoch")


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
