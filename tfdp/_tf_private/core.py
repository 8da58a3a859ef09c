"""How tfdp reaches a TensorFlow/Keras private name, and how it undoes what it replaced.

The rule of this module: every private attribute read goes through ``get_private`` or
``require_attributes``, and every process-wide replacement of a TensorFlow or Keras attribute
(a class method, a module function, a name in a generated API module) goes through
``patch_attribute`` or ``replace_attribute`` (``provide_attribute`` for one that may be
absent). So a TensorFlow or Keras upgrade that renames one fails with
``PrivateAPIError`` naming the attribute and what tfdp used it for, at the first use (import
time for class hooks), and ``restore_patches()`` puts TensorFlow and Keras back exactly as
they were. Setting an attribute of one object a user owns (a model, a checkpoint manager) is
not process-wide and needs no record.

The area modules of ``tfdp._tf_private`` import this one; it imports none of them. Its names
are public within the package (every area uses them), not to tfdp outside it.
"""

from __future__ import annotations

import threading


class PrivateAPIError(AttributeError):
    """A TensorFlow/Keras private name tfdp relies on is missing in the installed version."""


def _versions() -> str:
    import keras
    import tensorflow as tf

    return f"TensorFlow {tf.__version__} / Keras {keras.__version__}"


def _missing(owner, name, used_for) -> PrivateAPIError:
    where = owner if isinstance(owner, str) else getattr(owner, "__qualname__", repr(owner))
    return PrivateAPIError(
        f"tfdp relies on the private {where}.{name} ({used_for}), which the installed "
        f"{_versions()} does not have: this version moved or renamed it. Install the "
        "TensorFlow and Keras versions tfdp supports (setup.cfg's install_requires), or a "
        "tfdp release made for yours; tfdp/_tf_private/ is the one place to adapt.")


def get_private(obj, name, used_for):
    """``obj.name``, or PrivateAPIError naming it and ``used_for`` when the installed version
    lacks it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(type(obj).__qualname__, name, used_for) from None


def require_attributes(owner, names, used_for) -> None:
    """Raises PrivateAPIError naming the first of ``names`` the class ``owner`` lacks."""
    for name in names:
        if not hasattr(owner, name):
            raise _missing(owner, name, used_for)


# --- The record of every replacement -------------------------------------------------------
# One entry per replaced attribute, in the order of replacement: (owner, name, what the
# owner's own namespace held before). The raw namespace entry, not getattr's value, so that
# restoring gives back a staticmethod/classmethod wrapper as it was, and deletes an attribute
# the owner only inherited instead of pinning the inherited value on it. The lock makes a
# check-then-replace atomic: two threads building strategies at once patch each name once.

_ABSENT = object()
_lock = threading.RLock()
_registry: list[tuple[object, str, object]] = []


def _own_entry(owner, name):
    try:
        return vars(owner).get(name, _ABSENT)
    except TypeError:  # no __dict__: what getattr sees is all there is
        return getattr(owner, name, _ABSENT)


def replace_attribute(owner, name, value, used_for) -> None:
    """Sets ``owner.name = value`` process-wide, recorded so ``restore_patches`` undoes it."""
    with _lock:
        if not hasattr(owner, name):
            raise _missing(owner, name, used_for)
        _registry.append((owner, name, _own_entry(owner, name)))
        setattr(owner, name, value)


def patch_attribute(owner, name, make, used_for):
    """Replaces ``owner.name`` by ``make(original)`` once; returns the original.

    Idempotent: an attribute tfdp already patched is left alone (its original is returned).
    The replacement is marked ``_tfdp_patch = True`` with ``__wrapped__`` the original.
    """
    with _lock:
        current = getattr(owner, name, None)
        if current is None:
            raise _missing(owner, name, used_for)
        if getattr(current, "_tfdp_patch", False):
            return current.__wrapped__
        replacement = make(current)
        replacement._tfdp_patch = True
        replacement.__wrapped__ = current
        replace_attribute(owner, name, replacement, used_for)
        return current


def provide_attribute(owner, name, value, used_for) -> None:
    """Sets ``owner.name = value`` whether or not the owner has the attribute (a function a
    Keras backend module lacks), recorded so ``restore_patches`` removes it or puts the old
    one back. Idempotent: a value tfdp already provided is left alone."""
    del used_for  # the attribute may be absent: nothing to name as missing
    with _lock:
        if getattr(getattr(owner, name, None), "_tfdp_patch", False):
            return
        value._tfdp_patch = True
        _registry.append((owner, name, _own_entry(owner, name)))
        setattr(owner, name, value)


def patched() -> list:
    """``(owner, name)`` of every attribute tfdp has replaced and not restored, in order."""
    with _lock:
        return [(owner, name) for owner, name, _ in _registry]


def restore_patches() -> int:
    """Puts back every original recorded (``patch_attribute``, ``replace_attribute``,
    ``provide_attribute``), newest first; returns how many.

    TensorFlow and Keras are then as tfdp found them. tfdp's own "installed once" flags are not
    reset, so a process that restores and then needs tfdp's hooks again re-applies them itself.
    """
    with _lock:
        entries = _registry[::-1]
        _registry.clear()
        for owner, name, original in entries:
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        return len(entries)
