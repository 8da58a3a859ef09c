"""A custom training loop whose step waits for a replica that never comes: under
``strategy.step_deadline()`` it fails with DeadlineExceededError, with tfdp's message, after
the strategy's timeout_seconds (2 s), instead of waiting forever. One process, 2 CPU replicas.
The step is traced and run once before any deadline, so that only a step's own run is timed
(on a loaded CI host the first step, tracing included, once ran past a 0.5 s deadline).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

import tfdp

tfdp.configure_cpu_replicas(2)
strategy = tfdp.DataParallelStrategy(timeout_seconds=2.0)


@tf.function
def step(everyone_comes):
    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        joins = tf.logical_or(everyone_comes, tf.equal(ctx.replica_id_in_sync_group, 0))
        # Replica 1 skips the all-reduce replica 0 waits in, unless everyone comes.
        return tf.cond(joins, lambda: ctx.all_reduce("sum", tf.ones([2])),
                       lambda: tf.zeros([2]))

    return strategy.run(replica_fn)


step(tf.constant(True))  # traced (one trace serves both values) and run, untimed
with strategy.step_deadline("a custom step"):
    step(tf.constant(True))
print("the step that came in time: ok", flush=True)
try:
    with strategy.step_deadline("a custom step"):
        step(tf.constant(False))
except tf.errors.DeadlineExceededError as e:
    print(f"{type(e).__name__}: {e.message}", flush=True)
else:
    raise SystemExit("the step without its second replica finished")
