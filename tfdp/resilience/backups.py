"""Backups: atomic, step-numbered directories, and where a resumed job continues.

Rules:

* **A backup** is a directory ``step-<global step>`` holding the model and optimizer weights
  and a ``meta.json``; ``meta.json`` is written last and marks the backup complete (a
  ``step-*`` directory without it is not a backup and is removed by ``prune``).
* **Atomic.** On a local (POSIX) filesystem a backup is written under a temporary name in the
  same directory, flushed to disk (fsync) and switched in with one ``rename``, so a process
  killed at any moment leaves either the complete new backup or none. Filesystems reached
  through ``tf.io.gfile`` with a scheme (``gs://``, ``s3://``, ``hdfs://``, TensorFlow's
  in-memory ``ram://``) have no atomic directory rename (object stores copy object by
  object), so there the files are written in place, ``meta.json`` last under a temporary name
  renamed into place: an object becomes visible only once complete, so a reader sees
  ``meta.json`` only after the weights are whole. Older backups are deleted only after the new
  one is complete. A second backup of a step that has one replaces only its ``meta.json``:
  one global step is one training state.
* **Resume position** (``resume_position``). A backup taken after global step ``g`` records
  the epoch and the steps completed in it; the relaunched job continues at the next step of
  that epoch (the next epoch's first step if the epoch was complete).
* **Accumulation.** With ``k`` micro-batches per optimizer update, backups are taken only on
  update boundaries (``g % k == 0``), where the accumulators are zero and need no saving.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Callable

__all__ = ["BackupStore", "Position", "resume_position", "is_update_boundary",
           "should_back_up", "is_local_path"]

BACKUP_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
WEIGHTS_FILE = "model.weights.h5"
META_FILE = "meta.json"
_INCOMPLETE = ".incomplete-"


# --- pure decisions ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Position:
    """Where a job stands: ``epoch`` and the steps already completed in it."""

    epoch: int
    step: int


def resume_position(epoch: int, step_in_epoch: int, steps_per_epoch: int | None) -> Position:
    """The next step to run after a backup taken at (``epoch``, ``step_in_epoch`` done).

    A backup after the epoch's last step resumes at the start of the next epoch.
    """
    if steps_per_epoch is not None and step_in_epoch >= steps_per_epoch:
        return Position(epoch + 1, 0)
    return Position(epoch, step_in_epoch)


def is_update_boundary(global_step: int, accumulation_steps: int) -> bool:
    """True when ``global_step`` micro-batches complete a whole number of optimizer updates."""
    return global_step % max(1, accumulation_steps) == 0


def should_back_up(global_step: int, save_freq: int, accumulation_steps: int = 1,
                   last_backup_step: int = 0) -> bool:
    """Back up after ``global_step`` for an integer ``save_freq``.

    A backup is due once ``save_freq`` steps have passed since the last one; with gradient
    accumulation it waits for the next update boundary (so it may come up to ``k - 1`` steps
    late, never early, and never in the middle of an accumulation cycle).
    """
    if global_step - last_backup_step < save_freq:
        return False
    return is_update_boundary(global_step, accumulation_steps)


def is_local_path(path: str) -> bool:
    """True for a path of the local filesystem (no scheme, or ``file://``)."""
    return "://" not in path or path.startswith("file://")


# --- file operations: os for local paths, tf.io.gfile for the others ------------------------

def _gfile():
    import tensorflow as tf

    return tf.io.gfile


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _join(directory: str, name: str) -> str:
    return os.path.join(directory, name) if is_local_path(directory) else directory.rstrip("/") + "/" + name


def _listdir(directory: str) -> list:
    if is_local_path(directory):
        try:
            return os.listdir(_local(directory))
        except FileNotFoundError:
            return []
    gfile = _gfile()
    if not gfile.isdir(directory):
        return []
    return [name.rstrip("/") for name in gfile.listdir(directory)]


def _exists(path: str) -> bool:
    return os.path.exists(_local(path)) if is_local_path(path) else _gfile().exists(path)


def _makedirs(path: str) -> None:
    if is_local_path(path):
        os.makedirs(_local(path), exist_ok=True)
    else:
        _gfile().makedirs(path)


def _rmtree(path: str) -> None:
    if is_local_path(path):
        shutil.rmtree(_local(path), ignore_errors=True)
        return
    gfile = _gfile()
    if gfile.exists(path):
        gfile.rmtree(path)


def _read_text(path: str) -> str:
    if is_local_path(path):
        with open(_local(path)) as f:
            return f.read()
    with _gfile().GFile(path, "r") as f:
        return f.read()


def _fsync_file(path):
    if os.path.isfile(path):
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_meta(directory: str, meta: dict) -> None:
    """``meta.json`` in ``directory``, written under a temporary name and renamed into place."""
    text = json.dumps(meta, indent=1)
    final, temp = _join(directory, META_FILE), _join(directory, META_FILE + ".tmp")
    if is_local_path(directory):
        with open(_local(temp), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(_local(temp), _local(final))
        _fsync_dir(_local(directory))
        return
    gfile = _gfile()
    with gfile.GFile(temp, "w") as f:
        f.write(text)
    gfile.rename(temp, final, overwrite=True)


# --- the store ------------------------------------------------------------------------------

class BackupStore:
    """Atomic, step-numbered backups in one directory (module docstring).

    Args:
        directory: a local path or any ``tf.io.gfile`` URL (``gs://``, ``s3://``, ``ram://``).
        keep: how many complete backups to keep (the newest).
    """

    def __init__(self, directory: str, keep: int = 1):
        self.directory = os.fspath(directory)
        self.keep = max(1, int(keep))

    def steps(self) -> list[int]:
        """Global steps of the complete backups, oldest first."""
        found = []
        for name in _listdir(self.directory):
            m = _STEP_DIR.match(name)
            if m and _exists(_join(_join(self.directory, name), META_FILE)):
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        return _join(self.directory, f"step-{step:012d}")

    def weights_path(self, step: int) -> str:
        return _join(self.path(step), WEIGHTS_FILE)

    def read_meta(self, step: int) -> dict:
        return json.loads(_read_text(_join(self.path(step), META_FILE)))

    def readable(self, step: int) -> bool:
        """True when this process sees backup ``step``'s weights (a shared filesystem)."""
        return _exists(self.weights_path(step))

    def holds(self, name: str) -> bool:
        """True when ``name`` exists directly in the backup directory."""
        return _exists(_join(self.directory, name))

    def write(self, step: int, write_weights: Callable[[str], None], meta: dict) -> str:
        """Writes backup ``step``: ``write_weights(path)``, then ``meta`` (module docstring).

        A crash before the backup is complete leaves the previous backups complete and
        something ``steps`` ignores and ``prune`` removes.
        """
        meta = dict(meta, format=BACKUP_FORMAT, global_step=step)
        final = self.path(step)
        _makedirs(self.directory)
        if step in self.steps():
            _write_meta(final, meta)  # the same training state: only the metadata may change
        elif is_local_path(self.directory):
            self._write_local(step, write_weights, meta)
        else:
            _rmtree(final)  # an incomplete attempt at this step
            _makedirs(final)
            write_weights(_join(final, WEIGHTS_FILE))
            _write_meta(final, meta)
        self.prune()
        return final

    def _write_local(self, step, write_weights, meta):
        directory = _local(self.directory)
        final = _local(self.path(step))
        temp = os.path.join(directory, f"{_INCOMPLETE}step-{step:012d}-{os.getpid()}")
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a step directory without meta.json
        os.makedirs(temp)
        write_weights(os.path.join(temp, WEIGHTS_FILE))
        _fsync_file(os.path.join(temp, WEIGHTS_FILE))
        with open(os.path.join(temp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(temp)
        os.rename(temp, final)
        _fsync_dir(directory)

    def prune(self):
        """Deletes all but the newest ``keep`` complete backups, and what incomplete writers
        (other processes) left behind."""
        complete = self.steps()
        for step in complete[:-self.keep]:
            _rmtree(self.path(step))
        for name in _listdir(self.directory):
            m = _STEP_DIR.match(name)
            if m and int(m.group(1)) not in complete:
                _rmtree(_join(self.directory, name))
            elif name.startswith(_INCOMPLETE) and name.rsplit("-", 1)[-1] != str(os.getpid()):
                _rmtree(_join(self.directory, name))

    def delete(self):
        _rmtree(self.directory)
