"""tfdp's changes to Keras and TensorFlow: one explicit entry to install them, one to remove them.

Rule. Importing tfdp patches none of these (its one change at import is Keras's own
``keras.distribution`` API, ``tfdp.keras_distribution``). ``install(cluster)`` is the one
entry, called by every ``DataParallelStrategy`` as it is built; it is idempotent (each patch
goes through ``tfdp._tf_private``'s registry, which patches an attribute at most once), and
every patch acts only under a tfdp strategy: under another strategy, or none, Keras behaves as
it would without tfdp. ``uninstall()`` puts back every original Keras and TensorFlow attribute and
forgets the job, so a later strategy installs afresh. What it installs:

1. Gradients (``gradient_hooks.install``): Keras reduces gradients before
   clipping (``clipnorm``/``global_clipnorm`` act on the global gradient, as on one device),
   and a ``LossScaleOptimizer`` skips a step on every replica when any replica overflows.
   With ``shard_parameters=True``, Keras's EMA update writes slices of the averages
   (``zero3.optimizer.install_moving_average_hook``), and each unit's layer call gathers its
   parameters again in the backward pass (``zero3.units.install_keras_hooks``).
2. XLA (``xla.install_keras_hooks``): ``jit_compile="auto"`` resolves as on one device, and
   ``jit_compile=True`` compiles each replica's part of the step.
3. Random draws (``randomness.install_keras_hooks``): inside a tfdp replica function, Keras's
   random ops draw for each replica what one device draws for its rows of the global batch.
4. fit's input and exit (``install_fit_input``): the ``x`` of a running ``fit`` is known to
   tfdp's callbacks (``fit_input``), so ``BackupAndRestore`` positions the dataset ``fit``
   trains on and never a validation pipeline; and what a callback registers with
   ``at_fit_exit`` runs however ``fit`` ends (Keras calls ``on_train_end`` only when it
   returns: a preemption's ``SystemExit`` or a failing step would leave signal handlers and
   timers behind). Also installed by that callback itself.
5. With several workers, the stock callbacks and saving: only the chief writes to the user's
   paths (``chief_writes``), and ``EarlyStopping``-style decisions and restored epochs agree
   across workers (``consensus``).
6. AutoGraph (``autograph_leaves_tfdp``): AutoGraph calls tfdp's functions as written, as it
   calls TensorFlow's and Keras's, instead of converting ``strategy.run`` and its helpers in
   every process that runs a custom loop; the user's replica function is still converted
   exactly when ``Strategy.run`` would convert it (``randomness.replica_function``).

Every patch is installed through one entry, ``require(feature)``, by named feature
(``FEATURES``): ``install`` requires the features above; ``ShardedOptimizer`` requires
``"loss_scale_saving"`` when it is first built, ``BackupAndRestore`` ``"fit_input"``, and
``StragglerMonitor`` ``"collective_timing"``. ``installed_features()`` lists, per feature, the
attributes it replaced. ``uninstall`` (the older spelling of ``tfdp.reset()``) removes them all.

The launcher-protocol side of a strategy (ready files, SIGTERM, leaving together at exit) is
not Keras's and lives apart, in ``tfdp.strategy.lifecycle``.
"""

from __future__ import annotations

import functools
import inspect

from tfdp import process_state
from tfdp import _tf_private
from tfdp.strategy import (chief_writes, consensus, gradient_hooks, is_data_parallel,
                           randomness, xla)
from tfdp.strategy.zero3 import optimizer as zero3_optimizer
from tfdp.strategy.zero3 import units as zero3_units

__all__ = ["install", "uninstall", "installed", "install_fit_input", "fit_input", "at_fit_exit",
           "require", "add_feature", "installed_features", "FEATURES"]

_FIT_INPUT = "_tfdp_fit_input"  # tfdp's own attribute on a model while its fit runs
_FIT_EXIT = "_tfdp_fit_exit"  # what runs when that fit ends, however it ends


def _collective_timing():
    from tfdp.strategy import timing

    timing.install_collective_timing()


def _install_epoch_iterators():
    # Keras makes fewer distributed iterators under tfdp's strategies: none to build a built
    # model, none after an epoch that the next one would replace (_tf_private.keras_trainer).
    _tf_private.patch_keras_symbolic_build(
        lambda model: is_data_parallel(model.distribute_strategy))
    _tf_private.patch_keras_epoch_iterators(
        lambda epoch_iterator: is_data_parallel(
            getattr(epoch_iterator, "_distribute_strategy", None)))


