"""The ``BackupAndRestore`` of the running ``fit``, if any.

``StragglerMonitor`` hands it eviction requests (so that the backup and the exit happen at one
agreed step) and ``DatasetEpoch`` leaves the dataset's position to it.
"""

from __future__ import annotations

_backup = None


def backup():
    """The running fit's ``BackupAndRestore`` (None outside one)."""
    return _backup


def set_backup(callback) -> None:
    global _backup
    _backup = callback
