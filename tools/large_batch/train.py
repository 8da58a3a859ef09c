"""One trial of the large-batch harness, trained under ``tfdp.DataParallelStrategy``.

A trial is (optimizer, global batch, warmup fraction, learning rate, seed). It builds the MLP
and the optimizer in the strategy's scope, streams the shuffled training set (reshuffled every
epoch, seed = the trial's seed) in global batches split across the replicas, and trains with a
hand-written loop (tfdp's custom-loop recipe, docs/custom_loops.md): each replica's loss is its
examples' summed loss over the global micro-batch, and ``optimizer.apply`` all-reduces the
gradients. A batch larger than ``max_replica_batch`` per replica is split into ``k`` equal
micro-batches with Keras's ``gradient_accumulation_steps=k`` (one update per ``k`` micro-batches,
the same update as the whole batch at once). Between evaluation steps the loop runs inside one
``tf.function`` (a ``tf.range`` loop), so per-step Python overhead does not enter small-batch
trials.

Optimizers (the only difference between SGD and LARS, and between Adam and LAMB, is the
layer-wise trust ratio; no weight decay unless ``weight_decay`` is given):
``sgd`` = ``keras.optimizers.SGD(momentum=0.9)``; ``adam`` = ``keras.optimizers.Adam``;
``lars`` = ``tfdp.optimizers.LARS(momentum=0.9, trust_coefficient)``; ``lamb`` =
``tfdp.optimizers.LAMB``. Every one runs under ``tfdp.schedules.WarmupCosineDecay``.
"""

from __future__ import annotations

import math
import os
import socket
import time

from large_batch import core

OPTIMIZERS = ("sgd", "adam", "lars", "lamb")


def configure(replicas: int, threads: int):
    """Logical CPU replicas (on a host without GPUs) and TensorFlow's thread pools (0 = its
    default). Must run before TensorFlow initialises; returns the strategy."""
    import tensorflow as tf

    import tfdp

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    if not tf.config.list_physical_devices("GPU"):
        tfdp.configure_cpu_replicas(replicas)
    return tfdp.DataParallelStrategy()


def make_optimizer(name: str, schedule, setup: dict, accumulation: int):
    import keras

    import tfdp

    wd = setup["weight_decay"] or None
    common = {"gradient_accumulation_steps": accumulation if accumulation > 1 else None}
    if name == "sgd":
        return keras.optimizers.SGD(schedule, momentum=setup["momentum"], weight_decay=wd, **common)
    if name == "adam":
        return keras.optimizers.Adam(schedule, weight_decay=wd, **common)
    if name == "lars":
        return tfdp.optimizers.LARS(schedule, momentum=setup["momentum"], weight_decay=wd,
                                    trust_coefficient=setup["trust_coefficient"], **common)
    if name == "lamb":
        return tfdp.optimizers.LAMB(schedule, weight_decay=wd, **common)
    raise core.HarnessError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}.")


def make_model(features: int, hidden: list[int], classes: int):
    import keras

    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for width in hidden]
    layers.append(keras.layers.Dense(classes))
    return keras.Sequential(layers)


def accumulation_steps(batch: int, replicas: int, max_replica_batch: int) -> int:
    """Micro-batches per update so that no replica sees more than ``max_replica_batch``
    examples at once (0 = no limit)."""
    if batch % replicas:
        raise core.HarnessError(f"batch {batch} is not divisible by the {replicas} replicas.")
    if not max_replica_batch or batch // replicas <= max_replica_batch:
        return 1
    k = math.ceil(batch / (replicas * max_replica_batch))
    while batch % (k * replicas):
        k += 1
    return k


