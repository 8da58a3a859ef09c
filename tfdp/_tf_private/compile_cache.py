"""The names TensorFlow gives traced functions, which key XLA's persistent compilation cache.

Why private: TensorFlow's persistent XLA cache (``--tf_xla_persistent_cache_directory``) keys
an entry by the compiled function's name, ``__inference_<name>_<uid>``, where ``uid`` is a
process-wide counter (``tensorflow.python.framework.ops.uid``) that every traced function,
graph and op name advances. A restarted worker that restores a backup first traces more
functions than the first attempt did, so the step it then traces gets other names and the
cache misses (measured, TF 2.21: one traced function more before a ``jit_compile`` function,
another entry). No public API names a traced function or sets the counter; tfdp advances the
counter to the next multiple of ``block`` right before the train step is traced, so the step's
functions get the same names in every attempt whatever ran before.
"""

from __future__ import annotations

from tensorflow.python.framework import ops as _ops

from tfdp._tf_private.core import get_private

__all__ = ["align_function_names"]

_USED_FOR = "the same traced-function names in every attempt (XLA's persistent cache keys)"
_BLOCK = 1 << 17  # ~40 ms of counting on this host's CPU


def align_function_names(block: int = _BLOCK) -> int:
    """Advances TensorFlow's uid counter to the next multiple of ``block``; returns it.

    Deterministic while fewer than ``block`` uids were taken before (a process takes a few
    thousand before its first step)."""
    uid = get_private(_ops, "uid", _USED_FOR)
    value = uid()
    target = (value // block + 1) * block
    while value < target:
        value = uid()
    return value
