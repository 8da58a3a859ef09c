import math

import numpy as np
import pytest
import keras

import tfdp
from tfdp.optimizers.schedules import WarmupCosineDecay, WarmupPolynomialDecay, steps_for_epochs


def test_scale_learning_rate():
    assert tfdp.scale_learning_rate(0.1, 256, 1024) == pytest.approx(0.4)
    assert tfdp.scale_learning_rate(0.1, 256, 1024, rule="sqrt") == pytest.approx(0.2)
    with pytest.raises(ValueError, match="rule"):
        tfdp.scale_learning_rate(0.1, 256, 1024, rule="cubic")
    with pytest.raises(ValueError, match="positive"):
        tfdp.scale_learning_rate(0.1, 0, 1024)


def test_steps_for_epochs():
    assert steps_for_epochs(5, 1000, 100) == 50
    assert steps_for_epochs(0.5, 1000, 300) == 2


def test_polynomial_warmup_then_decay():
    s = WarmupPolynomialDecay(1.0, warmup_steps=10, total_steps=110, end_learning_rate=0.1, power=2.0)
    values = [float(s(i)) for i in (0, 5, 10, 60, 110, 200)]
    expected = [0.0, 0.5, 1.0, 0.9 * 0.25 + 0.1, 0.1, 0.1]
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7)


def test_cosine_warmup_then_decay():
    s = WarmupCosineDecay(2.0, warmup_steps=4, total_steps=104, alpha=0.1)
    values = [float(s(i)) for i in (0, 2, 4, 54, 104)]
    mid = 2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)) + 0.1)
    np.testing.assert_allclose(values, [0.0, 1.0, 2.0, mid, 0.2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls,kw", [(WarmupPolynomialDecay, {"power": 1.0}),
                                    (WarmupCosineDecay, {"alpha": 0.05})])
def test_schedules_serialize(cls, kw):
    s = cls(0.3, warmup_steps=5, total_steps=50, **kw)
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
    assert type(restored) is cls and restored.get_config() == s.get_config()
    opt = keras.optimizers.SGD(learning_rate=s)
    clone = keras.optimizers.SGD.from_config(opt.get_config())
    assert float(clone.learning_rate) == pytest.approx(float(opt.learning_rate))


def test_total_before_warmup_is_an_error():
    with pytest.raises(ValueError, match="total_steps"):
        WarmupCosineDecay(1.0, warmup_steps=10, total_steps=5)
