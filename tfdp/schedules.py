"""``tfdp.schedules``: the learning-rate schedules, which live in ``tfdp.optimizers.schedules``.

Kept as a module of its own because ``tfdp.schedules.WarmupCosineDecay`` is a public spelling.
"""

from tfdp.optimizers.schedules import *  # noqa: F401,F403
from tfdp.optimizers.schedules import __all__  # noqa: F401
