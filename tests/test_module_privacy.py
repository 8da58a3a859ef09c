"""No tfdp module reads or writes another tfdp module's private names (issue 60, item 1).

A name with one leading underscore belongs to the module that defines it: another module
that reaches it (``from tfdp.x import _name``, or ``alias._name`` where ``alias`` is bound to
another tfdp module by an import, absolute or relative) ties itself to a detail its owner may
change without notice. What a sibling needs is public in its owner, with a docstring.

Importing a private *module* (``from tfdp.horovod import _runtime``, ``from tfdp import
_tf_private``) is allowed: a package's private module is its package's to share; its own
private names stay its own. Dunders (``module.__name__``) are no one's private. Pure ``ast``,
no import of tfdp: fast, and it sees function-level imports too.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "tfdp"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def tfdp_sources() -> dict:
    """Module name -> (path relative to the repository, source, is a package's __init__)."""
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = (str(path.relative_to(REPO)), path.read_text(), is_package)
    return sources


def _import_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    parts = package[:len(package) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _aliases(tree, module, is_package, modules, hits, where):
    """Names bound in ``module`` to tfdp modules; ``from X import _private`` into ``hits``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _import_base(node, module, is_package)
            if base != "tfdp" and not base.startswith("tfdp."):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif _is_private(alias.name) and base != module:
                    hits.append((where, node.lineno, f"from {base} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tfdp" or alias.name.startswith("tfdp."):
                    # "import tfdp.x.y" binds "tfdp"; "import tfdp.x.y as a" binds a = tfdp.x.y.
                    aliases[alias.asname or "tfdp"] = alias.name if alias.asname else "tfdp"
    return aliases


def _module_of(node, aliases, modules):
    """The tfdp module an expression names (``a``, ``tfdp.x.y``), or None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _module_of(node.value, aliases, modules)
        if base is not None and f"{base}.{node.attr}" in modules:
            return f"{base}.{node.attr}"
    return None


def private_uses(sources: dict) -> list:
    """``path:line: what`` for every use of another module's private name, in ``sources``
    (module name -> (path, source, is a package's __init__))."""
    hits = []
    for module, (where, source, is_package) in sources.items():
        tree = ast.parse(source, filename=where)
        aliases = _aliases(tree, module, is_package, sources, hits, where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = _module_of(node.value, aliases, sources)
                if owner is not None and owner != module:
                    hits.append((where, node.lineno, f"{ast.unparse(node)} ({owner})"))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(set(hits))]


def test_no_module_uses_another_modules_private_names():
    hits = private_uses(tfdp_sources())
    assert not hits, ("a tfdp module uses another module's private name: make it public (with "
                      "a docstring) in its owner, or move the code there:\n" + "\n".join(hits))


def test_guard_the_scan_finds_each_kind_of_access():
    owner = "def _secret():\n    pass\n\n\ndef shown():\n    pass\n"
    user = textwrap.dedent("""\
        import tfdp.pkg.owner
        import tfdp.pkg.owner as aliased
        from tfdp.pkg import owner
        from . import owner as relative
        from tfdp.pkg.owner import _secret
        from .owner import _secret as again
        from tfdp.pkg.owner import shown


        def _mine():
            pass


        def f():
            owner._secret()
            aliased._secret = None
            relative._secret
            tfdp.pkg.owner._secret
            owner.shown(), owner.__name__, _mine()
        """)
    sources = {"tfdp.pkg": ("tfdp/pkg/__init__.py", "", True),
               "tfdp.pkg.owner": ("tfdp/pkg/owner.py", owner, False),
               "tfdp.pkg.user": ("tfdp/pkg/user.py", user, False)}
    assert private_uses(sources) == [
        "tfdp/pkg/user.py:5: from tfdp.pkg.owner import _secret",
        "tfdp/pkg/user.py:6: from tfdp.pkg.owner import _secret",
        "tfdp/pkg/user.py:15: owner._secret (tfdp.pkg.owner)",
        "tfdp/pkg/user.py:16: aliased._secret (tfdp.pkg.owner)",
        "tfdp/pkg/user.py:17: relative._secret (tfdp.pkg.owner)",
        "tfdp/pkg/user.py:18: tfdp.pkg.owner._secret (tfdp.pkg.owner)",
    ]
    # A module's own private names, and a package's from its __init__ (relative), are its own.
    own = "from . import _private_here\n_private_here = 1\n"
    assert private_uses({"tfdp.pkg": ("tfdp/pkg/__init__.py", own, True)}) == []
