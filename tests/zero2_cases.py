"""The two-worker gradient-accumulation cases (tests/test_zero2.py, and the worker script
tests/workers/mw_zero2_worker.py that both of its workers run): the micro-batch sizes, the
optimizers with and without ShardedOptimizer, and how a model is compiled for them."""

import keras

import tfdp
from helpers import ACCUMULATION_OPTIMIZERS as OPTIMIZERS

K = 4  # micro-batches per update
MICRO_BATCH = 16  # global batch of one micro-batch; 256 examples = 16 micro-batches per epoch


def compile_for(model, optimizer):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _mw_adam_clip(sharded):
    if sharded:  # k micro-batches of MICRO_BATCH ...
        return tfdp.ShardedOptimizer(OPTIMIZERS["adam_global_clipnorm"](gradient_accumulation_steps=K))
    return OPTIMIZERS["adam_global_clipnorm"]()  # ... == one device at K * MICRO_BATCH


def _mw_loss_scale_ema_local(sharded):
    inner = keras.optimizers.AdamW(0.01, weight_decay=0.05, gradient_accumulation_steps=K,
                                   use_ema=True, ema_momentum=0.9)
    if sharded:
        inner = tfdp.ShardedOptimizer(inner, accumulation="local")
    return keras.optimizers.LossScaleOptimizer(inner)


# name: (optimizer factory taking sharded=bool, global batch of the one-device reference)
MW_CASES = {"adam_clip_sharded": _mw_adam_clip, "loss_scale_ema_local": _mw_loss_scale_ema_local}
MW_REFERENCE_BATCH = {"adam_clip_sharded": K * MICRO_BATCH, "loss_scale_ema_local": MICRO_BATCH}
