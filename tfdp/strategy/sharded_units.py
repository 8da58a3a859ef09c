"""The name of before ``tfdp.strategy.zero3`` for ZeRO-3's units (compatibility).

The unit rule lives in zero3/units.py (``Unit``), its XLA side in zero3/units_xla.py and
``unit_layers``' check in zero3/config.py. Assigning a name here assigns it there too
(zero3/compat.py).
"""

from __future__ import annotations

from tfdp.strategy.zero3 import compat, config, units, units_xla
from tfdp.strategy.zero3.config import resolve_unit_layers
from tfdp.strategy.zero3.units import Unit, install_keras_hooks, is_unit
from tfdp.strategy.zero3.units_xla import (_compiled_calls, _static_key,  # noqa: F401
                                           compilable as _compilable, compile_units_here,
                                           compiles_units)

__all__ = ["install_keras_hooks", "is_unit", "resolve_unit_layers", "compile_units_here",
           "compiles_units", "Unit"]

compat.forward_assignments(__name__, config, units, units_xla)
