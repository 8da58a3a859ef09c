"""The error tfdp.data raises and its once-only INFO logging. Pure Python.

Rule: every refusal is a ``DataShardingError`` naming the problem and the fix, raised on every
worker before any collective starts; every choice tfdp makes for the user (policy, fallback,
unknown steps) is logged once per process at INFO on the ``tfdp`` logger, never as a warning.
"""

from __future__ import annotations

import logging

from tfdp import said_once

log = logging.getLogger("tfdp")


class DataShardingError(ValueError):
    """The input cannot be split across workers/replicas as requested."""


def log_once(message, *args):
    """``log.info(message, *args)`` the first time this process sees (message, args)."""
    if said_once.first_time("tfdp.data", (message, args)):
        log.info(message, *args)
