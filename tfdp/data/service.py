"""Running the input pipeline on a tf.data service.

Rule: ``service="grpc://host:port"`` registers the global pipeline (source, unbatching,
shuffle, parse) with the dispatcher under one dataset id and every trainer reads it as one
shared ``distributed_epoch`` job (``ShardingPolicy.DYNAMIC``): each split goes to one service
worker and each element to one trainer, so every element is seen exactly once per epoch.
Which trainer gets which element is decided at run time, so steps per epoch are unknown and
``set_position`` with a step > 0 raises. The dispatcher must answer within
``connect_timeout_seconds`` (error naming the address), so a wrong address never hangs.
"""

from __future__ import annotations

import random

import tensorflow as tf

from tfdp.data.errors import DataShardingError
from tfdp.data.position import SEED_STRIDE
from tfdp.data.sources import Service


def check_service_reachable(service: Service):
    """Waits at most ``connect_timeout_seconds`` for the dispatcher's gRPC port."""
    import grpc  # TensorFlow's own dependency

    channel = grpc.insecure_channel(service.host_port)
    try:
        grpc.channel_ready_future(channel).result(timeout=service.connect_timeout_seconds)
    except grpc.FutureTimeoutError:
        raise DataShardingError(
            f"no tf.data service dispatcher answered at {service.address!r} within "
            f"{service.connect_timeout_seconds:g} s. Start one there (see the README, 'tf.data "
            "service'), check the address and that this host can reach the port, or drop "
            "service=.") from None
    finally:
        channel.close()


def shared_token(strategy, num_workers) -> int:
    """A random number every worker agrees on: replica 0's (the chief's), by an all-reduce."""
    token = random.SystemRandom().getrandbits(52)
    if num_workers == 1:
        return token

    def contribution():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.where(tf.equal(replica, 0), tf.constant(token, tf.int64), tf.constant(0, tf.int64))

    return int(strategy.reduce("SUM", strategy.run(contribution), axis=None))


def global_stream(plan, shuffle_buffer, seed, reshuffle):
    """The whole epoch's elements in their global order (the tf.data service pipeline)."""
    if plan.kind == "files":
        names = tf.data.Dataset.from_tensor_slices(plan.files)
        if shuffle_buffer:
            names = names.shuffle(len(plan.files), seed=seed, reshuffle_each_iteration=reshuffle)
        ds = plan.source.open(names)
    else:
        ds = plan.source
    if shuffle_buffer:
        ds = ds.shuffle(shuffle_buffer, seed=seed + 1, reshuffle_each_iteration=reshuffle)
    if plan.kind == "files" and plan.source.parse_fn is not None:
        ds = ds.map(plan.source.parse_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds


def service_stream(plan, service: Service, strategy, num_workers, shuffle_buffer, seed):
    """Registers the global pipeline; returns (stream(ctx) reading the shared job, job name)."""
    check_service_reachable(service)
    pipeline = global_stream(plan, shuffle_buffer, seed * SEED_STRIDE, reshuffle=True)
    job_name = service.job_name or f"tfdp-{shared_token(strategy, num_workers):013x}"
    # One dataset id for all trainers: each registers its own (identical) pipeline, and
    # graphs traced in different processes need not fingerprint alike.
    dataset_id = tf.data.experimental.service.register_dataset(
        service.target, pipeline, dataset_id=job_name)
    element_spec = pipeline.element_spec

    def stream(ctx):
        del ctx  # the service assigns elements to trainers
        return tf.data.experimental.service.from_dataset_id(
            "distributed_epoch", service.target, dataset_id, element_spec, job_name=job_name)

    return stream, job_name
