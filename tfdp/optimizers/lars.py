"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg, 2017)."""

from __future__ import annotations

import keras
from keras import ops

from tfdp.optimizers import _layerwise


@keras.saving.register_keras_serializable(package="tfdp")
class LARS(_layerwise.LayerAdaptationMixin, keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling, as in Algorithm 1 of You et al. (2017).

    For each variable ``w`` with gradient ``g``, weight decay ``β`` and momentum ``m``:

        d = g + β·w                                   (weight decay before the ratio)
        λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε)                  (1 if ‖w‖ or the denominator is 0)
        classic:  v ← m·v + lr·λ·d ;  w ← w − v        (lr inside the momentum buffer)
        otherwise: v ← m·v + λ·d ;    w ← w − lr·v
        nesterov: the step uses m·v + lr·λ·d (classic) or lr·(m·v + λ·d).

    Variables excluded from layer adaptation use λ = 1.

    Args:
        learning_rate: float, ``LearningRateSchedule`` or callable. Defaults to 1.0
            (LARS learning rates are large: the trust ratio scales steps down).
        momentum: momentum ``m``.
        nesterov: Nesterov momentum.
        trust_coefficient: ``η`` (the paper's trust coefficient, "eeta").
        epsilon: ``ε`` added to the ratio's denominator.
        weight_decay: ``β``; variables excluded with ``exclude_from_weight_decay`` get 0.
        classic_momentum: keep the learning rate inside the momentum buffer (the paper's
            form, better when the learning rate changes quickly, e.g. during warmup).
        trust_ratio_clip: if set, ``λ = min(λ, trust_ratio_clip)`` (LARC-style clipping).
        always_adapt: adapt every variable not explicitly excluded with
            ``exclude_from_layer_adaptation``, including the ones excluded from weight decay.
        **kwargs: the common Keras optimizer arguments (``clipnorm``, ``global_clipnorm``,
            ``use_ema``, ``loss_scale_factor``, ``gradient_accumulation_steps``, ``name``...).

    References:
        - You, Gitman & Ginsburg, 2017. Large Batch Training of Convolutional Networks.
          https://arxiv.org/abs/1708.03888
        - Goyal et al., 2017. Accurate, Large Minibatch SGD (learning-rate scaling, warmup).
    """

    _SLOTS = (("_momentums", "momentum"),)

    def __init__(self, learning_rate=1.0, momentum=0.9, nesterov=False, trust_coefficient=0.001,
                 epsilon=0.0, weight_decay=None, classic_momentum=True, trust_ratio_clip=None,
                 always_adapt=False, name="lars", **kwargs):
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, name=name, **kwargs)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1].")
        if trust_coefficient <= 0:
            raise ValueError(f"trust_coefficient={trust_coefficient} must be positive.")
        self._set_layerwise_options(epsilon, trust_ratio_clip, always_adapt)
        self.momentum = momentum
        self.nesterov = nesterov
        self.trust_coefficient = trust_coefficient
        self.classic_momentum = classic_momentum

    def update_step(self, gradient, variable, learning_rate):
        (velocity,) = self._slots_for(variable)
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(_layerwise.dense(gradient), variable.dtype)
        m = ops.cast(self.momentum, variable.dtype)

        wd = self._weight_decay_for(variable)
        d = g if wd is None else g + wd * variable
        if self._uses_layer_adaptation(variable):
            w_norm = _layerwise.norm(variable, of=variable)
            denominator = _layerwise.norm(g, of=variable) + self.epsilon
            if wd is not None:
                denominator = denominator + wd * w_norm
            ratio = _layerwise.trust_ratio(self.trust_coefficient * w_norm, denominator,
                                           clip=self.trust_ratio_clip)
        else:
            ratio = ops.cast(1.0, variable.dtype)

        if self.classic_momentum:
            scaled = lr * ratio * d
            self.assign(velocity, m * velocity + scaled)
            step = m * velocity + scaled if self.nesterov else velocity
        else:
            scaled = ratio * d
            self.assign(velocity, m * velocity + scaled)
            step = lr * (m * velocity + scaled if self.nesterov else velocity)
        self.assign_sub(variable, step)

    def get_config(self):
        config = super().get_config()
        config.update({
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "trust_coefficient": self.trust_coefficient,
            "epsilon": self.epsilon,
            "classic_momentum": self.classic_momentum,
            "trust_ratio_clip": self.trust_ratio_clip,
            "always_adapt": self.always_adapt,
        })
        return config
