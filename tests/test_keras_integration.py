"""The Keras integration's contract: a strategy built and uninstalled in one process leaves
Keras's (and TensorFlow's) classes and modules as they were; a strategy built afterwards
installs again. And the launcher-protocol side (``tfdp.strategy.lifecycle``) undoes its own
``sys.exit`` wrapper and exit handler.

Each check runs in a fresh subprocess: patches are process-wide, and this test process has
its own strategies (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for name in ("TF_CONFIG", "CLUSTER_SPEC", "SM_HOSTS", "SLURM_STEP_ID", "TFDP_READY_FILE",
                 "TFDP_CPU_REPLICAS"):
        env.pop(name, None)  # one worker, whatever the environment of the test run
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


ROUND_TRIP = r"""
import inspect, json, sys, types
import numpy as np
import tensorflow as tf
import keras
import tfdp
from tfdp.strategy import keras_integration

import keras.src.backend.tensorflow.optimizer as tf_optimizer_module
import keras.src.saving.saving_lib as saving_lib
import keras.src.legacy.saving.legacy_h5_format as legacy_h5_format
import keras.src.utils.file_utils as file_utils
from tensorflow.python.ops import collective_ops, summary_ops_v2
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.saved_model import save as saved_model_save
from tensorflow.python.autograph.core import config as autograph_config
import keras.src.backend.tensorflow.random as keras_tf_random
from keras.src.backend.tensorflow.trainer import TFEpochIterator

tfdp.configure_cpu_replicas(2)

# Every owner tfdp may patch: classes with their MROs, and modules.
classes = [keras.optimizers.Optimizer, tf_optimizer_module.TFOptimizer,
           keras.optimizers.LossScaleOptimizer, keras.Model, tf.train.Checkpoint,
           tf.train.CheckpointManager, TFEpochIterator]
classes += [c for c in vars(keras.callbacks).values() if isinstance(c, type)]
modules = [tf.summary, tf.saved_model, saving_lib, legacy_h5_format, file_utils,
           collective_ops, summary_ops_v2, saved_model_save, keras_tf_random,
           multi_device_iterator_ops, autograph_config]
owners = {}
for cls in classes:
    for klass in inspect.getmro(cls):
        if klass is not object:
            owners[id(klass)] = klass
for module in modules:
    owners[id(module)] = module
# A tf.data class: itself only (its bases are collections.abc's, whose lazily made
# attributes are not tfdp's doing).
owners[id(multi_device_iterator_ops._PerDeviceGenerator)] = (
    multi_device_iterator_ops._PerDeviceGenerator)


def label(owner):
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return f"{owner.__module__}.{owner.__qualname__}"


def snapshot():
    return {id(o): dict(vars(o)) for o in owners.values()}


def differences(before):
    out = []
    for key, old in before.items():
        now = vars(owners[key])
        for name in set(old) | set(now):
            if old.get(name, KeyError) is not now.get(name, KeyError):
                out.append(f"{label(owners[key])}.{name}")
    return sorted(out)


def train(strategy, steps=1):
    x = np.random.default_rng(0).normal(size=(8 * steps, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.1),
                                  keras.layers.Dense(3)])
        optimizer = tfdp.ShardedOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0))
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                        callbacks=[tfdp.callbacks.StragglerMonitor(window=2)])
    return history.history["loss"][-1]


# import tfdp puts Keras's own keras.distribution API on tfdp (tfdp.keras_distribution) and
# nothing else; tfdp.reset() takes it off. The strategy's patches are checked from there.
at_import = keras_integration.installed()
assert at_import and all("distribut" in f"{label(o)}.{n}" or n == "_initialize"
                         for o, n in at_import), at_import
tfdp.reset()
before = snapshot()
assert keras_integration.installed() == [], keras_integration.installed()

strategy = tfdp.DataParallelStrategy()
assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
loss = train(strategy)
# A one-process job installs no multi-worker patches; the entry takes a multi-worker cluster
# (without joining it) so that the chief-writes and consensus patches are installed too.
keras_integration.install(tfdp.ClusterConfig(
    workers=["127.0.0.1:1", "127.0.0.1:2"],
    cluster_spec={"worker": ("127.0.0.1:1", "127.0.0.1:2")}))

installed = keras_integration.installed()
features = {f: [f"{label(o)}.{n}" for o, n in entries]
            for f, entries in keras_integration.installed_features().items()}
unknown = sorted({label(o) for o, _ in installed if id(o) not in owners})
changed = differences(before)
restored = keras_integration.uninstall()
left = differences(before)

second = tfdp.DataParallelStrategy()
reinstalled = [f"{label(o)}.{n}" for o, n in keras_integration.installed()]
loss2 = train(second)
clip_patched = bool(getattr(tf_optimizer_module.TFOptimizer._clip_gradients, "_tfdp_patch", False))
keras_integration.uninstall()

