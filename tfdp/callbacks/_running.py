"""The ``BackupAndRestore`` of the running ``fit``, if any.

``StragglerMonitor`` hands it eviction requests (so that the backup and the exit happen at one
agreed step) and ``DatasetEpoch`` leaves the dataset's position to it.
"""

from __future__ import annotations

from tfdp import process_state

_backup = None


def backup():
    """The running fit's ``BackupAndRestore`` (None outside one)."""
    return _backup


def set_backup(callback) -> None:
    global _backup
    _backup = callback


def _forget() -> None:
    global _backup
    _backup = None


process_state.register("running backup", __name__, lambda: _backup is not None, _forget)
