"""Keras saving and callbacks, TensorFlow's file writers and checkpoints: the chief-writes area.

What lives here: the functions every Keras and TensorFlow write ends in (model and weights
files, exports, TensorBoard's writer, SavedModel, checkpoints, ModelCheckpoint's makedirs),
which tfdp wraps so only the chief writes at the script's path (tfdp/strategy/chief_writes.py);
the stock callbacks whose decisions must agree across workers (tfdp/strategy/consensus.py);
and the state of a CheckpointManager and a BackupAndRestore that tfdp redirects on the other
workers. Each entry says why no public API serves; tests/test_tf_private.py pins them.
"""

from __future__ import annotations

from collections import namedtuple as _namedtuple

from tfdp._tf_private.core import get_private, patch_attribute, replace_attribute

# --- Chief-only writes and agreed decisions (tfdp/strategy/chief_writes.py, tfdp/strategy/consensus.py) ------
# A Keras script runs unchanged on several workers: every write below still runs on every
# worker (saving may need collectives), but only the chief writes at the script's path.

_CHIEF_WRITES = "only the chief writes the script's files (tfdp/strategy/chief_writes.py)"


def patch_keras_file_writers(make) -> None:
    """Replaces the Keras functions that write a model or weights file (each takes the path as
    ``filepath``) by ``make(original)``.

    Why: ``model.save``, ``keras.saving.save_model``, ``save_weights`` and every callback that
    saves (ModelCheckpoint, BackupAndRestore, TensorBoard's embeddings) end in these functions
    of Keras's private saving modules, which ``saving_api`` looks up at call time. The public
    functions above them are bound under several public names (``keras.saving.save_model``,
    ``keras.models.save_model``) that one patch would miss, and no public hook says "about to
    write a file".
    """
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.saving import saving_lib

    for module, name in ((saving_lib, "save_model"), (saving_lib, "save_weights_only"),
                         (legacy_h5_format, "save_model_to_hdf5")):
        patch_attribute(module, name, make, _CHIEF_WRITES)


def patch_keras_makedirs(make) -> None:
    """Replaces Keras's ``file_utils.makedirs`` (private) by ``make(original)``.

    Why: ``ModelCheckpoint`` creates the checkpoint's directory on every worker with "if it
    does not exist, makedirs" (no ``exist_ok``), so on a shared filesystem two workers race and
    the loser dies with ``FileExistsError`` (measured: 2 workers, ``{epoch}`` in a
    sub-directory). Keras reaches the function through the module at call time; no public
    option makes it tolerant.
    """
    from keras.src.utils import file_utils

    patch_attribute(file_utils, "makedirs", make, _CHIEF_WRITES)


def patch_keras_export(make) -> None:
    """Replaces ``keras.Model.export`` (public; every export format) by ``make(original)``."""
    import keras

    patch_attribute(keras.Model, "export", make, _CHIEF_WRITES)


def patch_tensorflow_file_writers(make) -> None:
    """Replaces ``tf.summary.create_file_writer`` and ``tf.saved_model.save`` by
    ``make(original, path_parameter, keep)`` (``keep``: the files live as long as the writer).

    Why: both are bound in TensorFlow's generated API modules, which Python can execute a
    second time: an ``import tensorflow.summary`` statement (Keras's TensorBoard callback makes
    one) re-creates the module from the implementation module's attributes (measured with TF
    2.21: a patch of the public name alone was gone after ``fit``). So the private
    implementation functions are patched too, and a re-created API module binds the patched
    ones.
    """
    import tensorflow as tf
    from tensorflow.python.ops import summary_ops_v2
    from tensorflow.python.saved_model import save as saved_model_save

    for module, name, api, api_name, parameter, keep in (
            (summary_ops_v2, "create_file_writer_v2", tf.summary, "create_file_writer",
             "logdir", True),
            (saved_model_save, "save", tf.saved_model, "save", "export_dir", False)):
        original = patch_attribute(module, name, lambda f, p=parameter, k=keep: make(f, p, k),
                          _CHIEF_WRITES)
        if getattr(api, api_name, None) is original:
            replace_attribute(api, api_name, getattr(module, name), _CHIEF_WRITES)


def patch_checkpoint_write(make) -> None:
    """Replaces ``tf.train.Checkpoint._write(file_prefix, ...)`` by ``make(original)``.

    Why: ``Checkpoint.save``, ``Checkpoint.write`` and ``CheckpointManager.save`` all write
    through this private method, which also runs the callbacks that record the checkpoint
    state file next to the checkpoint; the manager calls it directly, so wrapping the public
    methods would miss it.
    """
    import tensorflow as tf

    patch_attribute(tf.train.Checkpoint, "_write", make, _CHIEF_WRITES)


def patch_checkpoint_manager_save(make) -> None:
    """Replaces ``tf.train.CheckpointManager.save`` (public) by ``make(original)``."""
    import tensorflow as tf

    patch_attribute(tf.train.CheckpointManager, "save", make, _CHIEF_WRITES)



CheckpointManagerState = _namedtuple("CheckpointManagerState",
                                     ["directory", "prefix", "maybe_delete", "latest"])
_MANAGER_STATE = ("_directory", "_checkpoint_prefix", "_maybe_delete", "_latest_checkpoint")


def checkpoint_manager_state(manager) -> CheckpointManagerState:
    """A ``tf.train.CheckpointManager``'s directory, checkpoint prefix, managed checkpoints
    (an OrderedDict of prefix -> timestamp) and latest checkpoint.

    Why: the manager writes its state file into ``directory`` and deletes old checkpoints by
    the names it holds; to make a worker other than the chief save into a private directory
    while the manager's bookkeeping keeps naming the chief's files, tfdp swaps these for one
    ``save()``. The public properties are read-only.
    """
    return CheckpointManagerState(*(get_private(manager, name, _CHIEF_WRITES)
                                    for name in _MANAGER_STATE))


def set_checkpoint_manager_state(manager, state: CheckpointManagerState) -> None:
    for name, value in zip(_MANAGER_STATE, state):
        setattr(manager, name, value)


def patch_keras_callback(class_name: str, method: str, make) -> None:
    """Replaces ``keras.callbacks.<class_name>.<method>`` (public classes and methods:
    TensorBoard, CSVLogger, BackupAndRestore, CallbackList) by ``make(original)``."""
    import keras

    patch_attribute(getattr(keras.callbacks, class_name), method, make,
           "a Keras script on several workers (tfdp/strategy/chief_writes.py, tfdp/strategy/consensus.py)")


# Why: Keras's BackupAndRestore keeps every path it writes or deletes in these attributes (set
# in __init__, used by _save_model and on_train_end); tfdp points them at a private directory
# on workers other than the chief while it writes, and leaves them alone while it reads. No
# public API separates its reads from its writes.
KERAS_BACKUP_PATH_ATTRIBUTES = ("backup_dir", "_weights_path", "_training_metadata_path",
                                "_prev_weights_path", "_prev_training_metadata_path")


def keras_backup_paths(callback) -> dict:
    """``KERAS_BACKUP_PATH_ATTRIBUTES`` of a Keras BackupAndRestore, by name."""
    return {name: get_private(callback, name, _CHIEF_WRITES)
            for name in KERAS_BACKUP_PATH_ATTRIBUTES}


def keras_initial_epoch(model):
    """The epoch Keras's BackupAndRestore restored into ``model`` (None: it restored nothing).

    Why: BackupAndRestore hands the restored epoch to ``fit`` only through this attribute;
    tfdp checks that every worker restored the same one.
    """
    return get_private(model, "_initial_epoch",
                       "checking that every worker restored the same epoch")