# feature -> the function that installs its patches (each idempotent). A layer above the
# strategy adds its own with ``add_feature`` (ShardedOptimizer: "loss_scale_saving").
FEATURES = {
    "gradients": lambda: gradient_hooks.install(),
    "zero3_moving_average": lambda: zero3_optimizer.install_moving_average_hook(),
    "zero3_units": lambda: zero3_units.install_keras_hooks(),
    "xla": lambda: xla.install_keras_hooks(),
    "random_draws": lambda: randomness.install_keras_hooks(),
    "fit_input": lambda: install_fit_input(),
    "consensus": lambda: consensus.install(),
    "chief_writes": lambda: chief_writes.install(),
    "collective_timing": _collective_timing,
    "device_input": lambda: (_tf_private.patch_device_datasets_without_autotune(),
                             _tf_private.patch_per_device_generators_traced_once()),
    "epoch_iterators": lambda: _install_epoch_iterators(),
    "autograph_leaves_tfdp": lambda: _tf_private.patch_autograph_leaves_module("tfdp"),
}
_BASE = ("gradients", "zero3_moving_average", "zero3_units", "xla", "random_draws", "fit_input",
         "device_input", "epoch_iterators", "autograph_leaves_tfdp")
_by_feature: dict = {}  # feature -> ((owner, attribute), ...) it replaced


def add_feature(feature: str, install_patches) -> None:
    """Makes ``feature`` installable by ``require`` (a module above tfdp.strategy)."""
    FEATURES.setdefault(feature, install_patches)


def require(feature: str) -> None:
    """Installs ``feature``'s patches (``FEATURES``) if they are not in place (idempotent)."""
    if feature not in FEATURES:
        raise ValueError(f"unknown tfdp feature {feature!r}: one of {sorted(FEATURES)}")
    before = set(_tf_private.patched())
    FEATURES[feature]()
    added = tuple(entry for entry in _tf_private.patched() if entry not in before)
    if added or feature not in _by_feature:
        _by_feature[feature] = _by_feature.get(feature, ()) + added


def installed_features() -> dict:
    """``{feature: [(owner, attribute), ...]}`` of the features required and still in place."""
    present = set(_tf_private.patched())
    return {f: [e for e in entries if e in present] for f, entries in _by_feature.items()
            if any(e in present for e in entries)}


def install(cluster=None) -> None:
    """Installs the integration (idempotent).

    Args:
        cluster: the job's ``tfdp.ClusterConfig``; with several workers the chief-writes and
            consensus patches are installed too, and this process writes as ``cluster``'s
            rank.
    """
    for feature in _BASE:
        require(feature)
    if cluster is not None and cluster.is_multi_worker:
        require("chief_writes")
        chief_writes.activate(cluster)
        require("consensus")


def uninstall() -> int:
    """The older spelling of ``tfdp.reset()``; returns how many Keras and TensorFlow
    attributes it put back.

    Strategies built before keep their own state but lose tfdp's Keras behaviour (reduction
    before clipping, the XLA step, per-replica draws, the chief writing): build a new strategy to install again.
    """
    from tfdp import process_state

    return len(process_state.reset().get("patches", ()))


def installed() -> list:
    """``(owner, attribute)`` of every patch in place."""
    return _tf_private.patched()


def install_fit_input() -> None:
    """Makes ``fit_input(model)`` answer while ``model.fit`` runs (idempotent)."""

    def make_fit(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            call = signature.bind(self, *args, **kwargs).arguments
            running = (call.get("x"), call.get("steps_per_epoch"), call.get("initial_epoch", 0))
            outer = vars(self).get(_FIT_INPUT), vars(self).get(_FIT_EXIT)
            object.__setattr__(self, _FIT_INPUT, running)  # past Keras's attribute tracking
            object.__setattr__(self, _FIT_EXIT, [])
            try:
                return original(self, *args, **kwargs)
            finally:
                hooks = vars(self).get(_FIT_EXIT) or []
                object.__setattr__(self, _FIT_INPUT, outer[0])
                object.__setattr__(self, _FIT_EXIT, outer[1])
                _run_exit_hooks(hooks)
        return fit

    _tf_private.patch_keras_fit(make_fit)


def _run_exit_hooks(hooks):
    # Last registered first, like a stack of context managers; each runs even if one before
    # raised, and the first error propagates (unless fit's own exception is already on its way).
    error = None
    for hook in reversed(hooks):
        try:
            hook()
        except Exception as e:  # run the rest, then report the first
            error = error or e
    if error is not None:
        raise error


def at_fit_exit(model, hook) -> bool:
    """Runs ``hook()`` when the ``fit`` running on ``model`` ends, by return or by exception.

    For clean-up that must not outlive ``fit`` (signal handlers, timers): Keras calls
    ``on_train_end`` only when ``fit`` returns. Returns False, registering nothing, outside a
    ``fit`` (or before ``install_fit_input``). A hook should be idempotent: ``on_train_end``
    may have done the same work already.
    """
    hooks = vars(model).get(_FIT_EXIT) if model is not None else None
    if hooks is None:
        return False
    hooks.append(hook)
    return True


def fit_input(model):
    """``(x, steps_per_epoch, initial_epoch)`` of the ``fit`` call running on ``model`` (the
    dataset it trains on and how its epochs are laid out), or None outside ``fit`` (or before
    ``install_fit_input``)."""
    return vars(model).get(_FIT_INPUT) if model is not None else None


process_state.register("features", __name__, lambda: tuple(sorted(installed_features())),
                       _by_feature.clear)
