"""The module names of before the package (strategy.sharded_parameters, sharded_units,
whole_reads) kept working.

Rule. Such a module re-exports the package's names, and assigning one of them on it (a test's
``monkeypatch.setattr(sharded_parameters, "_squared_norm", ...)``, undone after) assigns it
in the package module that defines and calls it, so the patch reaches the code it was meant
for. Nothing else is forwarded.
"""

from __future__ import annotations

import sys
import types

__all__ = ["forward_assignments"]


class _ReExports(types.ModuleType):
    """A module whose assignments also reach the package modules its names come from."""

    def __setattr__(self, name, value):
        for home in self.__dict__.get("_tfdp_homes", ()):
            if name in vars(home):
                setattr(home, name, value)
        super().__setattr__(name, value)


def forward_assignments(module_name: str, *homes) -> None:
    """Makes the module ``module_name`` forward assignments of names that ``homes`` define.

    Args:
        module_name: the re-exporting module's ``__name__``.
        homes: the package modules whose names it re-exports.
    """
    module = sys.modules[module_name]
    module._tfdp_homes = tuple(homes)
    module.__class__ = _ReExports