def per_update_schedule(schedule, accumulation: int):
    """``schedule`` evaluated at the update count when Keras counts micro-batches.

    Keras 3.15 evaluates a ``LearningRateSchedule`` at ``optimizer._iterations``, which counts
    micro-batches under ``gradient_accumulation_steps=k`` (``optimizer.iterations`` counts
    updates): a schedule written in updates would run k times too fast. Evaluating it at
    ``floor(micro_step / k)`` gives every micro-batch of update u the rate of step u.
    """
    import keras
    from keras import ops

    if accumulation <= 1:
        return schedule

    class PerUpdate(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return schedule(ops.floor_divide(step, accumulation))

        def get_config(self):
            return {"schedule": keras.saving.serialize_keras_object(schedule),
                    "accumulation": accumulation}

    return PerUpdate()


_TENSORS: dict = {}


def _tensors(data):
    """The dataset's arrays as tensors, made once per process: a sweep trains hundreds of trials,
    and tensors made per trial stay referenced by TensorFlow (measured: +72 MB per Fashion-MNIST
    trial until the kernel's OOM killer ended a 270-trial sweep at 24 GB)."""
    import tensorflow as tf

    key = id(data)
    if key not in _TENSORS:
        _TENSORS.clear()
        _TENSORS[key] = (data, tuple(tf.constant(a) for a in (data.x_train, data.y_train,
                                                                data.x_val, data.y_val)))
    return _TENSORS[key][1]


class _Trainer:
    """The model, optimizer, input and compiled functions of one trial."""

    def __init__(self, strategy, data, setup, optimizer, batch, lr, warmup_steps, budget, seed,
                 max_replica_batch, threads):
        import keras
        import tensorflow as tf

        import tfdp

        self.accumulation = accumulation_steps(batch, strategy.num_replicas_in_sync,
                                               max_replica_batch)
        micro = batch // self.accumulation
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            self.model = make_model(data.features, setup["hidden"], data.classes)
            schedule = per_update_schedule(tfdp.schedules.WarmupCosineDecay(
                lr, warmup_steps=warmup_steps, total_steps=budget), self.accumulation)
            self.optimizer = make_optimizer(optimizer, schedule, setup, self.accumulation)
            self.optimizer.build(self.model.trainable_variables)
        scale = data.scale
        images, labels, self.x_val, self.y_val = _tensors(data)
        # Shuffled indices, batched, then one gather per batch: much cheaper than slicing,
        # shuffling and batching examples one by one at large batch sizes.
        dataset = (tf.data.Dataset.range(len(data.x_train))
                   .shuffle(len(data.x_train), seed=seed, reshuffle_each_iteration=True)
                   .repeat().batch(micro, drop_remainder=True)
                   .map(lambda i: (tf.cast(tf.gather(images, i), tf.float32) * scale,
                                   tf.gather(labels, i)))
                   .prefetch(1))
        if threads:
            options = tf.data.Options()
            options.threading.private_threadpool_size = threads
            options.threading.max_intra_op_parallelism = 1
            dataset = dataset.with_options(options)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        model, opt = self.model, self.optimizer

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) / micro
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        @tf.function
        def train(micro_steps):
            # Replica 0's share of the last micro-batch's loss (times the replicas: about the
            # mean): reducing the loss across replicas every step would add a collective.
            loss = tf.constant(0.0)
            for _ in tf.range(micro_steps):
                loss = strategy.experimental_local_results(
                    strategy.run(replica_step, args=next(iterator)))[0]
            return loss * strategy.num_replicas_in_sync

        @tf.function
        def correct(x, y):
            logits = model(tf.cast(x, tf.float32) * scale, training=False)
            return tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y),
                                         tf.int32))

        self._train, self._correct = train, correct
        self.n_val = len(data.y_val)

    def train(self, updates: int) -> float:
        """Trains ``updates`` optimizer updates; returns the last micro-batch's loss."""
        import tensorflow as tf

        # A tensor argument: a Python int would trace the loop again for every new count.
        return float(self._train(tf.constant(updates * self.accumulation, tf.int64)))

    def accuracy(self) -> float:
        return int(self._correct(self.x_val, self.y_val)) / self.n_val

    def updates(self) -> int:
        return int(self.optimizer.iterations.numpy())


def run_trial(strategy, data, setup: dict, key: tuple, *, max_replica_batch: int = 0,
              threads: int = 0) -> dict:
    """Trains one trial until it reaches ``setup["target"]``, diverges or spends its budget;
    returns its record (see large_batch/core.py's module docstring)."""
    import keras

    optimizer, batch, warmup, lr_index, seed = key
    lr = core.lattice_lr(setup["ref_lrs"][optimizer], setup["lr_ratio"], lr_index)
    budget = core.budget_steps(batch, len(data.x_train), setup["max_epochs"], setup["max_steps"])
    warmup_steps = round(warmup * budget)
    started, cpu_started = time.time(), time.process_time()
    keras.backend.clear_session()
    trainer = _Trainer(strategy, data, setup, optimizer, batch, lr, warmup_steps, budget, seed,
                       max_replica_batch, threads)
    curve = [[0, trainer.accuracy(), None]]
    if curve[0][1] >= setup["target"]:
        raise core.HarnessError(
            f"the untrained model already has validation accuracy {curve[0][1]:.4f} >= "
            f"--target={setup['target']}: steps to target would be 0. Raise --target.")
    status, done = "budget", 0
    after = max(warmup_steps, budget // 10)
    for step in core.eval_steps(budget, setup["eval_ratio"])[1:]:
        loss = trainer.train(step - done)
        done = trainer.updates()
        curve.append([done, trainer.accuracy(), loss if math.isfinite(loss) else None])
        if curve[-1][1] >= setup["target"]:
            status = "reached"
            break
        if core.diverged(curve, loss, classes=data.classes, after_step=after):
            status = "diverged"
            break
    return {"optimizer": optimizer, "batch": batch, "warmup": warmup, "lr_index": lr_index,
            "seed": seed, "lr": lr, "status": status,
            "steps_to_target": core.steps_to_target(curve, setup["target"]),
            "best_accuracy": max(row[1] for row in curve), "budget_steps": budget,
            "warmup_steps": warmup_steps, "curve": curve, "accumulation": trainer.accumulation,
            "replicas": strategy.num_replicas_in_sync, "examples": done * batch,
            "seconds": round(time.time() - started, 3),
            "cpu_seconds": round(time.process_time() - cpu_started, 3),
            "host": socket.gethostname(), "pid": os.getpid(), "setup": setup,
            "format": core.FORMAT_VERSION}
