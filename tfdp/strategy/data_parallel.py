"""DataParallelStrategy: picks devices, cluster and communication.

A real ``tf.distribute.Strategy`` built on TensorFlow's collective runtime (the engine of
MultiWorkerMirroredStrategy), so one class covers one device, many local devices, and
many workers from ``TF_CONFIG``. What tfdp adds on top:

* local replicas are all GPUs, else all logical CPU devices (the stock multi-worker
  strategy uses only CPU:0 on a CPU host);
* gradients are reduced *before* clipping, in buckets, optionally compressed on the wire
  (see collectives.py);
* ``reduce`` accepts nests and scalar per-replica values, which Keras 3 passes and the
  stock multi-worker strategy rejects (keras-team/keras#20585);
* every instance gets its own collective-key range, so several strategies can live in one
  process (the stock strategies reuse keys and the second ``fit`` fails);
* a per-step deadline across workers (``deadline``), so a peer that never joins is an
  error, not a hang;
* XLA works under the strategy (``xla``): ``model.compile(jit_compile=True)``
  compiles each replica's forward/backward and keeps the reduction outside, and
  ``jit_compile="auto"`` resolves as Keras would on one device (on for GPUs);
  ``tf.function(jit_compile=True)`` around ``strategy.run`` itself, which XLA cannot compile
  with several CPU replicas or several local GPUs, is refused at trace time with one clear
  error (``jit_compile_error``) pointing to ``tfdp.compile_gradients``;
* values TensorFlow's collectives cannot sum on the replicas' devices (int32 labels on
  GPUs, bool flags anywhere) are reduced in a dtype they can (``wire.reduce_dtype``);
* replicas that share a physical GPU (logical GPUs, or workers of one host) are detected
  before the first collective: ``"auto"`` then uses ring collectives, ``"nccl"`` is an error
  (``devices.shared_gpu``);
* workers of a multi-worker job leave together, and SIGTERM keeps the meaning the script
  gave it (``lifecycle``: the worker's side of the launcher protocol);
* the datasets it distributes run without tf.data's autotune model unless their options set
  it, so that destroying an epoch's iterator does not wait up to 60 s (``source_pipeline``).

Building one does, in order: resolve and check the arguments (``options.resolve_options``,
pure: a bad argument fails before anything changes), find the cluster and the local devices,
tell the launcher it is joining (``lifecycle``), install the Keras integration
(``keras_integration.install``, idempotent, undone by ``keras_integration.uninstall``), join
through TensorFlow's collective runtime, then take SIGTERM back, tell the launcher it joined
and, with several workers, register the orderly exit.
"""

from __future__ import annotations

import itertools
import logging

import tensorflow as tf

from tfdp import _tf_private, said_once
from tfdp.cluster import ClusterConfig
from tfdp.strategy import (deadline, keras_integration, lifecycle, randomness, riders,
                           source_pipeline)
from tfdp.strategy import devices as devices_lib
from tfdp.strategy.options import (DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS,
                                   check_compression, describe_shared_gpu, jit_compile_error,
                                   resolve_communication, resolve_options)
from tfdp.strategy.wire import reduce_dtype
from tfdp.strategy.zero3 import layout as zero3_layout
from tfdp.strategy.zero3 import optimizer as zero3_optimizer
from tfdp.strategy.zero3 import parameters as zero3_parameters
from tfdp.strategy.zero3 import partition as zero3_partition
from tfdp.strategy.zero3.config import Zero3Config

__all__ = ["DataParallelStrategy"]

log = logging.getLogger("tfdp")

# Collective keys: TensorFlow's own strategies start at 0; each tfdp strategy in a process
# gets its own range. Workers that create strategies in the same order agree on the keys.
_KEY_RANGE = 1_000_000
_key_bases = itertools.count(1)


def _say_shared_gpu_once(requested, shared):
    """Logs once per shared GPU why "auto" picked ring collectives."""
    if shared is None or requested != "auto" or not said_once.first_time("shared GPU", shared):
        return
    log.warning("tfdp: %s; NCCL refuses two ranks on one GPU, so communication='auto' uses "
                "ring collectives.", describe_shared_gpu(shared))


