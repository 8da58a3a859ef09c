"""The name of before ``tfdp.strategy.zero3`` for ZeRO-3's whole reads on several workers
(compatibility).

The rule and its process state (registered once, by the package module) live in
zero3/whole_reads.py.
"""

from __future__ import annotations

from tfdp.strategy.zero3.whole_reads import (WholeReadError, clear, end_for_the_others,
                                             register, registered, serve_until_the_chief_ends,
                                             take_number, take_part)
from tfdp.strategy.zero3.whole_reads import (  # noqa: F401 (the spelling of before)
    take_number as _take_number)

__all__ = ["register", "take_part", "serve_until_the_chief_ends", "end_for_the_others",
           "clear", "registered", "take_number", "WholeReadError"]
