"""Train functions that Ray Train's ``TensorflowTrainer`` runs in tests/test_ray.py.

Each runs in a Ray worker process (an actor; Ray calls the function off the process's main
thread), builds ``tfdp.DataParallelStrategy()`` from the TF_CONFIG Ray set, trains the helpers'
MLP with Adam and writes what the test checks into ``config["out"]`` (``<rank>`` is tfdp's rank,
which is Ray's world rank):

* ``cluster-<rank>.json``: Ray's raw TF_CONFIG, tfdp's resolved addresses and notes, Ray's node
  IP, the replicas, and the inputs' ``sharding_info``;
* ``weights-<name>-<rank>.npz`` and ``history-<name>-<rank>.json``: each model's final weights and
  Keras history;
* ``ids-<rank>-<attempt>.json``: the row ids of this worker's Ray Data shard, in order, read in
  one pass before training (the test builds one device's batches from them);
* ``steps-<rank>-<attempt>.txt`` (with backups): every global step this attempt finished.

``config`` keys: out, rows, global_batch, epochs, replicas; for :func:`train_with_backups` also
backup_dir, save_freq, kill_rank, kill_after_step.
"""

import glob
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import keras
import tensorflow as tf

import tfdp
from helpers import classification_data, initial_weights, mlp  # PYTHONPATH


def train_two_sources(config):
    """One worker group, two models: a tf.data source (with RayReport's metrics and
    checkpoint), then this worker's Ray Data shard through tfdp.data.from_ray."""
    import ray.train

    strategy, rank = _strategy(config)
    x, y = classification_data(n=config["rows"])
    from_tf_data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                        config["global_batch"])
    model = _model(strategy)
    report = tfdp.callbacks.RayReport(metrics={"loss": "loss", "acc": "accuracy"})
    history = model.fit(from_tf_data, epochs=config["epochs"], verbose=0, callbacks=[report])
    _write_results(config, "tfdata", rank, model, history)

    shard = ray.train.get_dataset_shard("train")
    _write_ids(config, rank, 1, shard)
    from_ray = tfdp.data.distribute(strategy, tfdp.data.from_ray(shard, "x", "y"),
                                    config["global_batch"])
    # The guard: the same rows as a plain tf.data dataset; "auto" cannot tell that they are
    # this worker's already (distribute reads nothing, so no Ray epoch starts here).
    plain = tfdp.data.distribute(strategy, shard.to_tf("x", "y", batch_size=64).unbatch(),
                                 config["global_batch"])
    model = _model(strategy)
    history = model.fit(from_ray, epochs=config["epochs"], verbose=0)
    _write_results(config, "raydata", rank, model, history)
    # The dataset's row count (what the driver's ds.count() gives): Keras knows the epochs'
    # length, as one device does on a dataset of known length.
    counted = tfdp.data.distribute(
        strategy, tfdp.data.from_ray(shard, "x", "y", dataset_rows=config["rows"]),
        config["global_batch"])
    model = _model(strategy)
    history = model.fit(counted, epochs=config["epochs"], verbose=0)
    _write_results(config, "raydata_counted", rank, model, history)
    _write_cluster(config, strategy, tf_data=from_tf_data.sharding_info,
                   ray_data=from_ray.sharding_info, plain=plain.sharding_info,
                   counted=counted.sharding_info)


def train_with_backups(config):
    """This worker's Ray Data shard with tfdp's BackupAndRestore (an integer save_freq); rank
    kill_rank SIGKILLs itself after global step kill_after_step on its first attempt."""
    import ray.train

    strategy, rank = _strategy(config)
    attempt = len(glob.glob(os.path.join(config["out"], f"start-{rank}-*"))) + 1
    open(os.path.join(config["out"], f"start-{rank}-{attempt}"), "w").close()
    shard = ray.train.get_dataset_shard("train")
    _write_ids(config, rank, attempt, shard)
    train = tfdp.data.distribute(strategy, tfdp.data.from_ray(shard, "x", "y"),
                                 config["global_batch"])
    model = _model(strategy)
    backup = tfdp.callbacks.BackupAndRestore(config["backup_dir"], save_freq=config["save_freq"])
    steps = _StepLog(config, rank, attempt, backup)
    history = model.fit(train, epochs=config["epochs"], verbose=0, callbacks=[backup, steps])
    _write_results(config, "resumed", rank, model, history)


class _StepLog(keras.callbacks.Callback):
    """Records every global step this attempt finishes (BackupAndRestore's count: the step it
    resumed from, plus the steps since); SIGKILLs this worker where the config says."""

    def __init__(self, config, rank, attempt, backup):
        super().__init__()
        self.path = os.path.join(config["out"], f"steps-{rank}-{attempt}.txt")
        self.kill = rank == config["kill_rank"] and attempt == 1
        self.kill_after = config["kill_after_step"]
        self.backup = backup

    def on_train_begin(self, logs=None):  # after BackupAndRestore's: the restore is done
        self.step = self.backup.restored_step or 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        with open(self.path, "a") as f:
            f.write(f"{self.step}\n")
        if self.kill and self.step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


def _strategy(config):
    tfdp.configure_cpu_replicas(config["replicas"])
    strategy = tfdp.DataParallelStrategy()
    return strategy, strategy.cluster.rank


def _model(strategy):
    w0 = initial_weights(mlp)
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _write_ids(config, rank, attempt, shard):
    """One pass over the shard (a Ray epoch of its own, on every worker alike)."""
    ids = [int(i) for batch in shard.iter_batches(batch_format="numpy") for i in batch["id"]]
    _dump(config, f"ids-{rank}-{attempt}.json", ids)


def _write_cluster(config, strategy, **sharding):
    import ray

    cluster = strategy.cluster
    _dump(config, f"cluster-{cluster.rank}.json", {
        "tf_config": json.loads(os.environ["TF_CONFIG"]), "workers": list(cluster.workers),
        "source": cluster.source, "notes": list(cluster.notes),
        "node_ip": ray.util.get_node_ip_address(),
        "replicas": strategy.num_replicas_in_sync, "sharding": sharding})


def _write_results(config, name, rank, model, history):
    np.savez(os.path.join(config["out"], f"weights-{name}-{rank}.npz"), *model.get_weights())
    _dump(config, f"history-{name}-{rank}.json",
          {k: [float(v) for v in vs] for k, vs in history.history.items()})


def _dump(config, name, value):
    with open(os.path.join(config["out"], name), "w") as f:
        json.dump(value, f)
