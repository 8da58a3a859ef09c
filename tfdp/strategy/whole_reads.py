"""The name of before ``tfdp.strategy.zero3`` for ZeRO-3's whole reads on several workers
(compatibility).

The rule and its process state (registered once, by the package module) live in
zero3/whole_reads.py. Assigning a name here assigns it there too (zero3/compat.py).
"""

from __future__ import annotations

from tfdp.strategy.zero3 import compat, whole_reads as _home
from tfdp.strategy.zero3.whole_reads import (WholeReadError, _take_number,  # noqa: F401
                                             clear, end_for_the_others, register, registered,
                                             serve_until_the_chief_ends, take_part)

__all__ = ["register", "take_part", "serve_until_the_chief_ends", "end_for_the_others",
           "clear", "registered", "WholeReadError"]

compat.forward_assignments(__name__, _home)
