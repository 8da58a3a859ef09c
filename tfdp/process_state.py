"""What tfdp holds per process, listed in one place, and the one reset: ``tfdp.reset()``.

Rule. Beyond the objects a user holds (strategies, models, callbacks), tfdp keeps per process
only what ``HOLDERS`` lists: one entry per piece of state, naming the module that owns it, what
it is, how to describe it and how to return it to a fresh ``import tfdp``. ``reset()`` is the
only code that clears them all, in the order listed, and it also puts back what tfdp changed
outside itself: every TensorFlow/Keras patch (``tfdp._tf_private``'s registry), the handlers of
the signals tfdp handles as they were when tfdp was imported, ``sys.exit`` and the atexit
handler of the orderly exit, and the threads tfdp started (the step-deadline watchdog; a
StragglerMonitor's stall meter ends with its listener). Keras's ``clear_session`` is the model.
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
import sys
import threading
from typing import Callable

__all__ = ["reset", "describe", "HOLDERS", "Holder", "HANDLED_SIGNALS"]

# The signals tfdp installs handlers for (preemption, Slurm's warning, the orderly exit).
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def _handlers() -> dict:
    return {name: signal.getsignal(getattr(signal, name)) for name in HANDLED_SIGNALS
            if hasattr(signal, name)}


# As found at ``import tfdp`` (this module is imported by tfdp/__init__.py).
_HANDLERS_AT_IMPORT = _handlers()


@dataclasses.dataclass(frozen=True)
class Holder:
    """One piece of tfdp's process state.

    Attributes:
        name: what it is called in ``describe()``.
        module: the module that owns it (nothing is done while it is not imported).
        describe: ``module -> value`` (comparable: a count, a tuple, None).
        clear: ``module -> None``, back to a fresh import.
    """

    name: str
    module: str
    describe: Callable
    clear: Callable


def _set(module, attribute, value):
    setattr(module, attribute, value)


def _clear_runtime(m):
    with m.state.lock:
        # The engine and the joined runtime are TensorFlow's for the life of the process
        # (``shutdown``'s rule); the layout is forgotten, as hvd.shutdown() does.
        m.state.placement = None


def _stop_watchdog(m):
    m._watchdog.close()
    with m._outside_lock:
        m._outside_counts.clear()


def _clear_listeners(m):
    with m._listeners_lock:
        m._listeners.clear()


HOLDERS = (
    Holder("patches", "tfdp._tf_private.core",
           lambda m: tuple(sorted(f"{getattr(o, '__name__', o)}.{n}" for o, n in m.patched())),
           lambda m: m.restore_patches()),
    Holder("features", "tfdp.strategy.keras_integration",
           lambda m: tuple(sorted(m.installed_features())), lambda m: m._by_feature.clear()),
    Holder("job", "tfdp.strategy.lifecycle", lambda m: (m.job(), sys.exit.__module__),
           lambda m: m.release()),
    Holder("chief-writes redirect", "tfdp.strategy.chief_writes",
           lambda m: (m._worker is not None, tuple(sorted(m._exempt))),
           lambda m: (m.deactivate(), m._exempt.clear())),
    Holder("horovod layout", "tfdp.horovod._runtime",
           lambda m: m.state.placement is not None, _clear_runtime),
    Holder("horovod traced collectives", "tfdp.horovod.collectives",
           lambda m: len(m._cache), lambda m: m._cache.clear()),
    Holder("horovod elastic", "tfdp.horovod.elastic",
           lambda m: (m._private_dir, m._counter[0]),
           lambda m: (_set(m, "_private_dir", None), m._counter.__setitem__(0, 0))),
    Holder("riders", "tfdp.strategy.riders", lambda m: m.strategy_riders(),
           lambda m: m._riders.clear()),
    Holder("timing listeners", "tfdp.strategy.timing", lambda m: len(m._listeners),
           _clear_listeners),
    Holder("step-deadline watchdog", "tfdp.strategy.deadline",
           lambda m: (m._watchdog.running(), len(m._outside_counts)), _stop_watchdog),
    Holder("keras.distribution", "tfdp.keras_distribution.backend", lambda m: m.describe(),
           lambda m: m.clear()),
    Holder("said once", "tfdp.said_once", lambda m: m.said(), lambda m: m.forget()),
    Holder("latest distributed input", "tfdp.data.distributed",
           lambda m: m._latest is not None, lambda m: _set(m, "_latest", None)),
    Holder("running backup", "tfdp.callbacks._running", lambda m: m._backup is not None,
           lambda m: _set(m, "_backup", None)),
    Holder("ZeRO-3 whole reads", "tfdp.strategy.whole_reads", lambda m: m.registered(),
           lambda m: m.clear()),
)


def describe() -> dict:
    """Everything tfdp holds in this process now: ``{holder name: value}`` for the imported
    modules, plus the handlers of ``HANDLED_SIGNALS`` (whether each is the one found at
    ``import tfdp``) and tfdp's live threads (by name)."""
    state = {h.name: h.describe(sys.modules[h.module]) for h in HOLDERS if h.module in sys.modules}
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
    for holder in HOLDERS:
        module = sys.modules.get(holder.module)
        if module is not None:
            holder.clear(module)
    if threading.current_thread() is threading.main_thread():
        for name, handler in _HANDLERS_AT_IMPORT.items():
            if handler is not None and signal.getsignal(getattr(signal, name)) is not handler:
                signal.signal(getattr(signal, name), handler)
    return before
