"""The name of before ``tfdp.strategy.zero3`` for ZeRO-3's units (compatibility).

The unit rule lives in zero3/units.py (``Unit``), its XLA side in zero3/units_xla.py and
``unit_layers``' check in zero3/config.py.
"""

from __future__ import annotations

from tfdp.strategy.zero3.config import resolve_unit_layers
from tfdp.strategy.zero3.units import Unit, install_keras_hooks, is_unit
from tfdp.strategy.zero3.units_xla import compile_units_here, compiles_units
from tfdp.strategy.zero3.units_xla import (  # noqa: F401 (the spellings of before)
    compilable as _compilable, compiled_calls as _compiled_calls, static_key as _static_key)

__all__ = ["install_keras_hooks", "is_unit", "resolve_unit_layers", "compile_units_here",
           "compiles_units", "Unit"]
