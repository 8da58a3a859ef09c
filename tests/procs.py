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
