"""LAMB: layer-wise adaptive moments for batch training (You et al., 2019)."""

from __future__ import annotations

import keras
from keras import ops

from tfdp.optimizers import _layerwise


@keras.saving.register_keras_serializable(package="tfdp")
class LAMB(_layerwise.LayerAdaptationMixin, keras.optimizers.Optimizer):
    """LAMB, as in Algorithm 2 of You et al. (2019).

    For each variable ``w`` with gradient ``g`` at step ``t`` and weight decay ``λ``:

        m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
        m̂ = m / (1−β1^t) ;  v̂ = v / (1−β2^t)         (if bias_correction)
        r = m̂ / (√v̂ + ε) ;  u = r + λ·w               (weight decay before the ratio)
        w ← w − lr · ‖w‖/‖u‖ · u                       (ratio 1 where a norm is 0)

    Unlike ``keras.optimizers.Lamb`` (decoupled decay outside the ratio, no exclusions,
    epsilon 1e-7), this is the paper's form. Variables excluded from layer adaptation use
    ratio 1 (an AdamW-style step with coupled decay).

    Args:
        learning_rate: float, ``LearningRateSchedule`` or callable.
        beta_1: decay of the first moment.
        beta_2: decay of the second moment.
        epsilon: added to ``√v̂``.
        weight_decay: ``λ``; variables excluded with ``exclude_from_weight_decay`` get 0.
        bias_correction: divide the moments by ``1−β^t``.
        trust_ratio_clip: if set, ``ratio = min(ratio, trust_ratio_clip)``.
        always_adapt: adapt every variable not explicitly excluded with
            ``exclude_from_layer_adaptation``, including the ones excluded from weight decay.
        **kwargs: the common Keras optimizer arguments.

    References:
        - You et al., 2019. Large Batch Optimization for Deep Learning: Training BERT in
          76 minutes. https://arxiv.org/abs/1904.00962
    """

    _SLOTS = (("_momentums", "momentum"), ("_velocities", "velocity"))

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 weight_decay=None, bias_correction=True, trust_ratio_clip=None,
                 always_adapt=False, name="lamb", **kwargs):
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, name=name, **kwargs)
        for label, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{label}={beta} must be in [0, 1).")
        self._set_layerwise_options(epsilon, trust_ratio_clip, always_adapt)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.bias_correction = bias_correction

    def update_step(self, gradient, variable, learning_rate):
        m, v = self._slots_for(variable)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        g = ops.cast(_layerwise.dense(gradient), dtype)
        b1 = ops.cast(self.beta_1, dtype)
        b2 = ops.cast(self.beta_2, dtype)

        self.assign(m, b1 * m + (1.0 - b1) * g)
        self.assign(v, b2 * v + (1.0 - b2) * ops.square(g))
        m_hat, v_hat = m, v
        if self.bias_correction:
            t = ops.cast(self.iterations + 1, dtype)
            m_hat = m / (1.0 - ops.power(b1, t))
            v_hat = v / (1.0 - ops.power(b2, t))
        update = m_hat / (ops.sqrt(v_hat) + self.epsilon)
        wd = self._weight_decay_for(variable)
        if wd is not None:
            update = update + wd * variable
        if self._uses_layer_adaptation(variable):
            ratio = _layerwise.trust_ratio(_layerwise.norm(variable, of=variable),
                                           _layerwise.norm(update, of=variable),
                                           clip=self.trust_ratio_clip)
        else:
            ratio = ops.cast(1.0, dtype)
        self.assign_sub(variable, lr * ratio * update)

    def get_config(self):
        config = super().get_config()
        config.update({
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            "bias_correction": self.bias_correction,
            "trust_ratio_clip": self.trust_ratio_clip,
            "always_adapt": self.always_adapt,
        })
        return config
