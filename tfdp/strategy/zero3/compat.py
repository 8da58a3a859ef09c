"""The module names of before the package (strategy.sharded_parameters, sharded_units,
whole_reads) kept working.

Rule. Such a module re-exports the package's names, some under their old private spelling.
Where code outside tfdp replaces one of them on the old module (a guard test's
``monkeypatch.setattr(sharded_parameters, "_squared_norm", ...)``, undone after), the
replacement must reach the package module that calls it, or the guard would test nothing:
``forward_assignments`` declares those names, each with the package name it stands for.
Nothing else is forwarded.
"""

from __future__ import annotations

import sys
import types

__all__ = ["forward_assignments"]


class _ReExports(types.ModuleType):
    """A module whose assignments of declared names also assign them in the package."""

    def __setattr__(self, name, value):
        target = self.__dict__.get("_tfdp_forwarded", {}).get(name)
        if target is not None:
            home, home_name = target
            setattr(home, home_name, value)
        super().__setattr__(name, value)


def forward_assignments(module_name: str, forwarded: dict) -> None:
    """Makes the module ``module_name`` forward assignments of the names in ``forwarded``.

    Args:
        module_name: the re-exporting module's ``__name__``.
        forwarded: ``{name there: (package module, its name there)}``.
    """
    module = sys.modules[module_name]
    module._tfdp_forwarded = dict(forwarded)
    module.__class__ = _ReExports
