"""ZeRO stage 3 for ``DataParallelStrategy(shard_parameters=True)``: parameters, gradients and
optimizer state each 1/R per replica, training equal to one device's.

One documented rule per mechanism, one module each:

* **Settings** (``config``). The constructor's ZeRO-3 arguments are resolved once into a frozen
  ``Zero3Config``; ``enabled`` says whether parameters are sharded, ``gathers_per_unit``
  whether units re-gather in the backward pass. A bad argument fails before anything changes.
* **Partition rule** (``partition``, pure). A trainable floating-point variable of at least
  ``shard_min_elements`` elements (default 16,384), created in the strategy's scope, is
  flattened, padded with zeros to a multiple of R (all replicas of all workers) and cut into R
  equal slices: replica g (worker w, local replica i, g = w * local + i) holds elements
  ``[g * S, (g + 1) * S)``, ``S = ceil(n / R)``. A large variable is split, never owned whole.
  Smaller, non-trainable, integer and on-read variables stay mirrored (DeepSpeed's persistence
  threshold); optimizer state made for a sharded parameter is sliced like it, and state of
  another shape (factored moments) is refused. Under keras.distribution's ``ModelParallel``
  its layout map decides which parameters shard.
* **What a read is** (``layout``, ``gradients``). Inside a replica a parameter's read is the
  whole tensor, all-gathered; its gradient is the reduce-scatter of the whole tensor's (a
  sparse one cut into this replica's elements of one device's rows). The optimizer's update
  sees slices. Outside any replica a read is the whole tensor (on several workers gathered
  from every worker), and assigning a whole tensor gives each replica its slice, so
  checkpoints hold whole tensors and restore on any replica count.
* **Creation** (``parameters``). The initial value is evaluated once; with several workers
  every worker slices the chief's.
* **The optimizer** (``optimizer``). Slices are updated one variable at a time, last layers
  first; ``clipnorm``/``global_clipnorm`` add the slices' squared norms over replicas in one
  scalar all-reduce; optimizers that need whole tensors (Keras's Lamb, Muon, Adafactor) are
  refused; Keras's EMA writes slices.
* **Unit rule** (``units``, ``units_xla``). With ``reshard_after_forward=True`` a layer that
  owns sharded weights (or a ``unit_layers`` block), and is pure, gathers its parameters for
  its forward pass, keeps nothing gathered, and gathers them again for its backward pass,
  recomputing itself; its gathers wait for the unit two before it (prefetch of depth one), so
  a replica holds about two units' parameters at a time. Under XLA each unit is a forward
  and a backward program, its collectives outside them; the backward program runs on the
  activations the forward program kept, never on kept parameters
  (``checkpoint_activations=True``: it recomputes instead).
* **Whole-read rule** (``whole_reads``). On several workers a whole read (``model.save``,
  ``get_weights``, a checkpoint) is a collective the chief leads: every worker makes the same
  call, or has finished its script and serves the chief's reads from its exit; a worker gone
  or late is named, within seconds or at ``timeout_seconds``.

docs/zero.md has the measurements. This package's ``__init__`` imports only ``config`` (pure).
"""

from tfdp.strategy.zero3.config import DEFAULT_SHARD_MIN_ELEMENTS, Zero3Config, config_of

__all__ = ["Zero3Config", "DEFAULT_SHARD_MIN_ELEMENTS", "config_of"]