print("RESULT " + json.dumps({
    "installed": [f"{label(o)}.{n}" for o, n in installed], "unknown_owners": unknown,
    "changed": changed, "restored": restored, "left": left,
    "installed_after": [f"{label(o)}.{n}" for o, n in keras_integration.installed()],
    "reinstalled": reinstalled, "clip_patched": clip_patched, "features": features,
    "features_after": keras_integration.installed_features(),
    "loss": float(loss), "loss2": float(loss2), "left_at_end": differences(before)}))
"""


def test_uninstall_leaves_keras_and_tensorflow_as_they_were_and_a_new_strategy_reinstalls():
    r = _result(_run(ROUND_TRIP))
    # Every patch was on an owner the snapshot covered, and the snapshot saw them (guard).
    assert not r["unknown_owners"], r["unknown_owners"]
    assert len(r["installed"]) > 10, r["installed"]
    assert len(r["changed"]) > 10, r["changed"]
    for expected in ("TFOptimizer._clip_gradients", "LossScaleOptimizer.check_finite",
                     "LossScaleOptimizer.save_own_variables",
                     "TensorFlowTrainer.make_train_function", "Checkpoint._write",
                     "CallbackList.on_epoch_end", "summary.create_file_writer",
                     "collective_ops.all_reduce_v2"):
        assert any(name.endswith(expected) for name in r["changed"]), (expected, r["changed"])
    # uninstall restores every one of them, by identity, and forgets them.
    assert r["restored"] == len(r["installed"])
    assert r["left"] == [], r["left"]
    assert r["installed_after"] == []
    # A strategy built afterwards installs again and trains.
    assert r["reinstalled"], "no patch installed by a strategy built after uninstall"
    assert r["clip_patched"]
    assert all(v == v and abs(v) < 1e6 for v in (r["loss"], r["loss2"])), r
    assert r["left_at_end"] == [], r["left_at_end"]
    # Every patch came through one entry, require(feature), and is listed under its feature:
    # the strategy's own, ShardedOptimizer's, StragglerMonitor's, the multi-worker ones.
    features = r["features"]
    for feature, example in (("gradients", "TFOptimizer._clip_gradients"),
                             ("xla", "TensorFlowTrainer.make_train_function"),
                             ("loss_scale_saving", "LossScaleOptimizer.save_own_variables"),
                             ("collective_timing", "collective_ops.all_reduce_v2"),
                             ("consensus", "CallbackList.on_epoch_end"), ("fit_input", "fit"),
                             ("epoch_iterators", "EpochIterator._enumerate_iterator"),
                             ("autograph_leaves_tfdp", "config.CONVERSION_RULES")):
        assert any(name.endswith(example) for name in features.get(feature, ())), (
            feature, features)
    listed = sorted(name for names in features.values() for name in names)
    assert sorted(set(r["installed"]) - set(listed)) == []
    assert r["features_after"] == {}


RELEASE = r"""
import atexit, json, sys, types
import tfdp
# The orderly-exit handler first asks tfdp._tf_private whether a coordination service runs;
# a stand-in answers "no" and says it was asked, so no TensorFlow is needed.
fake = types.ModuleType("tfdp._tf_private")
fake.coordination_service_configured = lambda: (print("HANDLER RAN", flush=True), False)[1]
sys.modules["tfdp._tf_private"] = tfdp._tf_private = fake
from tfdp.cluster import ClusterConfig
from tfdp.strategy import lifecycle

original = sys.exit
calls = []
real_register, real_unregister = atexit.register, atexit.unregister
atexit.register = lambda f, *a, **k: (calls.append(("register", f)), real_register(f, *a, **k))[1]
atexit.unregister = lambda f: (calls.append(("unregister", f)), real_unregister(f))[1]
cluster = ClusterConfig(workers=["127.0.0.1:1", "127.0.0.1:2"],
                        cluster_spec={"worker": ("127.0.0.1:1", "127.0.0.1:2")})
lifecycle.register(cluster, 5.0)
wrapped = sys.exit is not original
if RELEASE:
    lifecycle.release()
handlers = [f for what, f in calls if what == "register"]
print("RESULT " + json.dumps({
    "wrapped": wrapped, "restored": sys.exit is original, "job": lifecycle.job() is None,
    "registered": len(handlers),
    "unregistered": all(("unregister", f) in calls for f in handlers),
    "tensorflow": "tensorflow" in sys.modules}), flush=True)
sys.exit(0)
"""


def test_lifecycle_release_restores_sys_exit_and_the_exit_handler():
    proc = _run("RELEASE = True\n" + textwrap.dedent(RELEASE), timeout=60)
    r = _result(proc)
    assert r["wrapped"], "register did not wrap sys.exit (the check would prove nothing)"
    assert r["registered"] == 1, r
    assert r["restored"] and r["unregistered"] and r["job"], r
    assert not r["tensorflow"], "lifecycle imported TensorFlow"
    assert "HANDLER RAN" not in proc.stdout, "the exit handler still ran after release()"


def test_guard_without_release_the_exit_handler_runs():
    proc = _run("RELEASE = False\n" + textwrap.dedent(RELEASE), timeout=60)
    r = _result(proc)
    assert not r["restored"] and not r["unregistered"], r
    assert "HANDLER RAN" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
