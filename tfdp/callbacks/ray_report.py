"""``RayReport``: the chief's Keras metrics and checkpoint in Ray Train's ``Result``.

Rule: ``ray.train.report`` is a barrier that every Ray Train worker must reach equally often,
and Ray keeps rank 0's metrics and any worker's checkpoint. So every worker reports at the
same epochs; every worker saves (saving may run collectives; tfdp sends a non-chief's file to a
private temporary place), and only Ray's rank 0, tfdp's chief (Ray's ``TF_CONFIG`` lists the
workers in rank order), hands Ray a checkpoint. tfdp's logs on the chief are already reduced
across workers. A Keras 3 callback: Ray's own ``ReportCheckpointCallback`` derives from
``tf.keras``, which is ``tf_keras`` under the ``TF_USE_LEGACY_KERAS=1`` that Ray's TensorFlow
backend sets. Ray is imported only when ``fit`` starts, so tfdp imports without it.
"""

from __future__ import annotations

import numbers
import os
import shutil
import tempfile

import keras

__all__ = ["RayReport"]

_CHECKPOINT_FILES = {"model": "model.keras", "weights": "model.weights.h5"}
_WHEN = ("epoch_end", "train_end")


class RayReport(keras.callbacks.Callback):
    """Reports the chief's metrics, and a checkpoint of the model, to Ray Train.

    Use it inside the train function of ``ray.train.tensorflow.TensorflowTrainer``; after
    ``trainer.fit()`` the ``Result`` holds the last report's metrics (``result.metrics``),
    every report's (``result.metrics_dataframe``) and the last checkpoint
    (``result.checkpoint``: a directory with ``model.keras``, or ``model.weights.h5``).

    Every worker must run ``fit`` with this callback (Ray's report is a barrier across the
    workers). Ray's checkpoint is for the ``Result`` and for Ray's own checkpoint
    management; a restarted worker resumes from ``tfdp.callbacks.BackupAndRestore``'s backups
    (step-exact), not from it.

    Args:
        metrics: what to report: None for every Keras log entry (``loss``, metrics, ``val_``
            entries, ``learning_rate``); a name or list of names of log entries; or a dict
            ``{name in Ray: name in the Keras logs}``. A name missing from the logs is a
            ``KeyError`` naming the logs there are.
        checkpoint: ``"model"`` (``model.save``: ``model.keras``, reloadable with
            ``keras.models.load_model``), ``"weights"`` (``model.save_weights``:
            ``model.weights.h5``), or None (metrics only).
        report_on: ``"epoch_end"`` (every epoch) or ``"train_end"`` (once, after the last
            epoch, with the last epoch's logs).

    Raises:
        ValueError: an unknown ``checkpoint`` or ``report_on``.
        ImportError: (when ``fit`` starts) Ray Train is not installed.
        RuntimeError: (when ``fit`` starts) not inside a Ray Train function.

    Example:

    ```python
    def train_func(config):
        strategy = tfdp.DataParallelStrategy()
        ...
        model.fit(train, epochs=3, callbacks=[tfdp.callbacks.RayReport(metrics=["loss"])])

    result = TensorflowTrainer(train_func, scaling_config=ScalingConfig(num_workers=2)).fit()
    result.metrics["loss"], result.checkpoint.path
    ```
    """

    def __init__(self, metrics=None, checkpoint="model", report_on="epoch_end"):
        super().__init__()
        if checkpoint is not None and checkpoint not in _CHECKPOINT_FILES:
            raise ValueError(f"checkpoint={checkpoint!r}: use 'model', 'weights' or None.")
        if report_on not in _WHEN:
            raise ValueError(f"report_on={report_on!r}: use one of {_WHEN}.")
        if metrics is not None and not isinstance(metrics, (str, list, tuple, dict)):
            raise ValueError(f"metrics={metrics!r}: use None, a name, a list of names or a "
                             "dict {name in Ray: name in the Keras logs}.")
        self.metrics = metrics
        self.checkpoint = checkpoint
        self.report_on = report_on
        self._train = None
        self._last_logs = None

    def get_config(self):
        return {"metrics": self.metrics, "checkpoint": self.checkpoint,
                "report_on": self.report_on}

    def on_train_begin(self, logs=None):
        self._train = _ray_train()
        self._last_logs = None

    def on_epoch_end(self, epoch, logs=None):
        self._last_logs = dict(logs or {})
        if self.report_on == "epoch_end":
            self._report(self._last_logs)

    def on_train_end(self, logs=None):
        if self.report_on == "train_end" and self._last_logs is not None:
            self._report(self._last_logs)

    def _report(self, logs):
        metrics = self._select(logs)
        if self.checkpoint is None:
            self._train.report(metrics)
            return
        directory = tempfile.mkdtemp(prefix="tfdp-ray-checkpoint-")
        try:
            path = os.path.join(directory, _CHECKPOINT_FILES[self.checkpoint])
            # Every worker saves: saving may need collectives; a non-chief's write lands in
            # its private temporary place (tfdp's chief-writes rule), never in `directory`.
            if self.checkpoint == "model":
                self.model.save(path)
            else:
                self.model.save_weights(path)
            chief = self._train.get_context().get_world_rank() == 0
            checkpoint = self._train.Checkpoint.from_directory(directory) if chief else None
            self._train.report(metrics, checkpoint=checkpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _select(self, logs) -> dict:
        if self.metrics is None:
            chosen = dict(logs)
        else:
            names = ({self.metrics: self.metrics} if isinstance(self.metrics, str) else
                     dict(self.metrics) if isinstance(self.metrics, dict) else
                     {name: name for name in self.metrics})
            missing = [keras_name for keras_name in names.values() if keras_name not in logs]
            if missing:
                raise KeyError(f"tfdp.callbacks.RayReport: {missing} not in the Keras logs, "
                               f"which hold {sorted(logs)}.")
            chosen = {ray_name: logs[keras_name] for ray_name, keras_name in names.items()}
        return {name: _plain(value) for name, value in chosen.items()}


def _plain(value):
    """A Python number for Ray's metrics (Keras logs hold numpy and tensor scalars)."""
    if isinstance(value, numbers.Number):
        return float(value) if not isinstance(value, (bool, int)) else value
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _ray_train():
    """``ray.train``, checked to run inside a Ray Train function."""
    try:
        import ray.train
    except ImportError as e:
        raise ImportError("tfdp.callbacks.RayReport reports to Ray Train, which is not "
                          "installed: pip install 'ray[train]'.") from e
    try:
        ray.train.get_context()
    except Exception as e:  # Ray's error for "no train session" varies by version
        raise RuntimeError(
            "tfdp.callbacks.RayReport reports to Ray Train and works only inside the train "
            "function of a Ray Train trainer (TensorflowTrainer(train_loop_per_worker=...)); "
            f"here Ray says: {e}") from e
    return ray.train
