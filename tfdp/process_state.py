"""What tfdp holds per process, listed in one place, and the one reset: ``tfdp.reset()``.

Rule. Beyond the objects a user holds (strategies, models, callbacks), tfdp keeps per process
only what its modules declare here: each module that holds process state calls ``register``
at import, next to that state, with a function that describes it and one that returns it to a
fresh ``import tfdp`` (Keras's one tracker). This module knows no other module's names; it only
iterates. ``reset()`` is the only code that clears them all, in the order the modules were
imported, and it also puts back what tfdp changed outside itself: every TensorFlow/Keras patch
(``tfdp._tf_private``'s registry), the handlers of the signals tfdp handles as they were when
tfdp was imported, ``sys.exit`` and the atexit handler of the orderly exit, and the threads tfdp
started (the step-deadline watchdog; a StragglerMonitor's stall meter ends with its listener).
Keras's ``clear_session`` is the model.
Keras's own ``keras.distribution`` API, which ``import tfdp`` puts on tfdp
(``tfdp.keras_distribution``), is taken off too: its patches go with the others, the strategy
scope it holds is exited and Keras's distribution is the one found when tfdp installed;
``tfdp.keras_distribution.install()`` puts it back.

What TensorFlow keeps cannot be undone in a process and stays: a collective runtime joined
(a multi-worker job), the logical CPU devices, traced functions of live objects. A strategy
built after ``reset()`` works as the first did and reuses them. Modules never imported hold
nothing and are not imported by ``reset()`` or ``describe()``.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Callable

# ``HOLDERS`` (the registered tuple, module ``__getattr__``) stays readable but is not exported.
__all__ = ["reset", "describe", "register", "Holder", "HANDLED_SIGNALS"]

# The signals tfdp installs handlers for (preemption, Slurm's warning, the orderly exit).
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def _handlers() -> dict:
    return {name: signal.getsignal(getattr(signal, name)) for name in HANDLED_SIGNALS
            if hasattr(signal, name)}


# As found at ``import tfdp`` (this module is imported by tfdp/__init__.py).
_HANDLERS_AT_IMPORT = _handlers()


@dataclasses.dataclass(frozen=True)
class Holder:
    """One piece of tfdp's process state, declared by the module that owns it.

    Attributes:
        name: what it is called in ``describe()``.
        module: the owning module's ``__name__``.
        describe: ``() -> value`` (comparable: a count, a tuple, None).
        clear: ``() -> None``, back to a fresh import.
    """

    name: str
    module: str
    describe: Callable[[], object]
    clear: Callable[[], None]


_holders: dict = {}  # name -> Holder, in the order the owning modules were imported


def register(name: str, module: str, describe: Callable[[], object],
             clear: Callable[[], None]) -> Holder:
    """Declares one piece of process state; called once by its owning module at import, next
    to the state itself, with functions of that module (nothing here knows its names).

    Args:
        name: the key in ``describe()``; unique.
        module: the owner's ``__name__`` (registering it again replaces the entry, as a
            reloaded module does).
        describe: returns a comparable summary of the state now.
        clear: returns the state to a fresh import's.
    """
    holder = Holder(name, module, describe, clear)
    owner = _holders.get(name)
    if owner is not None and owner.module != module:
        raise ValueError(f"process state {name!r} is already declared by {owner.module}")
    _holders[name] = holder
    return holder


def __getattr__(name):
    # ``HOLDERS`` stays readable as before the registry: what the imported modules declared.
    if name == "HOLDERS":
        return tuple(_holders.values())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe() -> dict:
    """Everything tfdp holds in this process now: ``{holder name: value}`` for the imported
    modules, plus the handlers of ``HANDLED_SIGNALS`` (whether each is the one found at
    ``import tfdp``) and tfdp's live threads (by name)."""
    state = {h.name: h.describe() for h in tuple(_holders.values())}
    now = _handlers()
    state["signal handlers as at import"] = tuple(
        sorted(name for name, handler in now.items() if handler is _HANDLERS_AT_IMPORT.get(name)))
    state["threads"] = tuple(sorted(t.name for t in threading.enumerate()
                                    if t.name.startswith("tfdp-") and t.is_alive()))
    return state


def reset() -> dict:
    """Returns the process to the state of a fresh ``import tfdp`` (module docstring); returns
    ``describe()`` from before the reset.

    Strategies, models and callbacks built before keep their own state but lose tfdp's
    TensorFlow/Keras behaviour: build new ones after it. Call it on every worker of a job, as
    each built its strategy. Only the main thread may restore signal handlers; from another
    thread they stay.
    """
    before = describe()
    for holder in tuple(_holders.values()):
        holder.clear()
    if threading.current_thread() is threading.main_thread():
        for name, handler in _HANDLERS_AT_IMPORT.items():
            if handler is not None and signal.getsignal(getattr(signal, name)) is not handler:
                signal.signal(getattr(signal, name), handler)
    return before
