"""Every file a Keras script writes is written once, by the chief.

Rule. In a multi-worker tfdp job every save and log call of the script still runs on every
worker, so the collectives that saving needs run everywhere (ShardedOptimizer gathers its
sharded state; Keras reads its on-read metric variables through an all-reduce). Only the
chief writes at the path the script names. Every other worker writes the same thing into a
private directory, ``<tempfile.gettempdir()>/tfdp-worker<rank>-<pid>/``, and removes it: a
saved file right after the save, a callback's directory when training ends, a summary
writer's directory and anything left at exit. Reads are never redirected: every worker reads
the chief's files at the script's path, so restoring needs that path on a filesystem all
workers share. This is what TensorFlow's multi-worker guides do by hand, done for the script.

What goes through the chief (the hooks; private Keras/TensorFlow names are in _tf_private):

* ``model.save`` / ``keras.saving.save_model`` (``.keras``, ``.h5``, unzipped directories),
  ``save_weights`` (sharded too); so every callback that saves: ``ModelCheckpoint`` (any
  ``save_freq``, any ``{epoch}``/``{batch}``/``{val_loss}`` in the path), Keras's
  ``BackupAndRestore`` weights, ``TensorBoard``'s embeddings;
* ``model.export`` (every format) and ``tf.saved_model.save``;
* ``keras.callbacks.TensorBoard`` (its whole log directory: event files, projector config,
  profiler traces), ``keras.callbacks.CSVLogger``, ``keras.callbacks.BackupAndRestore``
  (metadata, copies, the deletion at the end);
* custom training loops: ``tf.summary.create_file_writer``, ``tf.train.Checkpoint.save`` /
  ``write`` and ``tf.train.CheckpointManager.save``. A manager's bookkeeping stays the
  chief's on every worker: ``save()``'s return value, ``latest_checkpoint`` and
  ``checkpoints`` name the chief's files, and the directory the script named exists (empty)
  on every worker after the save, so the script can list and remove it as the tutorials do.

Opt-outs: ``per_worker_path(path)`` names a path that every worker writes itself (say,
per-worker TensorBoard directories); ``TFDP_CHIEF_WRITES=0`` turns the mechanism off (every
worker writes where the script says, as Keras alone does, and two workers collide).

Not covered: files the script writes itself (``open``, ``np.save``): guard them with
``tfdp.callbacks.is_chief()``; names bound before the strategy was built (``from
tensorflow.summary import create_file_writer``); ``overwrite=False`` asks on every worker.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import inspect
import logging
import os
import shutil
import tempfile
import threading

from tfdp import process_state

__all__ = ["activate", "deactivate", "install", "per_worker_path", "should_redirect", "handling_enabled",
           "private_root", "CHIEF_WRITES_ENV"]

log = logging.getLogger("tfdp")

# "0" (or false/no/off) turns the mechanism off: every worker writes where the script says.
CHIEF_WRITES_ENV = "TFDP_CHIEF_WRITES"


# --- pure policy ---------------------------------------------------------------------------

def handling_enabled(environ=None) -> bool:
    """False when ``TFDP_CHIEF_WRITES`` is 0/false/no/off in ``environ`` (default os.environ)."""
    environ = os.environ if environ is None else environ
    return environ.get(CHIEF_WRITES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def private_root(rank: int, pid: int, temp_dir: str) -> str:
    """This worker's private directory (the same one ``tfdp.callbacks.write_path`` uses)."""
    return os.path.join(temp_dir, f"tfdp-worker{rank}-{pid}")


def _is_remote(path: str) -> bool:
    return "://" in path


def _is_under(path: str, directory: str) -> bool:
    if _is_remote(path) or _is_remote(directory):
        directory = directory.rstrip("/")
        return path == directory or path.startswith(directory + "/")
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def should_redirect(path, is_chief: bool, root: str | None, exempt=()) -> bool:
    """Whether a worker writes ``path`` somewhere private instead; pure policy.

    Args:
        path: what the script asked to write: a ``str``/``os.PathLike`` path. Anything else
            (an open file object, a tensor inside a traced function) is the script's own and
            is written as given.
        is_chief: the chief writes every path itself.
        root: this worker's private directory; paths already inside it are private.
        exempt: paths from ``per_worker_path``: every worker writes under them itself.
    """
    if is_chief or not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    if isinstance(path, bytes) or not path:
        return False
    if root is not None and _is_under(path, root):
        return False
    return not any(_is_under(path, e) for e in exempt)


def private_name(path) -> str:
    """The last component of ``path`` (a file, a directory, a checkpoint prefix, a URL)."""
    path = os.fspath(path).rstrip("/" + os.sep)
    return os.path.basename(path) or "output"


