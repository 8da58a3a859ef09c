"""Keras trainer internals: how ``compile``/``fit`` build, run and count a training step.

What lives here: the class patches of tfdp's XLA step (tfdp/strategy/xla.py: what
``jit_compile="auto"`` means, the train/test step functions) and the pieces of Keras's own
train step it rebuilds (the loss, the loss metric, the step wrapping), and the epoch
bookkeeping of a resumed job (tfdp/callbacks/backup_and_restore.py: the first epoch, a short
epoch's length). Keras's saving and callbacks are in ``keras_saving``, its optimizer in
``keras_optimizer``. Each entry says why no public API serves; tests/test_tf_private.py pins
them.
"""

from __future__ import annotations

from tfdp._tf_private.core import get_private, patch_attribute


# --- The step function (xla.py) ------------------------------------------------------------

def _keras_trainer_classes():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers.trainer import Trainer

    return Trainer, TensorFlowTrainer


def patch_keras_auto_jit_compile(make) -> None:
    """Class patch of ``Trainer._resolve_auto_jit_compile`` (what ``jit_compile="auto"`` means).

    Why: Keras resolves "auto" to False under any tf.distribute strategy; tfdp resolves it as
    Keras would on one device (xla.resolve_auto_jit_compile). ``compile`` has no hook for it.
    """
    trainer, _ = _keras_trainer_classes()
    patch_attribute(trainer, "_resolve_auto_jit_compile", make, "jit_compile='auto' under tfdp")


def patch_keras_step_functions(make_train, make_test, make_predict=None) -> None:
    """Class patch of ``make_train_function`` / ``make_test_function`` (Keras's TF trainer),
    and ``make_predict_function`` when ``make_predict`` is given.

    Why: with ``jit_compile=True`` Keras compiles the whole distributed step, collectives
    included, which XLA cannot do across CPU replicas nor for several GPUs in one process.
    tfdp builds the step itself (xla.py): per-replica compiled forward/backward, reduction and
    update outside; every step runs under the step deadline (predict's too: under ZeRO-3 its
    forward gathers across workers). Keras has no public hook for the step function it builds.
    """
    _, tf_trainer = _keras_trainer_classes()
    patch_attribute(tf_trainer, "make_train_function", make_train, "tfdp's XLA train step")
    patch_attribute(tf_trainer, "make_test_function", make_test, "tfdp's XLA test step")
    if make_predict is not None:
        patch_attribute(tf_trainer, "make_predict_function", make_predict,
               "the step deadline of predict")


def keras_make_step_function(model, step_function):
    """Keras's own wrapping of a per-replica step (strategy.run, output reduction, the
    steps_per_execution loop, tf.function). Why: only ``_make_function`` builds it."""
    return get_private(model, "_make_function", "building a step function")(step_function)


def keras_model_supports_jit(model) -> bool:
    """Keras's own test (every layer XLA-capable, op determinism off, not a Mac GPU).
    Why: a private function of keras.src.trainers.trainer, used by "auto"."""
    from keras.src.trainers.trainer import model_supports_jit

    return bool(model_supports_jit(model))


