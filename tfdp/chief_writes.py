"""``tfdp.chief_writes.per_worker_path``: the 0.3 spelling, documented then; the mechanism is
``tfdp.strategy.chief_writes`` and the public name ``tfdp.callbacks.per_worker_path``."""

from tfdp.strategy.chief_writes import CHIEF_WRITES_ENV, per_worker_path

__all__ = ["per_worker_path", "CHIEF_WRITES_ENV"]
