"""tfdp's changes to Keras and TensorFlow: one explicit entry to install them, one to remove them.

Rule. Importing tfdp patches nothing. ``install(cluster)`` is the one entry, called by every
``DataParallelStrategy`` as it is built; it is idempotent (each patch goes through
``tfdp._tf_private``'s registry, which patches an attribute at most once), and every patch
acts only under a tfdp strategy: under another strategy, or none, Keras behaves as it would
without tfdp. ``uninstall()`` puts back every original Keras and TensorFlow attribute and
forgets the job, so a later strategy installs afresh. What it installs:

1. Gradients (``collectives.install_keras_gradient_hooks``): Keras reduces gradients before
   clipping (``clipnorm``/``global_clipnorm`` act on the global gradient, as on one device),
   and a ``LossScaleOptimizer`` skips a step on every replica when any replica overflows.
2. XLA (``xla.install_keras_hooks``): ``jit_compile="auto"`` resolves as on one device, and
   ``jit_compile=True`` compiles each replica's part of the step.
3. Random draws (``randomness.install_keras_hooks``): inside a tfdp replica function, Keras's
   random ops draw for each replica what one device draws for its rows of the global batch.
4. With several workers, the stock callbacks and saving: only the chief writes to the user's
   paths (``chief_writes``), and ``EarlyStopping``-style decisions and restored epochs agree
   across workers (``consensus``).

``ShardedOptimizer`` adds its ``LossScaleOptimizer`` saving hooks through the same registry
when it is first built; ``uninstall`` removes them too.

The launcher-protocol side of a strategy (ready files, SIGTERM, leaving together at exit) is
not Keras's and lives apart, in ``tfdp.strategy.lifecycle``.
"""

from __future__ import annotations

from tfdp import _tf_private
from tfdp.strategy import chief_writes, collectives, consensus, randomness, xla

__all__ = ["install", "uninstall", "installed"]


def install(cluster=None) -> None:
    """Installs the integration (idempotent).

    Args:
        cluster: the job's ``tfdp.ClusterConfig``; with several workers the chief-writes and
            consensus patches are installed too, and this process writes as ``cluster``'s
            rank.
    """
    collectives.install_keras_gradient_hooks()
    xla.install_keras_hooks()
    randomness.install_keras_hooks()
    if cluster is not None and cluster.is_multi_worker:
        chief_writes.activate(cluster)
        consensus.install()


def uninstall() -> int:
    """Puts back every Keras and TensorFlow attribute tfdp replaced; returns how many.

    Strategies built before keep their own state but lose tfdp's Keras behaviour (reduction
    before clipping, the XLA step, per-replica draws, the chief writing): build a new strategy to install again.
    """
    chief_writes.deactivate()
    return _tf_private.restore_patches()


def installed() -> list:
    """``(owner, attribute)`` of every patch in place."""
    return _tf_private.patched()