def keras_compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """The loss exactly as Keras's train_step computes it (``compute_loss`` overrides with or
    without a ``training`` argument, regularisation losses). Why: only ``_compute_loss``
    handles both override signatures."""
    return get_private(model, "_compute_loss", "the train step's loss")(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def keras_call_has_training_arg(model) -> bool:
    """Whether the model's ``call`` takes ``training`` (Keras's train_step passes it only
    then). Why: Keras records it in a private attribute; re-inspecting the signature could
    disagree with Keras for wrapped calls."""
    return bool(get_private(model, "_call_has_training_arg", "calling the model as Keras does"))


def keras_loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` log. Why: no public getter."""
    return get_private(model, "_loss_tracker", "the loss metric")


def unscale_loss_for_distribution(value):
    """Keras's undo of its 1/num_replicas loss scaling, for the loss metric. Why: a function
    of the private keras.src.losses.loss module."""
    from keras.src.losses.loss import unscale_loss_for_distribution as unscale

    return unscale(value)


# --- Epochs of a resumed job (tfdp/callbacks/backup_and_restore.py) ------------------------

# Why: a job resumed mid-epoch runs a short first epoch (its first steps were trained before
# the backup). Keras's epoch iterator (a local of Model.fit) takes the epoch length from the
# dataset's cardinality once per fit; left alone it would step past the end of the short
# epoch, and TensorFlow's partial-batch handling would feed a step of empty batches that
# still moves Adam's moments and the iteration counter (or, with unknown cardinality, it
# would record the short length and cut every later epoch to it). No public API reaches the
# iterator; BackupAndRestore finds it through the dataset it trains on and sets the length of
# the resumed epoch (EpochIterator._num_batches), then restores it. The iterator is found in
# the frames of the running fit (the caller is a callback of that fit): searching the heap
# (gc.get_referrers) costs a scan of every object per call, seconds in a long-lived process.
def _holds(iterator, dataset) -> bool:
    adapter = getattr(iterator, "data_adapter", None)
    return any(held is dataset for held in (
        vars(iterator).get("_distributed_dataset"), getattr(adapter, "_dataset", None)))


def _epoch_iterators_in_frames(dataset, kind) -> list:
    import sys

    found, frame = [], sys._getframe(1)  # the running fit's frames
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, kind) and _holds(value, dataset) and value not in found:
                found.append(value)
        frame = frame.f_back
    return found


def set_keras_epoch_length(dataset, num_batches) -> int:
    """Sets the epoch length of the Keras epoch iterators over ``dataset`` (None: unknown)
    that a running ``fit`` in this thread's stack uses; returns how many it set."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    found = [it for it in _epoch_iterators_in_frames(dataset, EpochIterator)
             if it.steps_per_epoch is None]
    for obj in found:
        obj._num_batches = num_batches
    return len(found)


def keras_epoch_length(dataset):
    """The epoch length Keras's data adapter reports for ``dataset`` (None: unknown)."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    return TFDatasetAdapter(dataset).num_batches


def set_keras_initial_epoch(model, epoch: int) -> None:
    """Makes ``model.fit`` start at ``epoch`` (a resumed job).

    Why: ``fit`` reads its first epoch from ``model._initial_epoch`` when set (Keras's own
    BackupAndRestore resumes through it); a callback cannot pass ``initial_epoch`` to a
    ``fit`` call already running, and no public setter exists.
    """
    get_private(model, "_initial_epoch", "resuming at an epoch")  # set by Keras's Trainer.__init__
    model._initial_epoch = int(epoch)


# --- One distributed iterator per epoch (tfdp/strategy/keras_integration.py) ---------------

# Why (build): under any tf.distribute strategy Keras's ``fit`` and ``evaluate`` (so every
# validation) start by making a distributed iterator and reading one batch from it
# (``TensorFlowTrainer._maybe_symbolic_build``), which ``_symbolic_build`` needs only while
# a layer, the compiled metrics or the compiled loss is still unbuilt; the iterator is then
# dropped (``epoch_iterator.reset()``). Once all are built the patch calls
# ``_symbolic_build`` without a batch, as Keras itself does when it has one (it skips the
# part that needs one and builds the optimizer if it must). ``_unbuilt_for_symbolic_build``
# repeats Keras's three tests.
def _unbuilt_for_symbolic_build(model) -> bool:
    metrics, loss = model._compile_metrics, model._compile_loss
    return (not all(layer.built for layer in model._flatten_layers())
            or (metrics is not None and not metrics.built)
            or (loss is not None and not loss.built))


# Why (unbuilt): where something is still unbuilt, Keras reads a batch from a new distributed
# iterator and averages it over the replicas (an eager cross-replica reduction: in a
# multi-worker job a cross-worker one, before the first step) only to take the shapes and
# dtypes ``_symbolic_build`` makes symbolic inputs of. The distributed dataset's element spec
# has them (one replica's specs inside TensorFlow's ``PerReplicaSpec``, a private class; no
# public API unwraps a distributed spec). Keras on one device builds from the same spec, when
# it traces its train function, so the model gets the input shapes one device gets (a batch
# dimension of None for a dataset batched without ``drop_remainder``) where the averaged batch
# fixed the first batch's size. Where a spec leaves a dimension after the batch unknown, or is
# not a plain tensor's (padded, ragged, sparse), Keras's own path runs.
def _per_replica_batch_spec(epoch_iterator):
    """One replica's element spec of ``epoch_iterator``'s distributed dataset, or None where it
    is not plain tensors with every dimension after the batch known."""
    import tensorflow as tf
    from tensorflow.python.distribute import values as distribute_values

    spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
    if spec is None:
        return None

    def one_replica(leaf):
        if isinstance(leaf, distribute_values.PerReplicaSpec):
            leaf = leaf._value_specs[0]
        return leaf

    specs = tf.nest.map_structure(one_replica, spec)
    if not all(type(leaf) is tf.TensorSpec and leaf.shape.rank is not None
               and leaf.shape[1:].is_fully_defined() for leaf in tf.nest.flatten(specs)):
        return None
    return specs


def patch_keras_symbolic_build(applies) -> None:
    """Class patch of ``TensorFlowTrainer._maybe_symbolic_build``: no iterator is made to
    build a model that is built, nor to take the shapes of one that is not (see the notes
    above); ``applies(model)`` limits it."""
    _, tf_trainer = _keras_trainer_classes()

    def make(original):
        def maybe_symbolic_build(self, iterator=None, data_batch=None):
            if iterator is None or data_batch is not None or not applies(self):
                return original(self, iterator=iterator, data_batch=data_batch)
            if _unbuilt_for_symbolic_build(self):
                data_batch = _per_replica_batch_spec(iterator)
                if data_batch is None:
                    return original(self, iterator=iterator, data_batch=None)
            with self.distribute_strategy.scope():
                self._symbolic_build(data_batch=data_batch)

        return maybe_symbolic_build

    patch_attribute(tf_trainer, "_maybe_symbolic_build", make, "no iterator to build a built model")


# Why (epochs): with a dataset of known length and no ``steps_per_epoch``, Keras's epoch iterator
# (``EpochIterator._enumerate_iterator``) makes a new iterator at the start of every epoch and
# one more right after its last step that no one uses: the next epoch makes its own at its
# start (and a ``fit`` or ``evaluate`` that ends drops it). Over several replicas each one is a
# MultiDeviceIterator whose per-device functions TensorFlow traces anew, and whose pipelines
# start prefetching at once: 190 ms of CPU on 4 CPU replicas, more than the ten steps of a
# short epoch. No public API controls when Keras makes iterators. Where the one made after the
# last step is never used (no ``steps_per_epoch``), the patch gives Keras an empty placeholder
# instead; with ``steps_per_epoch`` Keras uses that iterator for the next epoch, and nothing
# changes. ``applies(epoch_iterator)`` limits it to tfdp's strategies.
#
# Why (draws): every iterator made of a ``tf.data.Dataset`` draws the seeds of its random
# stages (a reshuffling ``shuffle``, seeded or not, random maps) from generators the dataset
# holds, so which order epoch e sees depends on how many iterators were made before it. One
# device makes two per epoch; without the unused one every later epoch of tfdp came one draw
# early, in an order one device never trains on (issue 56). So the placeholder still makes the
# unused iterator's draw, on the host: an iterator of the dataset ``fit`` was given (the
# distributed pipeline is built on that same dataset and shares its generators), made and
# dropped before any element is read, which is cheap (no per-device functions, no buffer
# filled). A ``DistributedDataset`` (``tfdp.data``: its order is a function of (seed, epoch))
# needs no draw.
_UNUSED_NEXT = "_tfdp_next_iterator_unused"


def keras_iterators_before_epoch(epochs_done: int, known_length: bool, steps_per_epoch) -> int | None:
    """How many iterators of its dataset Keras's ``fit`` on one device has made when it starts
    its epoch ``epochs_done`` (counted from the ``fit`` call's first epoch): two per epoch of
    known length (the epoch's own and the unused one after it); one per epoch of unknown
    length (Keras 3.15 records one step more than the epoch had, so every epoch ends on the
    end of its data and leaves its loop before it would make the next one). None with
    ``steps_per_epoch``: one iterator runs on across epochs, and where it stands is not a
    number of draws."""
    if steps_per_epoch:
        return None
    if epochs_done <= 0:
        return 0
    return 2 * epochs_done if known_length else epochs_done


def make_draws_of_iterators(dataset, count: int) -> None:
    """Makes and drops ``count`` iterators of ``dataset`` (a plain ``tf.data.Dataset``; anything
    else is left alone) without reading an element: the seed draws of ``count`` iterators,
    so the next iterator sees the order it would after them (see the note above)."""
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset) or count <= 0:
        return
    if dataset.options().autotune.enabled is None:
        # No autotune model thread for an iterator that lives for a moment (its destructor
        # can wait out the thread's period: tfdp/strategy/source_pipeline.py).
        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
    for _ in range(count):
        iter(dataset)


def patch_keras_epoch_iterators(applies) -> None:
    """Class patches of ``EpochIterator._enumerate_iterator`` and
    ``TFEpochIterator._get_iterator``: no iterator is made after an epoch's last step when
    the next epoch makes its own (see the note above)."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator
    from keras.src.trainers.epoch_iterator import EpochIterator

    def make_enumerate(original):
        def enumerate_iterator(self):
            steps = original(self)
            if self.steps_per_epoch is not None or not applies(self):
                yield from steps
                return
            for item in steps:
                yield item
                # Keras's own test, made when it resumes after this step: the epoch is over
                # and it is about to make an iterator the next epoch will replace.
                if self._num_batches and self._steps_seen >= self._num_batches:
                    setattr(self, _UNUSED_NEXT, True)
            vars(self).pop(_UNUSED_NEXT, None)

        return enumerate_iterator

    def make_get_iterator(original):
        def get_iterator(self):
            if vars(self).pop(_UNUSED_NEXT, False):
                # Only a dataset the user gave: other adapters build a new pipeline per call
                # (numpy arrays copied again), whose draws no later epoch reads.
                if type(self.data_adapter).__name__ == "TFDatasetAdapter":
                    make_draws_of_iterators(self.data_adapter.get_tf_dataset(), 1)
                return ()
            return original(self)

        return get_iterator

    patch_attribute(EpochIterator, "_enumerate_iterator", make_enumerate,
           "one distributed iterator per epoch")
    patch_attribute(TFEpochIterator, "_get_iterator", make_get_iterator,
           "one distributed iterator per epoch")


# --- fit's input (tfdp/strategy/keras_integration.py) -------------------------------------

def patch_keras_fit(make) -> None:
    """Class patch of ``TensorFlowTrainer.fit`` (a public method, defined on this private class).

    Why: a callback never sees the ``x`` of the ``fit`` call it runs in (Keras hands the data
    to its epoch iterator only), and tfdp's BackupAndRestore must position exactly that
    dataset, not a validation or test pipeline built beside it.
    """
    _, tf_trainer = _keras_trainer_classes()
    patch_attribute(tf_trainer, "fit", make, "knowing the dataset fit trains on")
