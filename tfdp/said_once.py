"""Messages tfdp says once per process: one set for all of them.

Rule. A warning or log line that would repeat for every step, layer or strategy is said the
first time its key is seen in this process; ``first_time(topic, key)`` answers whether that is
now. ``tfdp.reset()`` forgets them all, so a notebook that resets hears them again.
"""

from __future__ import annotations

import threading

from tfdp import process_state

__all__ = ["first_time", "forget", "said"]

_said: set = set()
_lock = threading.Lock()


def _hashable(key):
    """``key`` as a set member: lists (a shared GPU's replicas) and dicts become tuples."""
    if isinstance(key, (list, tuple)):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in key.items()))
    return key


def first_time(topic: str, key) -> bool:
    """True the first time ``(topic, key)`` is asked in this process (then it is said)."""
    key = _hashable(key)
    with _lock:
        if (topic, key) in _said:
            return False
        _said.add((topic, key))
        return True


def said() -> int:
    """How many messages have been said once."""
    return len(_said)


def forget() -> None:
    with _lock:
        _said.clear()


process_state.register("said once", __name__, said, forget)
