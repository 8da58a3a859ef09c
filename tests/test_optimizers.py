"""LARS and LAMB against an independent NumPy implementation of the papers' rules."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp.optimizers import LAMB, LARS
from helpers import classification_data, cpu_devices, initial_weights, mixed_precision_mlp, mlp, train

SHAPES = [(3, 4), (5,), (2, 3, 2)]


# --- NumPy references (written from the papers, not from tfdp's code) --------------------

def np_lars(ws, grads_per_step, lr, momentum=0.9, nesterov=False, eta=0.001, eps=0.0, wd=None,
            classic=True, clip=None, adapt=None, decay=None):
    ws = [w.astype(np.float64).copy() for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for grads in grads_per_step:
        for i, (w, g) in enumerate(zip(ws, grads)):
            beta = wd if (wd and (decay is None or decay[i])) else 0.0
            d = g + beta * w
            if adapt is None or adapt[i]:
                wn, gn = np.linalg.norm(w), np.linalg.norm(g)
                den = gn + beta * wn + eps
                ratio = eta * wn / den if (wn > 0 and den > 0) else 1.0
                if clip is not None:
                    ratio = min(ratio, clip)
            else:
                ratio = 1.0
            if classic:
                vs[i] = momentum * vs[i] + lr * ratio * d
                step = momentum * vs[i] + lr * ratio * d if nesterov else vs[i]
            else:
                vs[i] = momentum * vs[i] + ratio * d
                step = lr * (momentum * vs[i] + ratio * d) if nesterov else lr * vs[i]
            ws[i] = w - step
    return ws


def np_lamb(ws, grads_per_step, lr, b1=0.9, b2=0.999, eps=1e-6, wd=None, bias_correction=True,
            clip=None, adapt=None, decay=None):
    ws = [w.astype(np.float64).copy() for w in ws]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (w, g) in enumerate(zip(ws, grads)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            mh, vh = (ms[i] / (1 - b1 ** t), vs[i] / (1 - b2 ** t)) if bias_correction else (ms[i], vs[i])
            u = mh / (np.sqrt(vh) + eps)
            if wd and (decay is None or decay[i]):
                u = u + wd * w
            if adapt is None or adapt[i]:
                wn, un = np.linalg.norm(w), np.linalg.norm(u)
                ratio = wn / un if (wn > 0 and un > 0) else 1.0
                if clip is not None:
                    ratio = min(ratio, clip)
            else:
                ratio = 1.0
            ws[i] = w - lr * ratio * u
    return ws


def run_tf(opt, ws, grads_per_step, names=None, configure=None):
    variables = [keras.Variable(w, name=(names[i] if names else f"v{i}")) for i, w in enumerate(ws)]
    if configure:
        configure(opt, variables)
    for grads in grads_per_step:
        opt.apply([tf.constant(g, tf.float32) for g in grads], variables)
    return [np.asarray(v) for v in variables]


def make_problem(seed=0, steps=4, zero_first=False):
    rng = np.random.default_rng(seed)
    ws = [rng.normal(size=s).astype("float32") for s in SHAPES]
    if zero_first:
        ws[0][:] = 0.0
    grads = [[rng.normal(size=s).astype("float32") for s in SHAPES] for _ in range(steps)]
    return ws, grads


def close(a, b, tol=2e-5):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


LARS_CASES = [
    {}, {"nesterov": True}, {"classic": False}, {"classic": False, "nesterov": True},
    {"wd": 1e-2}, {"eps": 1e-3}, {"eta": 0.02, "clip": 0.5}, {"momentum": 0.0, "wd": 5e-4},
]


@pytest.mark.parametrize("case", LARS_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("zero_first", [False, True])
def test_lars_matches_numpy(case, zero_first):
    ws, grads = make_problem(zero_first=zero_first)
    kw = {"momentum": case.get("momentum", 0.9), "nesterov": case.get("nesterov", False),
          "trust_coefficient": case.get("eta", 0.001), "epsilon": case.get("eps", 0.0),
          "weight_decay": case.get("wd"), "classic_momentum": case.get("classic", True),
          "trust_ratio_clip": case.get("clip")}
    got = run_tf(LARS(learning_rate=2.0, **kw), ws, grads)
    close(got, np_lars(ws, grads, 2.0, **case))


LAMB_CASES = [{}, {"wd": 0.01}, {"bias_correction": False}, {"eps": 1e-3, "clip": 0.8},
              {"b1": 0.5, "b2": 0.9}]


@pytest.mark.parametrize("case", LAMB_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("zero_first", [False, True])
def test_lamb_matches_numpy(case, zero_first):
    ws, grads = make_problem(zero_first=zero_first)
    kw = {"beta_1": case.get("b1", 0.9), "beta_2": case.get("b2", 0.999),
          "epsilon": case.get("eps", 1e-6), "weight_decay": case.get("wd"),
          "bias_correction": case.get("bias_correction", True), "trust_ratio_clip": case.get("clip")}
    got = run_tf(LAMB(learning_rate=0.01, **kw), ws, grads)
    close(got, np_lamb(ws, grads, 0.01, **case))


NAMES = ["kernel", "bias", "other_kernel"]


@pytest.mark.parametrize("cls,ref,kw", [(LARS, np_lars, {"wd": 1e-2}), (LAMB, np_lamb, {"wd": 1e-2})])
def test_weight_decay_exclusion_also_excludes_adaptation_by_default(cls, ref, kw):
    ws, grads = make_problem()
    lr = 2.0 if cls is LARS else 0.01
    got = run_tf(cls(learning_rate=lr, weight_decay=kw["wd"]), ws, grads, names=NAMES,
                 configure=lambda opt, v: opt.exclude_from_weight_decay(var_names=["bias"]))
    mask = [True, False, True]
    close(got, ref(ws, grads, lr, wd=kw["wd"], decay=mask, adapt=mask))


@pytest.mark.parametrize("cls,ref", [(LARS, np_lars), (LAMB, np_lamb)])
def test_explicit_layer_adaptation_exclusion(cls, ref):
    ws, grads = make_problem()
    lr = 2.0 if cls is LARS else 0.01

    def configure(opt, variables):
        opt.exclude_from_weight_decay(var_names=["bias"])
        opt.exclude_from_layer_adaptation(var_list=[variables[2]])

    got = run_tf(cls(learning_rate=lr, weight_decay=0.01), ws, grads, names=NAMES, configure=configure)
    close(got, ref(ws, grads, lr, wd=0.01, decay=[True, False, True], adapt=[True, True, False]))


@pytest.mark.parametrize("cls,ref", [(LARS, np_lars), (LAMB, np_lamb)])
def test_always_adapt_overrides_weight_decay_default(cls, ref):
    ws, grads = make_problem()
    lr = 2.0 if cls is LARS else 0.01
    got = run_tf(cls(learning_rate=lr, weight_decay=0.01, always_adapt=True), ws, grads,
                 names=NAMES, configure=lambda opt, v: opt.exclude_from_weight_decay(var_names=["bias"]))
    close(got, ref(ws, grads, lr, wd=0.01, decay=[True, False, True], adapt=None))


def test_lamb_differs_from_keras_lamb_with_weight_decay():
    """Guard: the paper's coupled decay is not Keras's decoupled one."""
    ws, grads = make_problem()
    ours = run_tf(LAMB(learning_rate=0.01, weight_decay=0.1), ws, grads)
    theirs = run_tf(keras.optimizers.Lamb(learning_rate=0.01, weight_decay=0.1, epsilon=1e-6), ws, grads)
    assert max(np.abs(a - b).max() for a, b in zip(ours, theirs)) > 1e-5


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_sparse_gradients_equal_dense(cls):
    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 3)).astype("float32")
    values = rng.normal(size=(3, 3)).astype("float32")
    indices = np.array([1, 4, 1])  # duplicate index: summed
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([6, 3]))
    dense = tf.convert_to_tensor(sparse)
    a, b = keras.Variable(w), keras.Variable(w)
    o1, o2 = cls(learning_rate=0.1, weight_decay=0.01), cls(learning_rate=0.1, weight_decay=0.01)
    for _ in range(3):
        o1.apply([sparse], [a])
        o2.apply([dense], [b])
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_config_round_trip_covers_every_argument(cls):
    kwargs = dict(learning_rate=0.5, weight_decay=0.02, trust_ratio_clip=2.0, always_adapt=True,
                  global_clipnorm=1.0, gradient_accumulation_steps=2, name="x")
    if cls is LARS:
        kwargs.update(momentum=0.8, nesterov=True, trust_coefficient=0.01, epsilon=1e-5,
                      classic_momentum=False)
    else:
        kwargs.update(beta_1=0.8, beta_2=0.99, epsilon=1e-5, bias_correction=False)
    opt = cls(**kwargs)
    config = opt.get_config()
    for k, v in kwargs.items():
        assert config[k] == v, k
    clone = cls.from_config(config)
    assert clone.get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is cls and restored.get_config() == config


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_model_save_load_round_trips_optimizer_state(cls, tmp_path):
    x, y = classification_data()
    schedule = tfdp.schedules.WarmupPolynomialDecay(0.05, warmup_steps=3, total_steps=20)
    model, _ = train(None, mlp, lambda: cls(learning_rate=schedule, weight_decay=1e-3), x, y, 64,
                     epochs=1)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is cls
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    # Both continue identically.
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    model.fit(ds, epochs=1, verbose=0)
    loaded.fit(ds, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_distributed_training_equals_single_device(cls):
    x, y = classification_data()
    w0 = initial_weights(mlp)
    def opt():
        return cls(learning_rate=0.05 if cls is LAMB else 1.0, weight_decay=1e-3,
                   gradient_accumulation_steps=2)
    ref, _ = train(None, mlp, opt, x, y, 32, weights=w0)
    got, _ = train(tfdp.DataParallelStrategy(devices=cpu_devices(4)), mlp, opt, x, y, 32, weights=w0)
    for a, b in zip(got.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_mixed_precision_loss_scaling(cls):
    x, y = classification_data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        make = mixed_precision_mlp
        s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
        model, hist = train(s, make, lambda: keras.optimizers.LossScaleOptimizer(
            cls(learning_rate=0.05 if cls is LAMB else 2.0)), x, y, 64, epochs=4)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(hist["loss"]).all()
    assert hist["loss"][-1] < hist["loss"][0]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="momentum"):
        LARS(momentum=1.5)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS(trust_coefficient=0)
    with pytest.raises(ValueError, match="beta_1"):
        LAMB(beta_1=1.0)
    with pytest.raises(ValueError, match="trust_ratio_clip"):
        LAMB(trust_ratio_clip=0)


@pytest.mark.slow
def test_fresh_process_load_model_finds_tfdp_classes(tmp_path):
    """A new process that imports keras and tfdp can load a model saved with LAMB/LARS."""
    import subprocess
    import sys
    x, y = classification_data()
    model, _ = train(None, mlp, lambda: tfdp.ShardedOptimizer(LAMB(0.01, weight_decay=1e-3)), x, y, 64,
                     epochs=1)
    model.save(tmp_path / "m.keras")
    code = ("import keras, tfdp; m = keras.models.load_model(%r); "
            "print(type(m.optimizer).__name__, type(m.optimizer.inner_optimizer).__name__)"
            % str(tmp_path / "m.keras"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("ShardedOptimizer LAMB"), out.stderr[-2000:]
