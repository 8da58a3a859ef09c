"""``tfdp.schedules``: the learning-rate schedules, which live in ``tfdp.optimizers.schedules``.

Kept as a module of its own because ``tfdp.schedules.WarmupCosineDecay`` is a public spelling.
"""

from tfdp.optimizers.schedules import *  # noqa: F403 (a shim: the whole module)
from tfdp.optimizers.schedules import __all__  # noqa: F401 (the shim's exports)
