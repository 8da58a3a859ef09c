"""``horovod.tensorflow.keras.callbacks``'s names (tfdp.horovod.callbacks re-exported)."""

from tfdp.horovod.callbacks import (BroadcastGlobalVariablesCallback,  # noqa: F401
                                    LearningRateScheduleCallback, LearningRateWarmupCallback,
                                    MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
