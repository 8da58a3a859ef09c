"""ShardedOptimizer: ZeRO stages 1 and 2 (optimizer-state and gradient sharding) for any
Keras 3 optimizer.

Partition rule (whole variables, like PyTorch's ZeroRedundancyOptimizer): variables are
sorted by size, largest first, and each goes to the replica whose partition is currently
smallest (greedy LPT); ties go to the lower replica id. A variable is never split, so every
optimizer sees whole tensors: layer-wise norms (LARS, LAMB) and per-tensor clipping stay
exact with no extra communication. With many variables the largest partition stays within
a few percent of total/N; a variable larger than total/N is a partition of its own, so one
dominant variable limits the saving but never correctness.

Each optimizer update, in every replica:

1. reduce-scatter the local gradients: replica k receives the global sum of the gradients
   of the variables it owns (all-to-all + local sum, in rounds of bounded size: exchange.py);
2. clip the owned reduced gradients (``clipvalue``/``clipnorm`` per tensor; the norm
   for ``global_clipnorm`` is one scalar all-reduce of the owned squared norms);
3. update the owned variables with the wrapped optimizer (decoupled weight decay
   included); its state exists only for the owned variables, on this device;
4. all-gather the owned new values into every replica's variables, in place and in rounds
   (exchange.py), so every replica holds identical weights.

Optimizer state (which optimizers shard). The wrapped optimizer builds its state inside
ShardedOptimizer.build. A state variable belongs to model variable i when it is made by
``add_variable_from_reference(variable_i)``, or when it sits at position i of one of the
optimizer's lists indexed like the variables (Keras's convention: ``update_step`` reads
``self._r[self._get_variable_index(variable)]``), whatever its shape: Adafactor's factored
second moments have a row's and a column's shape. Such state lives on the owner's device only
and is saved consolidated. State that belongs to no variable is shared: it stays on every
replica and the wrapped optimizer saves it; only Keras's Nadam has some (its ``u_product``,
advanced once per update by its ``_backend_update_step``, which each replica runs with no
variables before its owned updates). Refused, with an error naming the optimizer and the fix
(use it unsharded): a class that replaces Keras's whole-step methods (``apply``,
``apply_gradients``, ``_backend_apply_gradients``, or ``_backend_update_step`` other than
Nadam's; Keras's MultiOptimizer) when wrapped, and shared state advanced any other way when
built. docs/zero.md has the table of every Keras optimizer.

Gradient accumulation (ZeRO stage 2). With ``gradient_accumulation_steps=k`` on the wrapped
optimizer, k calls (micro-batches) make one update, with Keras's semantics: the update uses
the mean of the k micro-batch gradients, clipping and weight decay act on that mean,
``iterations`` counts updates and a learning-rate schedule sees micro-batches. When the
gradients are reduced is the ``accumulation`` argument:

* ``"sharded"`` (default; ZeRO-2): every micro-batch is reduce-scattered (step 1) and each
  replica adds the reduced gradients of the variables it owns to accumulators that exist on
  its device only, so accumulators cost ~1/N of a gradient copy per replica. The k-th
  micro-batch runs steps 2-4 on (accumulated + current)/k. Cost: k reduce-scatters per update.
* ``"local"``: each replica adds its own full local gradient to full-size accumulators (one
  gradient copy per replica, as unsharded Keras does), and the k-th micro-batch
  reduce-scatters (accumulated + current)/k once. Cost: one reduce-scatter per update, but N
  times the accumulator memory. Use it when memory allows and the network is the bottleneck.

Both give the same result up to floating-point summation order. Sparse gradients are made
dense when accumulating, as Keras's accumulators do.

EMA (``use_ema=True`` on the wrapped optimizer): the owner of a variable keeps its moving
average (sharded like the slots) and updates it after every call exactly as Keras does; when
``ema_overwrite_frequency`` fires, and in ``finalize_variable_values`` (which ``fit`` calls at
the end), every replica receives the averages by an all-gather from their owners.
``keras.callbacks.SwapEMAWeights`` is not supported: it updates each average through the
strategy as a mirrored variable, and a sharded average is a single-device one (TensorFlow
fails with a bare ``AssertionError`` in ``mirrored_strategy._update``).

What Keras sees: ``variables`` lists every state variable this process holds: the counters,
and the sharded slots, accumulators and EMA copies, each a single-device variable on its
owner's device (with several workers, a variable another worker owns is not held here, so it
is not listed). Summing the bytes of ``variables`` per device gives ``state_bytes_per_replica()``.

State consolidation: Keras saving (``save_weights``, ``model.save``, BackupAndRestore)
stores each sharded slot, accumulator and EMA copy as one full array, gathered from its
owner: the files do not depend on the replica count, and loading them into any number of
replicas (4 -> 2, 2 -> 1, 1 -> 4) hands each new owner its state. With several workers,
saving gathers over the network, so every worker must save (the chief to the real path, the
others to a temporary one: tfdp.callbacks does this); a chief that saves alone fails within
seconds with an error naming the fix (sharded_state.py, "Saving on several workers"). A ``LossScaleOptimizer`` around a
ShardedOptimizer saves only its own loss-scale variables; the ShardedOptimizer saves the rest
(Keras's LossScaleOptimizer would also store every variable of the wrapped optimizer
positionally, which with several workers depends on who owns what).

Sparse gradients (``IndexedSlices`` from ``Embedding``) without accumulation are not
reduce-scattered: they are all-gathered as IndexedSlices (what TensorFlow does for them
unsharded) and the owner applies them, so optimizers with their own sparse update rule
behave exactly as unsharded. Their state is still sharded; their communication is not reduced.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
import tensorflow as tf
import keras

from tfdp import _tf_private
from tfdp.optimizers import exchange
from tfdp.optimizers._layerwise import dense
from tfdp.optimizers.sharded_state import (ConsolidatedState, StatePlacement, is_stand_in,
                                           install_loss_scale_saving_hooks,
                                           optimizer_state_bytes_per_replica)
from tfdp.strategy import (collectives, is_data_parallel, keras_integration, replica_ops,
                           sparse_gradients)

__all__ = ["ShardedOptimizer", "partition", "ACCUMULATION_MODES"]

ACCUMULATION_MODES = ("sharded", "local")


def partition(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Owner (0..num_shards-1) of each variable under the greedy largest-first rule. Pure."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1.")
    owners = [0] * len(sizes)
    heap = [(0, shard) for shard in range(num_shards)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, shard = heapq.heappop(heap)
        owners[index] = shard
        heapq.heappush(heap, (load + sizes[index], shard))
    return owners


def _num_elements(variable) -> int:
    return int(np.prod(variable.shape)) if len(variable.shape) else 1


def _check_updates_per_variable(optimizer):
    """Refuses an optimizer whose step is not one update_step per variable (module doc)."""
    name = type(optimizer).__name__
    replaced = [m for m in _tf_private.overridden_step_methods(optimizer)
                if not (m == "_backend_update_step" and _tf_private.advances_shared_state(optimizer))]
    if isinstance(optimizer, keras.optimizers.MultiOptimizer):
        reason = ("its apply() sends each group of variables to a sub-optimizer, and "
                  "ShardedOptimizer never calls apply(): it updates each owned variable "
                  "through update_step")
    elif replaced:
        reason = (f"its class replaces Keras's {', '.join(replaced)}, which works on all "
                  "variables at once; ShardedOptimizer updates each owned variable through "
                  "update_step and would skip that code")
    else:
        return
    raise ValueError(f"ShardedOptimizer cannot shard {name}: {reason}. Use {name} unsharded "
                     "(compile with it directly).")


class _Bookkeeping:
    """Plain holder: Keras's attribute tracker would add listed variables to ``variables``."""

    def __init__(self, slots, model_variables):
        self.slots = slots  # [(keras slot variable, model variable index)], creation order
        self.model_variables = model_variables