def _resolve_cluster(cluster, cluster_resolver) -> ClusterConfig:
    """The job's ``ClusterConfig`` from ``cluster``, ``cluster_resolver`` or the environment."""
    if cluster is not None and cluster_resolver is not None:
        raise ValueError(
            "cluster= and cluster_resolver= were both given; pass one of them (a resolver is "
            "converted with tfdp.ClusterConfig.from_resolver).")
    if cluster_resolver is not None:
        cluster = ClusterConfig.from_resolver(cluster_resolver)
    elif cluster is None:
        cluster = ClusterConfig.from_env()
    if not isinstance(cluster, ClusterConfig):
        raise TypeError(f"cluster must be a tfdp.ClusterConfig, got {type(cluster).__name__}.")
    log.info("tfdp: %s", cluster.describe())
    return cluster


class _DataParallelExtended(_tf_private.CollectiveAllReduceExtended):
    """The collective engine with tfdp's choice of local devices.

    The private hooks it overrides are listed, and checked at import, in
    ``_tf_private.EXTENDED_HOOKS``.
    """

    def __init__(self, container, cluster_resolver, options, local_device_type,
                 local_device_indices, zero3: Zero3Config):
        self._tfdp_device_type = local_device_type
        # The device type whose collective dtype limits apply (wire.reduce_dtype).
        self._tfdp_reduce_device_type = local_device_type
        self._tfdp_device_indices = list(local_device_indices)
        # ZeRO-3's settings (zero3/config.py), and the one traced function that reads this
        # strategy's sharded variables whole on several workers.
        self._tfdp_zero3 = zero3
        self._tfdp_whole_gather = zero3_parameters.WholeGather()
        # With shard_parameters=True: None (the partition rule's size threshold), or a
        # function of the creator's kwargs -> True (shard this parameter) / False (mirror it),
        # set by keras.distribution's ModelParallel (tfdp.keras_distribution: its layout map).
        self._tfdp_shard_rule = None
        # Issue 40: a second strategy in a process (or Horovod's engine, built after the
        # context started) must not re-apply the server definition: TensorFlow would replace
        # the process's collective resolver, losing a peer's group registration that arrived
        # first, and both workers would wait forever in the first variable's broadcast.
        _tf_private.reuse_running_collective_server(self, cluster_resolver)
        self._tfdp_variables_created = 0  # the first one's broadcast gets a longer deadline
        super().__init__(container, cluster_resolver=cluster_resolver,
                         communication_options=options)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices = tuple(f"{worker_device}/device:{self._tfdp_device_type}:{i}"
                        for i in self._tfdp_device_indices)
        return devices, self._tfdp_device_type

    def _use_merge_call(self):
        # Every replica launches its own collectives (collective-v2 ops ordered by
        # per-device tokens) instead of funnelling through merge_call. TensorFlow does this
        # only for XLA on GPUs; tfdp needs it everywhere because Keras reduces gradients
        # inside a tf.cond when gradient_accumulation_steps is set, and merge_call cannot
        # run inside control flow.
        return False

    def _create_variable(self, next_creator, **kwargs):
        # ONLY_FIRST_REPLICA makes every replica-context update a merge_call, even in a
        # merge-call-free strategy, which fails inside tf.cond (LossScaleOptimizer applies
        # the inner optimizer, and its iteration counter, inside one). Such variables (the
        # optimizer's iteration counter) are computed identically on every replica, so a
        # local update per replica keeps them identical, as Keras's own weights are.
        if (kwargs.get("aggregation") == tf.VariableAggregation.ONLY_FIRST_REPLICA
                and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ):
            kwargs["aggregation"] = tf.VariableAggregation.NONE
        if self._tfdp_zero3.enabled:
            # zero3.parameters.create decides (the partition rule) and evaluates the initial
            # value once; a variable it does not shard is mirrored from that value.
            layout_shards = None
            if self._tfdp_shard_rule is not None and kwargs.get("colocate_with") is None:
                # A parameter (optimizer state, colocated, follows its parameter): the
                # layout map decides.
                layout_shards = bool(self._tfdp_shard_rule(kwargs))
            min_elements = zero3_partition.size_threshold(self._tfdp_zero3.shard_min_elements,
                                                          layout_shards)
            sharded = (None if min_elements is None else zero3_parameters.create(
                self, next_creator, min_elements, kwargs, self._tfdp_whole_gather))
            if sharded is not None:
                return sharded
        # Issue 40: on several workers creating a variable is a collective outside any step
        # (the chief broadcasts its initial value); a worker that never comes must be an
        # error naming it within timeout_seconds, not a hang (deadline.variable_broadcast).
        first = self._tfdp_variables_created == 0
        self._tfdp_variables_created += 1
        with deadline.variable_broadcast(self._container_strategy(), kwargs.get("name"), first):
            return super()._create_variable(next_creator, **kwargs)

    def _replica_ctx_update(self, var, fn, args, kwargs, group):
        # shard_parameters=True: a replica updates its slices one variable at a time, so the
        # optimizer's temporaries exist for one slice at a time (zero3/optimizer.py).
        if not self._tfdp_zero3.enabled or not zero3_layout.is_sharded(var):
            return super()._replica_ctx_update(var, fn, args, kwargs, group)
        with zero3_optimizer.one_update_at_a_time():
            return super()._replica_ctx_update(var, fn, args, kwargs, group)

    def _reduce_to(self, reduce_op, value, destinations, options):
        # strategy.reduce / extended.reduce_to: dtypes the collectives cannot sum on these
        # devices (int32 labels on GPUs, bool flags) travel in one they can.
        dtype = getattr(value.values[0] if isinstance(value, _tf_private.DistributedValues)
                        else value, "dtype", None)
        wire = reduce_dtype(dtype, self._tfdp_reduce_device_type) if dtype else None
        if wire is None:
            return super()._reduce_to(reduce_op, value, destinations, options)
        value = _tf_private.map_distributed(lambda t: tf.cast(t, wire), value)
        reduced = super()._reduce_to(reduce_op, value, destinations, options)
        return _tf_private.map_distributed(lambda t: tf.cast(t, dtype), reduced)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # ReplicaContext.all_reduce (tfdp's gradient buckets, metrics, custom loops).
        flat = tf.nest.flatten(value)
        wires = [reduce_dtype(t.dtype, self._tfdp_reduce_device_type)
                 if isinstance(t, tf.Tensor) else None for t in flat]
        if not any(wires):
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        cast = [t if w is None else tf.cast(t, w) for t, w in zip(flat, wires)]
        reduced = tf.nest.flatten(super()._replica_ctx_all_reduce(
            reduce_op, tf.nest.pack_sequence_as(value, cast), options))
        return tf.nest.pack_sequence_as(value, [r if w is None else tf.cast(r, t.dtype)
                                                for r, t, w in zip(reduced, flat, wires)])

    def _tfdp_all_to_all(self, value, local_index):
        """All-to-all over every replica, with keys from this strategy's own launcher."""
        launcher = _tf_private.collective_launchers(self)[local_index]
        return _tf_private.all_to_all(launcher, value, _tf_private.communication_options(self))


class DataParallelStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism over local devices and, through TF_CONFIG, workers.

    Variables created in ``scope()`` are mirrored on every local replica; the gradients of
    ``model.fit`` (and of ``optimizer.apply`` in custom loops) are summed over all
    replicas of all workers, so with Keras's per-replica loss scaling N replicas with
    per-replica batch b train like one device with batch N*b.

    It is a ``tf.distribute.MultiWorkerMirroredStrategy`` (isinstance holds) so Keras
    reduces metrics across workers and treats checkpoints the multi-worker way.

    Args:
        devices: local device names (default: all GPUs, else all logical CPU devices).
        communication: ``"auto"`` (NCCL on GPUs, ring collectives otherwise), ``"nccl"``
            (error without GPUs) or ``"ring"``.
        bucket_bytes: pack gradients into buckets of about this many bytes before
            reducing; 0 = one collective per tensor; None = 25 MiB (a gradient larger than
            that is split into a 1 MiB first bucket, the last layers', and 25 MiB buckets,
            each launched as soon as backprop has produced it; a smaller one is one
            collective).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: dtype of gradients on the wire.
        timeout_seconds: the longest a step may wait for its peers, so that a peer that
            never joins gives an error instead of a hang (tfdp.strategy.deadline: Keras's steps,
            tfdp's agreements, ``step_deadline()`` in custom loops; a dead or frozen peer
            is found within ~10 s by TensorFlow's heartbeats). None = 300 s with several
            workers, no deadline in one process.
        cluster: a ``tfdp.ClusterConfig``; default ``ClusterConfig.from_env()`` (TF_CONFIG,
            Vertex AI's CLUSTER_SPEC, SageMaker's SM_HOSTS, a Slurm step; see tfdp.cluster).
        cluster_resolver: any ``tf.distribute.cluster_resolver.ClusterResolver`` instead of
            ``cluster``, as ``MultiWorkerMirroredStrategy`` takes it.
        random_draws: ``"as_one_device"`` (default): inside ``strategy.run`` (``fit``
            included) a Keras random draw per example (Dropout, noise, augmentation) gives
            each replica the numbers one device draws for its rows of the global batch;
            ``"independent"``: the replica is folded into the seed (cheaper; independent
            draws, not one device's). See tfdp/strategy/randomness.py.
        shard_parameters: ``True``: ZeRO stage 3. Trainable floating-point variables of at
            least ``shard_min_elements`` elements created in ``scope()`` are stored as flat
            1/R slices over all R replicas of all workers, and so is the optimizer state
            made for them; a replica's forward pass all-gathers a parameter and its backward
            pass reduce-scatters the gradient. Training equals one device;
            ``get_weights``/``model.save``/checkpoints see whole tensors. See
            tfdp/strategy/zero3/ and docs/zero.md.
        shard_min_elements: with ``shard_parameters=True``, variables smaller than this stay
            mirrored (biases, norms; default 16,384 elements).
        reshard_after_forward: with ``shard_parameters=True``: ``True`` (default) frees a
            unit's gathered parameters after its forward pass and gathers them again for its
            backward pass (recomputing the unit), so a replica holds about two units'
            parameters at a time; ``False`` keeps them from the forward pass to the backward
            pass (no recomputation, the whole model gathered at the peak). See
            tfdp/strategy/zero3/units.py.
        unit_layers: layer classes (or class names) whose instances gather their parameters
            as one unit, e.g. ``(TransformerBlock,)``; by default every layer owning sharded
            weights is a unit.
        checkpoint_activations: with ``shard_parameters=True`` under XLA: ``False``
            (default) a unit's backward program runs on the activations its forward program
            kept (FSDP's and DeepSpeed's default: no recomputation); ``True`` recomputes each
            unit's forward pass in its backward pass and keeps only its inputs (activation
            checkpointing per unit: less memory for activation-heavy models, one more forward
            pass). Without XLA units always recompute. See tfdp/strategy/zero3/units_xla.py.
    """

    _is_tfdp_strategy = True  # tfdp.strategy.is_data_parallel

    def __init__(self, devices=None, *, communication="auto", bucket_bytes=None,
                 compression=None, timeout_seconds=None, cluster=None, cluster_resolver=None,
                 random_draws="as_one_device", shard_parameters=False,
                 shard_min_elements=None, reshard_after_forward=True, unit_layers=None,
                 checkpoint_activations=False):
        zero3 = Zero3Config(shard_parameters=shard_parameters,
                            shard_min_elements=shard_min_elements,
                            reshard_after_forward=reshard_after_forward, unit_layers=unit_layers,
                            checkpoint_activations=checkpoint_activations)
        cluster = _resolve_cluster(cluster, cluster_resolver)
        options = resolve_options(communication=communication, bucket_bytes=bucket_bytes,
                                  compression=compression, timeout_seconds=timeout_seconds,
                                  random_draws=random_draws,
                                  multi_worker=cluster.is_multi_worker)
        if devices is None and cluster.task_gpus is not None:
            devices = devices_lib.task_gpu_devices(cluster.task_gpus)
        elif devices is None:
            devices = devices_lib.shared_host_gpu_devices(cluster)
        devices_lib.configure_from_env()
        names, device_type = devices_lib.resolve_local_devices(devices)
        indices = [tf.DeviceSpec.from_string(n).device_index for n in names]
        check_compression(options.compression, device_type)
        local_gpus = (devices_lib.local_gpu_placements(cluster.rank, indices)
                      if device_type == "GPU" else [])
        shared = devices_lib.shared_gpu(local_gpus)
        self._tfdp_communication = resolve_communication(communication, device_type, shared)
        _say_shared_gpu_once(communication, shared)
        self._tfdp_cluster = cluster
        self._tfdp_devices = names
        self._tfdp_bucket_bytes = options.bucket_bytes
        self._tfdp_compression = options.compression
        self._tfdp_timeout = options.timeout_seconds
        self._tfdp_random_draws = options.random_draws
        self._tfdp_zero3 = zero3
        self._tfdp_key_base = next(_key_bases) * _KEY_RANGE
        _tf_private.set_collective_key_base(self, self._tfdp_key_base)

        lifecycle.announce_joining(cluster)
        keras_integration.install(cluster)
        # MultiWorkerMirroredStrategy.__init__ would build its own extended object from
        # TF_CONFIG; the base Strategy constructor takes ours.
        _tf_private.StrategyBase.__init__(
            self, _DataParallelExtended(self, _cluster_resolver(cluster),
                                        self._communication_options(), device_type, indices,
                                        zero3))
        if cluster.is_multi_worker:
            lifecycle.take_back_sigterm()
        lifecycle.announce_joined(cluster)
        if local_gpus and cluster.is_multi_worker:
            self._tfdp_check_gpus_across_workers(communication, local_gpus)
        if cluster.is_multi_worker:
            lifecycle.register(cluster, self._tfdp_timeout)
        log.info("tfdp.DataParallelStrategy: %d worker(s) x %d %s replica(s), "
                 "communication=%s, bucket_bytes=%d, compression=%s",
                 cluster.num_workers, len(names), device_type, self._tfdp_communication,
                 self._tfdp_bucket_bytes, self._tfdp_compression)

    def _communication_options(self):
        implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                          if self._tfdp_communication == "nccl"
                          else tf.distribute.experimental.CommunicationImplementation.RING)
        # No per-collective timeout: TensorFlow's starts threads that sleep for the whole
        # timeout per collective (a fast job dies of them); deadline.py enforces it per step.
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=0, timeout_seconds=None, implementation=implementation)

    # --- what users read -------------------------------------------------------------
    @property
    def cluster(self) -> ClusterConfig:
        return self._tfdp_cluster

    @property
    def communication(self) -> str:
        return self._tfdp_communication

    # The resolved arguments (options.StrategyOptions), read-only.
    bucket_bytes = property(lambda self: self._tfdp_bucket_bytes, doc="Gradient bucket bytes.")
    compression = property(lambda self: self._tfdp_compression, doc="Wire dtype, or None.")
    timeout_seconds = property(lambda self: self._tfdp_timeout, doc="The step deadline, or None.")
    shard_parameters = property(lambda self: self._tfdp_zero3.shard_parameters,
                                doc="True: parameters sharded over replicas (ZeRO-3).")
    reshard_after_forward = property(lambda self: self._tfdp_zero3.reshard_after_forward,
                                     doc="ZeRO-3: gather a unit's parameters again in backward.")
    unit_layers = property(lambda self: self._tfdp_zero3.unit_layers,
                           doc="ZeRO-3: layer classes gathered as one unit each.")
    checkpoint_activations = property(
        lambda self: self._tfdp_zero3.checkpoint_activations,
        doc="ZeRO-3 under XLA: units recompute their forward pass instead of keeping "
            "activations.")
    random_draws = property(lambda self: self._tfdp_random_draws,
                            doc="'as_one_device' or 'independent' (strategy/randomness.py).")
    key_base = property(lambda self: self._tfdp_key_base,
                        doc="This strategy's id: the base of its collective-key range, the same "
                            "on every worker (each builds its strategies in one order); tfdp "
                            "names its coordination-service keys with it.")

    @property
    def local_devices(self) -> list:
        return list(self._tfdp_devices)

    def step_deadline(self, what: str = "a custom training step"):
        """``with strategy.step_deadline():`` around one step of a custom loop: if it runs
        longer than ``timeout_seconds``, its collectives are aborted and it fails with
        ``DeadlineExceededError`` instead of waiting forever for a peer that never joins
        (a dead or frozen peer is found by TensorFlow's heartbeats without it). Keras's
        ``fit``/``evaluate`` steps are watched without it. See tfdp/strategy/deadline.py.

        Args:
            what: names the step in the error.
        """
        return deadline.watching(self, what)

    def _tfdp_check_gpus_across_workers(self, requested, local_gpus):
        """Before the first collective: do replicas of different workers share a GPU?"""
        cluster = self._tfdp_cluster
        table = devices_lib.exchange_gpu_placements(
            f"tfdp/gpus/{self._tfdp_key_base}", cluster.rank, cluster.num_workers, local_gpus,
            self._tfdp_timeout or DEFAULT_MULTI_WORKER_TIMEOUT_SECONDS)
        shared = devices_lib.shared_gpu(table)
        chosen = resolve_communication(requested, "GPU", shared)  # every worker: same table
        _say_shared_gpu_once(requested, shared)
        if chosen != self._tfdp_communication:
            # The options object is shared by every collective launcher; none has run yet.
            _tf_private.communication_options(self.extended).implementation = (
                tf.distribute.experimental.CommunicationImplementation.RING)
            self._tfdp_communication = chosen

    def run(self, fn, args=(), kwargs=None, options=None):
        """``tf.distribute.Strategy.run``, with per-replica random draws (``random_draws``),
        refusing XLA compilation it cannot survive.

        Raises:
            ValueError: naming ``jit_compile``, the reason and the fix, when called while
                tracing an XLA-compiled function with several CPU replicas or several
                local GPUs (see ``jit_compile_error``); raised at trace time.
        """
        if _tf_private.in_xla_context(tf.compat.v1.get_default_graph()):
            message = jit_compile_error(self.extended._tfdp_device_type,
                                        self.num_replicas_in_sync, len(self._tfdp_devices))
            if message:
                raise ValueError(message)
        return super().run(randomness.replica_function(self, fn), args=args, kwargs=kwargs,
                           options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        """``tf.distribute.Strategy.experimental_distribute_dataset`` (what Keras's ``fit``
        calls for a ``tf.data.Dataset``), telling the random draws that TensorFlow deals the
        per-replica batches to the workers one by one, so that each replica draws one
        device's numbers for the rows it holds (``randomness.deal_rows``). The dataset runs
        without tf.data's autotune model unless its options set it (``source_pipeline``:
        destroying an autotuned iterator can wait up to 60 s)."""
        distributed = super().experimental_distribute_dataset(
            source_pipeline.without_autotune_model(dataset), options)
        randomness.deal_rows(self, self.cluster.num_workers, unit="batch")
        return distributed

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``tf.distribute.Strategy.distribute_datasets_from_function``; each pipeline
        ``dataset_fn`` returns runs without tf.data's autotune model unless its options set
        it (``source_pipeline``: destroying an autotuned iterator can wait up to 60 s)."""
        def without_autotune_model(input_context):
            return source_pipeline.without_autotune_model(dataset_fn(input_context))

        return super().distribute_datasets_from_function(without_autotune_model, options)

    # --- Keras-3 compatibility -------------------------------------------------------
    def reduce(self, reduce_op, value, axis=None):
        """``tf.distribute.Strategy.reduce`` that also takes nests and scalars.

        Keras 3 passes a whole (x, y) batch in one call and asks for ``axis=0`` on scalar
        metrics; a scalar has no axis 0, and its mean over replicas is the mean of the
        per-replica values, which is what ``axis=None`` computes.
        """
        flat = tf.nest.flatten(value, expand_composites=False)
        if len(flat) != 1 or flat[0] is not value:
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        parts = (self.experimental_local_results(value)
                 if isinstance(value, _tf_private.DistributedValues) else [value])
        if _is_mean(reduce_op) and riders.is_reduced(parts):
            # A multi-worker train step's logs rode in its gradient all-reduce
            # (riders.LogsRider): every replica holds their mean already.
            return parts[0]
        if axis is not None:
            if all(getattr(p, "shape", None) is not None and p.shape.rank == 0 for p in parts):
                axis = None
        if not tf.executing_eagerly():
            return super().reduce(reduce_op, value, axis)
        # Eagerly with several workers: a collective outside any step (deadline.py).
        with deadline.collective_outside_step(self, _EAGER_REDUCE, _EAGER_REDUCE_FIX,
                                              kind="eager-reduce"):
            return super().reduce(reduce_op, value, axis)


_EAGER_REDUCE = ("an eager cross-worker reduction (strategy.reduce, or, in Keras's predict and "
                 "evaluate on arrays, the distributed iterator asking every worker whether it "
                 "has data left)")
_EAGER_REDUCE_FIX = (
    "Call strategy.reduce, model.predict and model.evaluate on every worker the "
    "same number of times (not under `if is_chief`), each worker with the same number of "
    "batches; if a worker legitimately arrives this much later, raise timeout_seconds.")


def _cluster_resolver(cluster: ClusterConfig):
    """TensorFlow's resolver for ``cluster`` (an empty one for a single process)."""
    if not cluster.is_multi_worker:
        return tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster_spec.items()}),
        task_type=cluster.task_type, task_id=cluster.task_index, rpc_layer="grpc")


def _is_mean(reduce_op) -> bool:
    try:
        return tf.distribute.ReduceOp(reduce_op) == tf.distribute.ReduceOp.MEAN
    except ValueError:
        return False
