"""Large-batch optimizers for Keras 3 (paper-faithful LARS and LAMB)."""

from tfdp.optimizers.lamb import LAMB
from tfdp.optimizers.lars import LARS

__all__ = ["LARS", "LAMB"]