@keras.saving.register_keras_serializable(package="tfdp")
class ShardedOptimizer(ConsolidatedState, keras.optimizers.Optimizer):
    """Shards the state of any Keras 3 optimizer across data-parallel replicas (ZeRO-1/2).

    Use it inside ``strategy.scope()`` of a ``tfdp.DataParallelStrategy``::

        optimizer = tfdp.ShardedOptimizer(keras.optimizers.Adam(
            1e-3, global_clipnorm=1.0, gradient_accumulation_steps=4, use_ema=True))
        model.compile(optimizer=optimizer, loss=...)

    Training is equivalent to the wrapped optimizer unsharded; with N replicas each keeps
    about 1/N of the optimizer state, gradient accumulators and EMA copies
    (``state_bytes_per_replica()``; ``variables`` lists them on their devices). The module
    docstring states the partition rule, the step, accumulation, EMA and how state is
    consolidated for checkpoints.

    ``iterations`` is the wrapped optimizer's: with gradient accumulation it counts updates,
    as in Keras; the micro-batch count is ``inner_optimizer._iterations``.

    Checkpoints with gradient accumulation: back up on update boundaries only (micro-batch
    count a multiple of k, where every accumulator is zero); tfdp's BackupAndRestore does.
    Why not mid-cycle: ``"local"`` accumulators (and unsharded Keras's) hold each replica's
    own partial sum; Keras saving stores one replica's copy, so a mid-cycle file loses the
    others' micro-batches and means nothing on another replica count. The default
    ``"sharded"`` accumulators hold globally reduced sums and are saved consolidated, so even
    a mid-cycle file of this mode resumes exactly (tested), but one rule for every optimizer
    is simpler and costs at most k-1 micro-batches. A boundary checkpoint restores on any
    replica count and continues exactly.

    Args:
        optimizer: the Keras 3 optimizer to shard (its learning rate, schedule, clipping,
            weight-decay, ``gradient_accumulation_steps`` and ``use_ema`` settings are used
            as they are). ``loss_scale_factor`` on it is not supported: wrap the
            ShardedOptimizer in ``LossScaleOptimizer`` for loss scaling.
        accumulation: with ``gradient_accumulation_steps``, where gradients are reduced:
            ``"sharded"`` (default, ZeRO-2: reduce-scatter every micro-batch, each replica
            accumulates only what it owns, ~1/N accumulator memory) or ``"local"`` (each
            replica accumulates its full local gradient, one reduce-scatter per update).
        name: defaults to ``"sharded_" + optimizer.name``.

    References:
        - Rajbhandari et al., 2019. ZeRO: Memory Optimizations Toward Training Trillion
          Parameter Models. https://arxiv.org/abs/1910.02054
        - PyTorch ``torch.distributed.optim.ZeroRedundancyOptimizer`` (partition rule).
    """

    # Tells tfdp's Keras hooks not to all-reduce: this optimizer reduce-scatters itself.
    _tfdp_reduces_itself = True

    def __init__(self, optimizer, accumulation="sharded", name=None, **kwargs):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"ShardedOptimizer wraps a keras.optimizers.Optimizer, got "
                            f"{type(optimizer).__name__}.")
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("The optimizer is already a ShardedOptimizer.")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError("Wrap the other way round: "
                            "LossScaleOptimizer(ShardedOptimizer(optimizer)).")
        _check_updates_per_variable(optimizer)
        if getattr(optimizer, "loss_scale_factor", None):
            raise ValueError(
                "ShardedOptimizer does not support loss_scale_factor on the wrapped optimizer "
                f"(loss_scale_factor={optimizer.loss_scale_factor!r}); use "
                "keras.optimizers.LossScaleOptimizer(ShardedOptimizer(optimizer)).")
        if accumulation not in ACCUMULATION_MODES:
            raise ValueError(f"accumulation={accumulation!r} is not one of {ACCUMULATION_MODES}: "
                             "'sharded' (ZeRO-2, ~1/N accumulator memory) or 'local' (full "
                             "local accumulators, one reduce-scatter per update).")
        for attr in ("use_ema", "gradient_accumulation_steps", "loss_scale_factor"):
            if kwargs.get(attr):
                raise ValueError(f"Set {attr} on the wrapped optimizer, not on ShardedOptimizer.")
        super().__init__(learning_rate=0.0, name=name or f"sharded_{optimizer.name}", **kwargs)
        self.inner_optimizer = optimizer
        self.accumulation = accumulation
        self._owners = None
        keras_integration.require("loss_scale_saving")

    # --- the wrapped optimizer's hyper-parameters ----------------------------------------
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self):
        """Optimizer updates (micro-batches // k with gradient accumulation), as in Keras."""
        return self.inner_optimizer.iterations

    # --- partition and state ---------------------------------------------------------------
    def _topology(self):
        """(tfdp strategy or None, replicas in sync, worker rank, local device names)."""
        strategy = _tf_private.optimizer_strategy(self)
        if is_data_parallel(strategy):
            return (strategy, strategy.num_replicas_in_sync, strategy.cluster.rank,
                    list(strategy.extended.worker_devices))
        if strategy.num_replicas_in_sync == 1:
            return None, 1, 0, ["/device:CPU:0"]
        raise ValueError(
            f"ShardedOptimizer needs tfdp.DataParallelStrategy (or no strategy); it was "
            f"created under {type(strategy).__name__}. Create it inside "
            "tfdp.DataParallelStrategy().scope().")

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        strategy, num_replicas, rank, local_devices = self._topology()
        if getattr(strategy, "shard_parameters", False):
            raise ValueError(
                "tfdp.ShardedOptimizer is ZeRO stages 1-2 and the strategy was built with "
                "shard_parameters=True (ZeRO-3), which shards the optimizer state with the "
                "parameters already. Compile with the wrapped optimizer itself: "
                f"optimizer={type(self.inner_optimizer).__name__}(...).")
        inner = self.inner_optimizer
        counter = _tf_private.optimizer_step_counter(inner)
        if num_replicas > 1 and not isinstance(getattr(counter, "value", None),
                                               _tf_private.DistributedValues):
            raise ValueError(
                f"The wrapped optimizer {inner.name} was created outside the strategy's scope; "
                "create it inside strategy.scope(), like the ShardedOptimizer and the model.")
        self._num_replicas = num_replicas
        self._owners = partition([_num_elements(v) for v in var_list], num_replicas)
        # The wrapped optimizer builds its state; each variable's goes to the owner's device
        # (the rule: sharded_state.py's docstring).
        placement = StatePlacement(self, var_list, self._owners, strategy, local_devices,
                                   first_local=rank * len(local_devices))
        placement.build(inner, var_list, local_accumulators=self.accumulation == "local")
        slots, kept = placement.sort(inner)
        # The slots are per-device partitions; they are saved consolidated by this
        # wrapper (save_own_variables), not as the wrapped optimizer's own variables.
        _tf_private.set_optimizer_own_variables(inner, kept)
        self._book = _Bookkeeping(slots, list(var_list))
        self._track_for_checkpoints(slots)

    def _track_for_checkpoints(self, slots):
        """tf.train.Checkpoint reaches every slot through this tf.Module. The wrapped
        optimizer's own lists do not always track theirs (Adafactor's are tracked while empty,
        Muon's while they hold None), and the slots are no longer among its ``_variables``:
        without it, such a round trip restores no moments and reports no error (measured)."""
        self._slot_dependencies = tf.Module(name="sharded_slots")
        self._slot_dependencies.slots = [v for v, _ in slots]

    @property
    def variables(self):
        """Every state variable this process holds: the counters of both optimizers, local
        accumulators if any, and the sharded slots, accumulators and EMA copies, each on its
        owner's device (state owned by another worker's replica is not held here)."""
        held = (list(_tf_private.optimizer_own_variables(self))
                + list(self.inner_optimizer.variables))
        book = getattr(self, "_book", None)
        if book is not None:
            held += [v for v, _ in book.slots if not is_stand_in(v)]
        return held

    def owner_of(self, variable) -> int:
        """The replica that keeps ``variable``'s optimizer state."""
        return self._owners[_tf_private.variable_index(self, variable)]

    def _owned_indices(self, replica_id):
        return [i for i, owner in enumerate(self._owners) if owner == replica_id]

    # --- the step ----------------------------------------------------------------------------
    # Keras's private optimizer hooks overridden here: see _tf_private.OPTIMIZER_HOOKS.
    def _clip_gradients(self, grads):
        return grads  # clipping happens on the reduced, owned gradients (see module doc)

    def _apply_weight_decay(self, variables):
        return  # the wrapped optimizer's decay is applied to owned variables in the step

    def _backend_apply_gradients(self, grads, trainable_variables):
        """One call of ``apply`` (one micro-batch): reduce, accumulate or update, EMA."""
        inner = self.inner_optimizer
        variables = list(trainable_variables)
        indices = [_tf_private.variable_index(self, v) for v in variables]
        by_index = dict(zip(indices, variables))
        grad_of = dict(zip(indices, grads))
        if self._num_replicas > 1:
            dtypes = {v.dtype for v in variables}
            if len(dtypes) > 1:
                raise TypeError("ShardedOptimizer needs all trainable variables in one dtype, "
                                f"got {sorted(str(d) for d in dtypes)}.")
        me = self._replica_id()
        # Tables read by lookups (sparse gradients), known when the step is traced.
        self._looked_up = frozenset(i for i, g in grad_of.items()
                                    if isinstance(g, tf.IndexedSlices))
        steps = inner.gradient_accumulation_steps
        if not steps:
            self._reduce_update_gather(grad_of, indices, by_index, me)
        else:
            self._accumulate_or_update(grad_of, indices, by_index, me, steps)
        if inner.use_ema:
            self._update_moving_averages(me)
        # The wrapped optimizer's counter counts calls (micro-batches), as Keras's does;
        # its ``iterations`` divides by k.
        _tf_private.optimizer_step_counter(inner).assign_add(1)

    def _replica_id(self):
        if self._num_replicas == 1:
            return 0
        return replica_ops.global_replica_id(_tf_private.optimizer_strategy(self))

    def _reduce_update_gather(self, grad_of, indices, by_index, me):
        """Steps 1-4 on these (local) gradients."""
        if self._num_replicas == 1:
            self._update_owned(grad_of, by_index, distributed=False)
            return
        owned_grads = self._reduce_to_owners(grad_of, by_index, me)                  # step 1
        self._update_owned(owned_grads, by_index, distributed=True)                   # 2-3
        self._gather_from_owners(indices, by_index, me)                               # step 4

    def _accumulate_or_update(self, grad_of, indices, by_index, me, steps):
        """Keras's gradient accumulation, with the accumulators sharded or local."""
        inner = self.inner_optimizer
        accumulators = _tf_private.gradient_accumulators(inner)
        # Keras's accumulators are dense (variable + IndexedSlices densifies); so are ours.
        grad_of = {i: dense(g) for i, g in grad_of.items()}
        counter = _tf_private.optimizer_step_counter(inner)
        is_update = tf.equal(tf.math.floormod(counter + 1, steps), 0)

        def mean_with(grads):
            return {i: (g + accumulators[i].value) / steps for i, g in grads.items()}

        def reset(owned):
            for i in owned:
                accumulators[i].assign(tf.zeros_like(accumulators[i].value))

        if self.accumulation == "sharded" and self._num_replicas > 1:
            owned_grads = self._reduce_to_owners(grad_of, by_index, me)  # every micro-batch

            def update():
                self._update_owned(mean_with(owned_grads), by_index, distributed=True)
                reset(owned_grads)
                self._gather_from_owners(indices, by_index, me)

            def accumulate():
                for i, g in owned_grads.items():
                    accumulators[i].assign(accumulators[i].value + g)
        else:  # "local", or one replica (where both modes are the same)
            def update():
                self._reduce_update_gather(mean_with(grad_of), indices, by_index, me)
                reset(grad_of)

            def accumulate():
                for i, g in grad_of.items():
                    accumulators[i].assign(accumulators[i].value + g)  # this replica's copy

        tf.cond(is_update, update, accumulate)

    def _update_moving_averages(self, me):
        """Keras's EMA update, by each owner for its variables; then the periodic overwrite."""
        inner = self.inner_optimizer
        averages = _tf_private.moving_averages(inner)
        model_variables = self._book.model_variables
        not_first_step = tf.not_equal(inner.iterations, 0)
        for i in self._owned_indices(me):
            if averages[i] is None:
                continue
            value = tf.convert_to_tensor(model_variables[i])
            momentum = tf.cast(not_first_step, value.dtype) * inner.ema_momentum
            averages[i].assign(momentum * averages[i].value + (1 - momentum) * value)
        if inner.ema_overwrite_frequency:
            overwrite = tf.equal(
                tf.math.floormod(inner.iterations + 1, inner.ema_overwrite_frequency), 0)
            tf.cond(overwrite, lambda: self._copy_averages_to_variables(me), lambda: None)

    def _copy_averages_to_variables(self, me, indices=None):
        averages = _tf_private.moving_averages(self.inner_optimizer)
        variables = self._book.model_variables
        if indices is None:
            indices = list(range(len(variables)))
        indices = [i for i in indices if averages[i] is not None]
        if not indices:
            return
        if self._num_replicas == 1:
            for i in indices:
                variables[i].assign(averages[i].value)
            return
        self._gather_from_owners(indices, {i: variables[i] for i in indices}, me,
                                 sources={i: averages[i] for i in indices})

    def finalize_variable_values(self, var_list):
        """With ``use_ema``: every replica's variables become their moving averages (Keras's
        ``fit`` calls this at the end of training)."""
        if not self.inner_optimizer.use_ema or getattr(self, "_book", None) is None:
            return
        indices = [_tf_private.variable_index(self, v) for v in var_list]
        if self._num_replicas == 1:
            self._copy_averages_to_variables(0, indices)
            return
        strategy = _tf_private.optimizer_strategy(self)

        @tf.function(autograph=False)  # no tensor branches (agreement.py says why)
        def overwrite():
            strategy.run(lambda: self._copy_averages_to_variables(
                replica_ops.global_replica_id(strategy), indices))

        overwrite()

    def _reduce_to_owners(self, grad_of, by_index, me):
        """Step 1: this replica's owned gradients, summed over all replicas."""
        strategy = _tf_private.optimizer_strategy(self)
        sparse = [i for i, g in grad_of.items() if isinstance(g, tf.IndexedSlices)]
        owned = {}
        if sparse:
            # Sparse gradients travel as IndexedSlices, reduced into the rows one device has
            # (sparse_gradients.py), so optimizers with sparse update rules stay exact.
            reduced = sparse_gradients.reduce_indexed_slices([grad_of[i] for i in sparse],
                                                             strategy)
            owned.update((i, g) for i, g in zip(sparse, reduced) if self._owners[i] == me)
        dense = {i: g for i, g in grad_of.items() if i not in sparse}
        owned.update(exchange.reduce_to_owners(dense, by_index, self._owners, me, strategy))
        return owned

    def _gather_from_owners(self, indices, targets, me, sources=None):
        """Step 4: every replica assigns every owner's values to ``targets`` (index ->
        variable). The owners send their ``targets`` (just updated), or ``sources``."""
        exchange.gather_from_owners(
            {i: targets[i] for i in indices}, self._owners, me,
            _tf_private.optimizer_strategy(self),
            None if sources is None else {i: sources[i] for i in indices},
            looked_up=getattr(self, "_looked_up", frozenset()))

    def _update_owned(self, owned_grads, by_index, distributed):
        """Steps 2-3: clip the owned gradients, decay and update the owned variables."""
        inner = self.inner_optimizer
        indices = [i for i in by_index if i in owned_grads]  # the variables' order
        variables = [by_index[i] for i in indices]
        grads = self._clip_owned([owned_grads[i] for i in indices], distributed)
        lr = inner.learning_rate
        if _tf_private.advances_shared_state(inner):
            # Once per update on every replica, owned variables or not (Nadam's u_product).
            _tf_private.advance_shared_state(inner, lr)
        if _tf_private.has_own_weight_decay(inner):
            _tf_private.apply_weight_decay(inner, variables)  # its own rule (LARS/LAMB: none here)
        elif inner.weight_decay is not None:
            # Keras's decoupled decay (AdamW...), on the owned variables only.
            for v in variables:
                if _tf_private.uses_weight_decay(inner, v):
                    wd = tf.cast(inner.weight_decay, v.dtype)
                    v.assign(v - v * wd * tf.cast(lr, v.dtype))
        for g, v in zip(grads, variables):
            inner.update_step(g, v, lr)

    def _clip_owned(self, grads, distributed):
        """Keras's clipping of the owned gradients, as the wrapped optimizer clips on one
        device: per tensor by Keras's own code; ``global_clipnorm`` by Keras's formula with
        the squared norm summed over all replicas. A sparse gradient's norm is that of its
        rows as they are (Keras's ``global_norm``: rows at one index are not summed first),
        and scaling or per-tensor clipping makes it dense, as in Keras."""
        inner = self.inner_optimizer
        clip = inner.global_clipnorm
        if not (clip and clip > 0) or (inner.clipnorm and inner.clipnorm > 0):
            return _tf_private.keras_clip_gradients(inner, grads)  # per tensor, or nothing
        # Keras's global_norm and clip_by_global_norm (keras/src/optimizers/base_optimizer.py)
        # term by term; float32 across replicas (a replica may own no gradient).
        squares = [tf.cast(keras.ops.sum(keras.ops.square(g)), tf.float32) for g in grads]
        squared_norm = keras.ops.sum(keras.ops.stack(squares)) if squares else tf.constant(0.0)
        if distributed:
            squared_norm = collectives.all_reduce(squared_norm)
        use_norm = keras.ops.sqrt(squared_norm)
        scale = clip * keras.ops.minimum(1.0 / use_norm, 1.0 / clip) + (use_norm - use_norm)
        return [g * tf.cast(scale, g.dtype) for g in grads]

    # --- memory --------------------------------------------------------------------------------
    def state_bytes_per_replica(self) -> list[int]:
        """Optimizer-state bytes held on each local replica's device: the bytes of
        ``variables`` (sharded slots, accumulators and EMA copies on their owners' devices,
        local accumulators and the small counters on every device)."""
        if not self.built:
            raise ValueError("The optimizer is not built yet; train a step or call build().")
        return optimizer_state_bytes_per_replica(self, _tf_private.optimizer_strategy(self))

    def get_config(self):
        config = super().get_config()
        config.pop("learning_rate", None)  # the wrapped optimizer's, serialized with it
        config["optimizer"] = keras.optimizers.serialize(self.inner_optimizer)
        config["accumulation"] = self.accumulation
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        spec = config.pop("optimizer")
        inner = keras.optimizers.deserialize(dict(spec), custom_objects=custom_objects)
        if not isinstance(inner, keras.optimizers.Optimizer):
            # keras.optimizers.deserialize's table misses some of Keras's own optimizers (Lamb
            # in Keras 3.15) and then returns the class name; the generic lookup finds them.
            inner = keras.saving.deserialize_keras_object(spec, custom_objects=custom_objects)
        allowed = {"name", "accumulation"}
        return cls(inner, **{k: v for k, v in config.items() if k in allowed})


# ShardedOptimizer's LossScaleOptimizer saving hooks, installed through the one entry
# (keras_integration.require) when a ShardedOptimizer is first built.
keras_integration.add_feature("loss_scale_saving",
                              lambda: install_loss_scale_saving_hooks(ShardedOptimizer))
