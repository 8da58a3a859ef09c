"""Process helpers shared by the tests that start and signal real processes (no TensorFlow)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie.

    The process may end between any two looks at it (that is what the callers wait for), so
    every "it is gone" answer from the kernel counts as gone.
    """
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            # The state field follows the command name, which may itself hold ")".
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:  # someone else's process under the same pid: it exists
        return True


def _children(pid: int) -> list[int]:
    """``pid``'s children, from every one of its threads (a child belongs to the thread that
    started it)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, ... (not ``pid``)."""
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        if child not in found:
            found.append(child)
            todo += _children(child)
    return found


def carrying(name: str, value: str) -> list[int]:
    """The processes whose environment has ``name=value``: what a test started, found even
    where it is nobody's descendant here (started over ssh, by Slurm, orphaned)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found
