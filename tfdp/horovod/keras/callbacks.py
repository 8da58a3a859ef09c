"""``horovod.tensorflow.keras.callbacks``'s names (tfdp.horovod.callbacks re-exported)."""

from tfdp.horovod.callbacks import (BroadcastGlobalVariablesCallback,
                                    LearningRateScheduleCallback, LearningRateWarmupCallback,
                                    MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