def per_worker_path(path, rank: int | None = None) -> str:
    """A path of this worker's own, which every worker writes itself (not only the chief).

    ``{worker}`` in ``path`` becomes the worker's rank; without it the result is
    ``path/worker-<rank>``. For example ``keras.callbacks.TensorBoard(
    tfdp.callbacks.per_worker_path("logs/tb"))`` gives each worker its own log directory
    (``logs/tb/worker-0``, ``logs/tb/worker-1``, ...), so TensorBoard shows one run per worker.

    Args:
        path: a directory or file path (``{worker}`` optional).
        rank: the worker's rank; default: this process's (from the running job, else
            ``tfdp.ClusterConfig.from_env()``).
    """
    if rank is None:
        if _worker is not None:
            rank = _worker.rank
        else:
            from tfdp.cluster import ClusterConfig

            rank = ClusterConfig.from_env().rank
    path = os.fspath(path)
    if "{worker}" in path:
        result = path.replace("{worker}", str(rank))
    else:
        result = os.path.join(path, f"worker-{rank}")
    _exempt.add(result if _is_remote(result) else os.path.abspath(result))
    return result


# --- this process's role -------------------------------------------------------------------

class _Worker:
    """The running job as this process sees it, and its private directory."""

    def __init__(self, rank: int, is_chief: bool):
        self.rank = rank
        self.is_chief = is_chief
        self._root = None
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        with self._lock:
            if self._root is None:
                self._root = private_root(self.rank, os.getpid(), tempfile.gettempdir())
                os.makedirs(self._root, exist_ok=True)
                atexit.register(shutil.rmtree, self._root, True)
            return self._root

    def new_dir(self) -> str:
        """A fresh directory inside the private root."""
        return tempfile.mkdtemp(prefix="w-", dir=self.root)

    def redirects(self, path) -> bool:
        if self.is_chief or not handling_enabled():
            return False
        return should_redirect(path, False, self.root, tuple(_exempt))


_worker: _Worker | None = None
_exempt: set = set()


def activate(cluster) -> None:
    """Makes this process a worker of ``cluster`` (a multi-worker ``tfdp.ClusterConfig``) and
    installs the hooks; called by ``DataParallelStrategy`` when there are several workers."""
    global _worker
    _worker = _Worker(cluster.rank, cluster.is_chief)
    install()


def deactivate() -> None:
    """Forgets the job: no path is redirected any more (``keras_integration.uninstall``)."""
    global _worker
    _worker = None


def _redirects(path) -> bool:
    return _worker is not None and _worker.redirects(path)


@contextlib.contextmanager
def _private_stand_in(path, keep: bool = False):
    """Yields the private path this worker writes instead of ``path``; removes it afterwards
    unless ``keep`` (then it goes at exit)."""
    directory = _worker.new_dir()
    try:
        yield os.path.join(directory, private_name(path))
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)


# --- function hooks --------------------------------------------------------------------------

def _redirect_argument(original, parameter: str, keep: bool = False):
    """``original`` (a function or method taking a path as ``parameter``), writing that path
    privately on a worker that redirects (removed afterwards unless ``keep``)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _worker is None:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # let the original report the bad call
        path = bound.arguments.get(parameter)
        if not _redirects(path):
            return original(*args, **kwargs)
        with _private_stand_in(path, keep=keep) as private:
            bound.arguments[parameter] = private
            return original(*bound.args, **bound.kwargs)

    return wrapper


def _sync(checkpoint):
    sync = getattr(checkpoint, "sync", None)
    if sync is not None:
        sync()  # an async write must finish before its directory goes


def _make_directory(path):
    """Creates the directory the script named, as its own write would have (empty here).

    TensorFlow's multi-worker custom-loop tutorial saves a worker's CheckpointManager into a
    temporary directory of its own and then removes it with ``tf.io.gfile.rmtree``; with the
    write redirected that directory must still exist, or the removal fails (NotFoundError).
    """
    import tensorflow as tf

    try:
        tf.io.gfile.makedirs(os.fspath(path))
    except (tf.errors.OpError, OSError) as e:  # the script's own write would have failed here
        log.debug("tfdp: chief writes: could not create %s: %s", path, e)


def _checkpoint_write(original):
    """``Checkpoint._write``, under ``save`` and ``write``; returns the path the script asked
    for, as the chief's call does."""
    @functools.wraps(original)
    def _write(self, file_prefix, *args, **kwargs):
        if not _redirects(file_prefix):
            return original(self, file_prefix, *args, **kwargs)
        with _private_stand_in(file_prefix) as private:
            original(self, private, *args, **kwargs)
            _sync(self)
        _make_directory(os.path.dirname(os.fspath(file_prefix)) or ".")
        return os.fspath(file_prefix)

    return _write


def _checkpoint_manager_save(original):
    """``CheckpointManager.save``: the save, its state file and its deletions happen in a
    private directory, and the manager's bookkeeping keeps naming the chief's files."""
    from tfdp import _tf_private

    @functools.wraps(original)
    def save(self, *args, **kwargs):
        if not _redirects(self.directory):
            return original(self, *args, **kwargs)
        real = _tf_private.checkpoint_manager_state(self)
        with _private_stand_in(real.directory) as private_dir:
            os.makedirs(private_dir)

            def to_private(p):
                return None if p is None else os.path.join(private_dir, os.path.basename(p))

            def to_real(p):
                return None if p is None else os.path.join(real.directory, os.path.basename(p))

            _tf_private.set_checkpoint_manager_state(self, real._replace(
                directory=private_dir, prefix=to_private(real.prefix),
                maybe_delete=collections.OrderedDict(
                    (to_private(k), v) for k, v in real.maybe_delete.items()),
                latest=to_private(real.latest)))
            try:
                result = original(self, *args, **kwargs)
                _sync(self.checkpoint)
            finally:
                after = _tf_private.checkpoint_manager_state(self)
                _tf_private.set_checkpoint_manager_state(self, real._replace(
                    maybe_delete=collections.OrderedDict(
                        (to_real(k), v) for k, v in after.maybe_delete.items()),
                    latest=to_real(after.latest)))
        _make_directory(real.directory)
        return to_real(result)

    return save


# --- callback hooks --------------------------------------------------------------------------
# Keras callbacks keep their paths in attributes; on a redirecting worker the attributes name a
# private directory while the callback writes, and the callback's private directory goes when
# training ends.

def _private_dir_of(callback, real):
    """The private stand-in for ``real`` of ``callback`` (made once), or None to write ``real``."""
    if not _redirects(real):
        return None
    held = callback.__dict__.get("_tfdp_private")
    if held is None or held[0] != real:
        held = (real, os.path.join(_worker.new_dir(), private_name(real)))
        callback._tfdp_private = held
    return held[1]


def _drop_private_dir(callback):
    held = callback.__dict__.pop("_tfdp_private", None)
    if held is not None:
        shutil.rmtree(os.path.dirname(held[1]), ignore_errors=True)


@contextlib.contextmanager
def _attributes(obj, values: dict):
    saved = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


def _while_writing(path_attributes):
    """A method wrapper that points ``path_attributes(callback)`` at the private directory."""
    def make(original):
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            values = path_attributes(self)
            if not values:
                return original(self, *args, **kwargs)
            with _attributes(self, values):
                return original(self, *args, **kwargs)
        return method
    return make


def _then_drop(original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            _drop_private_dir(self)
    return method


def _single_path(attribute):
    def values(callback):
        private = _private_dir_of(callback, getattr(callback, attribute))
        return {attribute: private} if private else {}
    return values


def _backup_paths(callback):
    from tfdp import _tf_private

    real = callback.backup_dir
    private = _private_dir_of(callback, real)
    if private is None:
        return {}
    return {name: private + value[len(real):]
            for name, value in _tf_private.keras_backup_paths(callback).items()
            if value == real or _is_under(value, real)}


def _tolerate_existing_directory(makedirs):
    """Keras's makedirs, where a directory another worker created first is no error."""

    @functools.wraps(makedirs)
    def wrapper(path, *args, **kwargs):
        try:
            return makedirs(path, *args, **kwargs)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            return None

    return wrapper


def install():
    """The patches (idempotent: ``_tf_private``'s registry patches once)."""
    from tfdp import _tf_private as tp

    tp.patch_keras_file_writers(lambda f: _redirect_argument(f, "filepath"))
    tp.patch_keras_makedirs(_tolerate_existing_directory)
    tp.patch_keras_export(lambda f: _redirect_argument(f, "filepath"))
    tp.patch_tensorflow_file_writers(_redirect_argument)
    tp.patch_checkpoint_write(_checkpoint_write)
    tp.patch_checkpoint_manager_save(_checkpoint_manager_save)
    # TensorBoard derives every directory it writes from log_dir in set_model.
    tp.patch_keras_callback("TensorBoard", "set_model", _while_writing(_single_path("log_dir")))
    tp.patch_keras_callback("TensorBoard", "on_train_end", _then_drop)
    # CSVLogger opens its file in on_train_begin and closes it in on_train_end.
    tp.patch_keras_callback("CSVLogger", "on_train_begin",
                            _while_writing(_single_path("filename")))
    tp.patch_keras_callback("CSVLogger", "on_train_end", _then_drop)
    # BackupAndRestore reads in on_train_begin (left alone: every worker reads the chief's
    # backup), writes in on_epoch_end / on_train_batch_end, deletes in on_train_end.
    for name in ("on_epoch_end", "on_train_batch_end"):
        tp.patch_keras_callback("BackupAndRestore", name, _while_writing(_backup_paths))
    tp.patch_keras_callback("BackupAndRestore", "on_train_end",
                            lambda f: _then_drop(_while_writing(_backup_paths)(f)))


def _forget() -> None:
    deactivate()
    _exempt.clear()


process_state.register("chief-writes redirect", __name__,
                       lambda: (_worker is not None, tuple(sorted(_exempt))), _forget)
