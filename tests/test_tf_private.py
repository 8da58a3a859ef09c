"""Pins every TensorFlow/Keras-private symbol tfdp uses (the package tfdp/_tf_private/, one
module per area), so an upgrade that moves one fails here, by name; and pins the package's
own rules: patches are recorded and undone, and each area module imports on its own."""

import inspect

import keras
import numpy as np
import pytest

import tfdp
from data_helpers import PER_DEVICE_ELEMENTS, generators_against_tensorflows
from tfdp import _tf_private


def test_private_symbols_exist_with_expected_shape():
    ext = _tf_private.CollectiveAllReduceExtended
    for method in ("_initialize_local_devices", "_use_merge_call", "_replica_ctx_all_reduce"):
        assert hasattr(ext, method), method
    params = inspect.signature(ext._initialize_local_devices).parameters
    assert list(params)[1:] == ["cluster_resolver", "worker_device"]
    assert hasattr(_tf_private.StrategyBase, "__init__")
    for method in ("_clip_gradients", "_all_reduce_sum_gradients", "_backend_update_step"):
        assert hasattr(_tf_private.TFOptimizer, method), method
    assert hasattr(_tf_private.LossScaleOptimizer, "check_finite")


def test_only_tf_private_imports_private_modules():
    import pathlib
    root = pathlib.Path(tfdp.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if "_tf_private" in path.relative_to(root).parts:
            continue
        text = path.read_text()
        for needle in ("tensorflow.python", "keras.src", "tf.__internal__"):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    assert not offenders, offenders


def test_keras_gradient_hooks_installed():
    tfdp.DataParallelStrategy()
    assert _tf_private.TFOptimizer._clip_gradients.__module__ == "tfdp.strategy.gradient_hooks"


def test_xla_context_detection_pin():
    import tensorflow as tf
    seen = {}

    def probe(name):
        seen[name] = _tf_private.in_xla_context(tf.compat.v1.get_default_graph())
        return tf.constant(0.0)

    probe("eager")
    tf.function(lambda: probe("function"))()
    tf.function(lambda: probe("xla"), jit_compile=True)()
    assert seen == {"eager": False, "function": False, "xla": True}


def test_keras_epoch_iterator_length_can_be_set():
    # Pins EpochIterator._num_batches and that fit's iterator is reachable from its dataset:
    # an epoch cut to 2 of its 4 batches trains 2 steps.
    import tensorflow as tf
    import keras

    ds = tf.data.Dataset.range(8).map(lambda i: (tf.cast([i], tf.float32),) * 2).batch(2)
    found, steps = [], []

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 0:
                found.append(_tf_private.set_keras_epoch_length(ds, 2))

        def on_epoch_end(self, epoch, logs=None):
            found.append(_tf_private.set_keras_epoch_length(ds, _tf_private.keras_epoch_length(ds)))

        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    assert _tf_private.keras_epoch_length(ds) == 4
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(ds, epochs=2, verbose=0, callbacks=[Probe()])
    assert found == [1, 1, 1]
    assert steps == [0, 1, 0, 1, 2, 3]


def test_dataset_flat_types_and_shapes_match_tf_data():
    import tensorflow as tf

    spec = (tf.TensorSpec([None, 3], tf.float32), tf.SparseTensorSpec([None], tf.int64),
            tf.RaggedTensorSpec([None, None], tf.int32))
    types, shapes = _tf_private.dataset_flat_types_and_shapes(spec)
    assert types == [tf.float32, tf.variant, tf.variant]
    assert shapes[0].as_list() == [None, 3] and len(shapes) == 3


# --- private attributes and class patches (issue 17 item 2) --------------------------------

def test_a_missing_private_name_is_one_clear_error():
    import pytest

    class Holder:
        pass

    with pytest.raises(_tf_private.PrivateAPIError, match=r"Holder\._gone \(what it was for\)"):
        _tf_private.get_private(Holder(), "_gone", "what it was for")
    with pytest.raises(_tf_private.PrivateAPIError, match="Keras 3"):
        _tf_private.require_attributes(Holder, ("_gone",), "a hook")
    with pytest.raises(_tf_private.PrivateAPIError, match=r"Holder\.method"):
        _tf_private.patch_attribute(Holder, "method", lambda original: original, "a patch")
    # Guard: the class hooks tfdp overrides exist in the installed versions (checked at import).
    _tf_private.require_attributes(_tf_private.CollectiveAllReduceExtended,
                                   _tf_private.EXTENDED_HOOKS, "hooks")
    _tf_private.require_attributes(_tf_private.TFOptimizer, _tf_private.OPTIMIZER_HOOKS, "hooks")


def test_patch_wraps_once_and_keeps_the_original():
    class Target:
        def method(self):
            return "original"

    calls = []

    def make(original):
        calls.append(original)
        return lambda self: "patched " + original(self)

    first = _tf_private.patch_attribute(Target, "method", make, "test")
    second = _tf_private.patch_attribute(Target, "method", make, "test")
    assert Target().method() == "patched original"
    assert first is second and len(calls) == 1  # a second install is a no-op


def test_keras_optimizer_internals_against_installed_keras():
    import numpy as np
    import keras

    variables = [keras.Variable(np.ones((2, 3), "float32"), name="kernel"),
                 keras.Variable(np.ones(3, "float32"), name="bias")]
    adam = keras.optimizers.AdamW(0.1, weight_decay=0.5, gradient_accumulation_steps=2,
                                  use_ema=True)
    adam.exclude_from_weight_decay(var_names=["bias"])
    adam.build(variables)
    counter = _tf_private.optimizer_step_counter(adam)
    assert int(counter.numpy()) == 0
    assert counter in _tf_private.optimizer_own_variables(adam)
    accumulators = _tf_private.gradient_accumulators(adam)
    assert [tuple(a.shape) for a in accumulators] == [(2, 3), (3,)]
    averages = _tf_private.moving_averages(adam)
    assert [tuple(a.shape) for a in averages] == [(2, 3), (3,)]
    assert [_tf_private.uses_weight_decay(adam, v) for v in variables] == [True, False]
    assert [_tf_private.variable_index(adam, v) for v in variables] == [0, 1]
    assert _tf_private.variable_key(adam, variables[0]) != _tf_private.variable_key(adam, variables[1])
    assert not _tf_private.has_own_weight_decay(adam)
    assert _tf_private.has_own_weight_decay(tfdp.optimizers.LAMB(0.1))
    adam.apply([np.ones((2, 3), "float32"), np.ones(3, "float32")], variables)
    # One micro-batch of two: the raw counter moves, Keras's public count does not.
    assert int(counter.numpy()) == 1 and int(adam.iterations.numpy()) == 0
    np.testing.assert_allclose(accumulators[1].numpy(), np.ones(3))
    before = np.array(variables[0].numpy())
    _tf_private.apply_weight_decay(adam, [variables[0]])
    assert np.all(variables[0].numpy() < before)  # decoupled decay moved the kernel
    own = list(_tf_private.optimizer_own_variables(adam))
    _tf_private.set_optimizer_own_variables(adam, own[:1])
    assert _tf_private.optimizer_own_variables(adam) == own[:1]
    assert _tf_private.optimizer_strategy(adam) is not None  # the default strategy


def test_distribute_internals_against_installed_tensorflow():
    import numpy as np
    import tensorflow as tf

    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    assert _tf_private.extended_num_workers(strategy.extended) == 1
    options = _tf_private.communication_options(strategy.extended)
    assert options.implementation == tf.distribute.experimental.CommunicationImplementation.RING
    with strategy.scope():
        optimizer = tfdp.ShardedOptimizer(__import__("keras").optimizers.SGD(0.1))
    assert _tf_private.optimizer_strategy(optimizer) is strategy
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([ctx.replica_id_in_sync_group], tf.int32))
    cast = _tf_private.map_distributed(lambda t: tf.cast(t, tf.float64), values)
    assert type(cast) is type(values)
    parts = strategy.experimental_local_results(cast)
    assert [p.dtype for p in parts] == [tf.float64] * 2
    assert [p.device for p in parts] == [p.device for p in strategy.experimental_local_results(values)]
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts]), [0.0, 1.0])
    # Each strategy's collective keys start at its own base: a second strategy's all-reduce
    # after the first's does not clash (TensorFlow's default base would).
    other = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    for s in (strategy, other):
        result = tf.function(lambda s=s: s.run(
            lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))))()
        assert [float(r) for r in s.experimental_local_results(result)] == [2.0, 2.0]


def test_keras_class_patches_are_installed_and_wrap_keras():
    import keras

    tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    tfdp.ShardedOptimizer(keras.optimizers.SGD(0.1))
    patched = [(_tf_private.TFOptimizer, "_clip_gradients"),
               (_tf_private.TFOptimizer, "_all_reduce_sum_gradients"),
               (_tf_private.LossScaleOptimizer, "check_finite"),
               (_tf_private.LossScaleOptimizer, "save_own_variables"),
               (_tf_private.LossScaleOptimizer, "load_own_variables")]
    for cls, name in patched:
        method = getattr(cls, name)
        assert getattr(method, "_tfdp_patch", False), name
        assert method.__wrapped__.__module__.startswith("keras."), name


def test_keras_trainer_internals_against_installed_keras():
    import numpy as np
    import tensorflow as tf
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    x, y = np.ones((4, 2), "float32"), np.zeros((4, 1), "float32")
    model.fit(x, y, epochs=1, verbose=0)  # builds the metrics
    assert _tf_private.keras_model_supports_jit(model) is True
    assert _tf_private.keras_call_has_training_arg(model) is True
    y_pred = model(x)
    loss = _tf_private.keras_compute_loss(model, x, y, y_pred, None, training=True)
    np.testing.assert_allclose(float(loss), np.mean(y_pred.numpy() ** 2), rtol=1e-6)
    assert _tf_private.keras_loss_tracker(model) in model.metrics
    assert float(_tf_private.unscale_loss_for_distribution(tf.constant(2.0))) == 2.0  # 1 replica
    traced = []

    def step(data):
        traced.append(data)
        return {"n": tf.shape(data[0])[0]}

    function = _tf_private.keras_make_step_function(model, step)
    logs = function(iter(tf.data.Dataset.from_tensors((x, y))))
    assert int(logs["n"]) == 4 and len(traced) == 1  # Keras wrapped and traced our step


def test_keras_trainer_patches_are_installed_and_wrap_keras():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.trainers.trainer import Trainer

    tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    for cls, name in [(Trainer, "_resolve_auto_jit_compile"),
                      (TensorFlowTrainer, "make_train_function"),
                      (TensorFlowTrainer, "make_test_function")]:
        method = getattr(cls, name)
        assert getattr(method, "_tfdp_patch", False), name
        assert method.__module__ == "tfdp.strategy.xla", name
        assert method.__wrapped__.__module__.startswith("keras."), name


def test_traced_function_names_follow_the_uid_counter_that_align_advances():
    # XLA's persistent cache keys an entry by the function's name __inference_<name>_<uid>
    # (tfdp._tf_private.compile_cache): after align, the next traced function's uid is fixed.
    import tensorflow as tf

    aligned = _tf_private.align_function_names(block=1 << 10)
    assert aligned % (1 << 10) == 0
    concrete = tf.function(lambda x: x + 1).get_concrete_function(tf.TensorSpec([], tf.float32))
    uid = int(concrete.name.decode().rsplit("_", 1)[1])
    assert aligned < uid < aligned + 1 << 10, (aligned, concrete.name)


def test_coordination_service_key_value_calls_exist():
    # Exercised for real by tests/test_xla.py's two-worker run (devices.exchange_gpu_placements).
    context = _tf_private.tf_eager_context.context()
    for name in ("set_config_key_value", "get_config_key_value", "wait_at_barrier"):
        assert callable(getattr(context, name, None)), name


def test_reuse_running_collective_server_pins_what_the_engine_reads():
    # Exercised for real by tests/test_rebuild.py (a strategy rebuilt per round on two workers)
    # and test_horovod.py's "local-late" fit: the engine re-applies the server definition
    # unless _std_server_started, and the running server's definition is the context's
    # _collective_ops_server_def.
    import inspect

    source = inspect.getsource(_tf_private.CollectiveAllReduceExtended._initialize_multi_worker)
    assert 'getattr(self, "_std_server_started", False)' in source
    assert "enable_collective_ops(server_def)" in source
    assert "self._enable_check_health" in source
    context = _tf_private.tf_eager_context.context()
    assert hasattr(context, "_collective_ops_server_def")
    # One process, no cluster: nothing to reuse, the engine is left alone.
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
    engine = type("Engine", (), {})()
    assert _tf_private.reuse_running_collective_server(engine, resolver) is False
    assert not hasattr(engine, "_std_server_started")


def test_abort_collective_ops_exists_with_code_and_message():
    # Exercised for real by tests/test_deadline.py (a custom step past its deadline, in a
    # process of its own: an abort is for good) and test_multiworker.py's blocked worker.
    import inspect

    abort = getattr(_tf_private.tf_eager_context.Context, "abort_collective_ops", None)
    assert callable(abort)
    assert list(inspect.signature(abort).parameters) == ["self", "code", "message"]


def test_one_pass_graph_optimization_sets_the_calls_options_and_puts_them_back():
    # What a function first called inside it is optimised with: one Grappler pass, no TFG;
    # every other option of the caller kept; the caller's options back afterwards, also
    # after an error. A TensorFlow that stops reading these options from the thread's
    # FunctionCallOptions fails the first assertions.
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    context = _tf_private.tf_eager_context.context()

    def options():
        config = config_pb2.ConfigProto()
        config.ParseFromString(context.function_call_options.config_proto_serialized)
        return config

    before = context.function_call_options
    with _tf_private.one_pass_graph_optimization():
        inside = options()
        assert (inside.graph_options.rewrite_options.meta_optimizer_iterations
                == rewriter_config_pb2.RewriterConfig.ONE)
        assert inside.graph_options.rewrite_options.disable_tfg_optimizer
        assert inside.allow_soft_placement == before_config(before).allow_soft_placement
        assert float(tf.function(lambda: tf.constant(2.0) * 3.0)()) == 6.0  # runs under it
    assert context.function_call_options is before
    with pytest.raises(ValueError):
        with _tf_private.one_pass_graph_optimization():
            raise ValueError("inside")
    assert context.function_call_options is before
    # A config change inside recomputes the options from the new config; leaving does not
    # put the stale ones back.
    soft = tf.config.get_soft_device_placement()
    try:
        with _tf_private.one_pass_graph_optimization():
            tf.config.set_soft_device_placement(not soft)
        assert context.function_call_options is not before
        assert before_config(context.function_call_options).allow_soft_placement == (not soft)
    finally:
        tf.config.set_soft_device_placement(soft)


def before_config(options):
    from tensorflow.core.protobuf import config_pb2

    config = config_pb2.ConfigProto()
    config.ParseFromString(options.config_proto_serialized)
    return config


def test_set_keras_initial_epoch_makes_fit_start_there():
    # Pins Trainer._initial_epoch: a callback sets it in on_train_begin (BackupAndRestore's
    # resume) and fit runs only the epochs after it.
    import keras
    import numpy as np

    epochs_run = []

    class Resume(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _tf_private.set_keras_initial_epoch(self.model, 2)

        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.zeros((4, 1), "float32")
    model.fit(x, x, epochs=4, verbose=0, callbacks=[Resume()])
    assert epochs_run == [2, 3]


def test_chief_writes_hooks_sit_where_keras_and_tensorflow_write(tmp_path):
    # Pins patch_keras_file_writers, patch_keras_makedirs, patch_keras_export,
    # patch_tensorflow_file_writers,
    # patch_checkpoint_write, patch_checkpoint_manager_save, patch_keras_callback,
    # checkpoint_manager_state, keras_backup_paths and keras_initial_epoch against the
    # installed TF/Keras: the public calls reach the patched functions (this process is no
    # worker, so they write as usual; tests/test_keras_script.py checks what a worker writes).
    import importlib
    import sys

    import keras
    import tensorflow as tf
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.saving import saving_lib
    from keras.src.utils import file_utils
    from tensorflow.python.ops import summary_ops_v2
    from tensorflow.python.saved_model import save as saved_model_save

    from tfdp.strategy import chief_writes
    from tfdp.strategy import consensus

    chief_writes.install()
    consensus.install()
    patched = [(saving_lib, "save_model"), (saving_lib, "save_weights_only"),
               (legacy_h5_format, "save_model_to_hdf5"), (keras.Model, "export"),
               (file_utils, "makedirs"),
               (summary_ops_v2, "create_file_writer_v2"), (saved_model_save, "save"),
               (tf.summary, "create_file_writer"), (tf.saved_model, "save"),
               (tf.train.Checkpoint, "_write"), (tf.train.CheckpointManager, "save"),
               (keras.callbacks.TensorBoard, "set_model"), (keras.callbacks.CSVLogger,
                                                            "on_train_begin"),
               (keras.callbacks.BackupAndRestore, "on_train_batch_end"),
               (keras.callbacks.BackupAndRestore, "on_train_begin"),
               (keras.callbacks.CallbackList, "on_epoch_end")]
    for owner, name in patched:
        assert getattr(getattr(owner, name), "_tfdp_patch", False), (owner, name)
    # The reason for patching the implementation too: re-executing the API module (what an
    # `import tensorflow.summary` statement can do) binds the patched function.
    importlib.reload(sys.modules[tf.summary.__name__])
    assert getattr(tf.summary.create_file_writer, "_tfdp_patch", False)
    # The public calls go through the patched functions: a wrapper that ran, ran the original.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.save(str(tmp_path / "m.keras"))
    model.save_weights(str(tmp_path / "m.weights.h5"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.keras", "m.weights.h5"]
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path / "c"), 2)
    state = _tf_private.checkpoint_manager_state(manager)
    assert state.directory == str(tmp_path / "c") and state.latest is None
    assert manager.save() == str(tmp_path / "c" / "ckpt-1")
    state = _tf_private.checkpoint_manager_state(manager)
    assert list(state.maybe_delete) == [state.latest] == [str(tmp_path / "c" / "ckpt-1")]
    _tf_private.set_checkpoint_manager_state(manager, state._replace(latest="x"))
    assert manager.latest_checkpoint == "x"
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "b"))
    paths = _tf_private.keras_backup_paths(backup)
    assert all(p.startswith(str(tmp_path / "b")) for p in paths.values()) and len(paths) == 5
    assert _tf_private.keras_initial_epoch(model) is None
    # ModelCheckpoint's "create the directory if it does not exist" on a directory another
    # worker created in between: no error; a file in the way still is one.
    file_utils.makedirs(str(tmp_path / "d"))
    file_utils.makedirs(str(tmp_path / "d"))
    with pytest.raises(FileExistsError):
        file_utils.makedirs(str(tmp_path / "m.keras"))
    # Guard: Keras's own function raises for the existing directory.
    with pytest.raises(FileExistsError):
        file_utils.makedirs.__wrapped__(str(tmp_path / "d"))


def test_collective_ops_patch_times_every_collective_of_a_step():
    # Pins the functions of collective_ops that TensorFlow's collective launchers and tfdp's
    # all-to-all call (patch_collective_ops): traced while a StepTimer listens, an all-reduce,
    # an all-gather and a reduce-scatter (all-to-all) each report one wait per replica.
    import tensorflow as tf
    from helpers import cpu_devices
    from tfdp.resilience import stragglers
    from tfdp.strategy import replica_ops, timing

    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2))

    def replica():
        total = tf.distribute.get_replica_context().all_reduce("sum", tf.constant([1.0]))
        gathered = replica_ops.all_gather(tf.constant([2.0]))
        scattered = replica_ops.reduce_scatter(tf.ones([2, 3]))
        return total, gathered, scattered

    timing.install_collective_timing()
    for name in _tf_private.COLLECTIVE_OP_FUNCTIONS:
        assert getattr(_tf_private.tf_collective_ops, name)._tfdp_patch, name
    before = timing.collectives_executed()
    tf.function(lambda: strategy.run(replica))()  # traced with no timer listening
    assert timing.collectives_executed() == before  # guard: nothing timed then
    timer = stragglers.StepTimer()
    timer.listen()
    try:
        tf.function(lambda: strategy.run(replica))()
    finally:
        timer.stop()
    assert timing.collectives_executed() - before == 3 * 2
    means, _ = timer.window()  # no step closed: nothing averaged, waits were recorded
    assert means == [0.0] * 5 and len(timer._waits) == 6


def test_autograph_user_function_converts_beneath_do_not_convert():
    """Pins AutoGraph's control-status context and tf_convert (tfdp/data's pipeline function
    is unconverted; a user's parse function traced beneath it must still be converted)."""
    import tensorflow as tf

    def parse(x):
        if x > 0:  # a Python if on a tensor: needs AutoGraph
            return x
        return -x

    @tf.autograph.experimental.do_not_convert
    def pipeline(wrap):
        return tf.data.Dataset.from_tensor_slices([-2, 3]).map(wrap(parse))

    assert list(pipeline(_tf_private.autograph_user_function).as_numpy_iterator()) == [2, 3]
    with pytest.raises(Exception, match="AutoGraph|Python bool|tf.Tensor"):  # guard
        pipeline(lambda fn: fn)
    assert _tf_private.autograph_user_function(None) is None


# --- the package by area and its patch registry (issue 31 item 2) ---------------------------

AREAS = ("core", "distribute", "data", "coordination", "keras_trainer", "keras_optimizer",
         "keras_random", "keras_saving", "gradients", "sharded_variable", "profiler",
         "compile_cache", "keras_distribution")


def _python(code: str) -> str:
    """Runs ``code`` in a fresh Python (this interpreter, cwd the repository root); its stdout."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(tfdp.__file__).parent.parent
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture
def own_registry(monkeypatch):
    """An empty patch registry for one test: restore_patches() then touches only what the test
    patched, never the patches tfdp installed for this process's strategies."""
    from tfdp._tf_private import core

    monkeypatch.setattr(core, "_registry", [])
    return core


def test_restore_patches_puts_back_exactly_what_the_owner_held(own_registry):
    import functools
    import types

    core = own_registry

    class Base:
        def inherited(self):
            return "base"

    class Target(Base):
        def method(self):
            return "original"

        @staticmethod
        def static():
            return "static"

    module = types.ModuleType("throwaway")
    module.function = lambda: "function"
    module.alias = module.function
    held = {name: vars(Target)[name] for name in ("method", "static")}
    function = module.function

    def make(original):
        return functools.wraps(original)(lambda *args: "patched")

    for name in ("method", "static", "inherited"):
        core.patch_attribute(Target, name, make, "a test")
    core.patch_attribute(module, "function", make, "a test")
    core.replace_attribute(module, "alias", module.function, "a test")
    assert core.patched() == [(Target, "method"), (Target, "static"), (Target, "inherited"),
                              (module, "function"), (module, "alias")]
    # Guard: the patches are in place (the inherited one on Target itself).
    assert (Target().method(), Target.static(), Target().inherited()) == ("patched",) * 3
    assert "inherited" in vars(Target) and module.alias is module.function is not function
    assert _tf_private.restore_patches is core.restore_patches
    assert core.restore_patches() == 5
    assert vars(Target)["method"] is held["method"] and vars(Target)["static"] is held["static"]
    assert "inherited" not in vars(Target) and Target.inherited is Base.inherited
    assert (Target().method(), Target.static(), Target().inherited()) == (
        "original", "static", "base")
    assert module.function is function and module.alias is function
    assert core.patched() == [] and core.restore_patches() == 0
    # Restored, the attribute can be patched again (it is no tfdp patch any more).
    assert core.patch_attribute(Target, "method", make, "a test") is held["method"]
    assert Target().method() == "patched" and core.restore_patches() == 1


def test_replace_of_a_missing_attribute_is_one_clear_error(own_registry):
    class Holder:
        pass

    with pytest.raises(_tf_private.PrivateAPIError, match=r"Holder\.gone \(a test\)"):
        own_registry.replace_attribute(Holder, "gone", 1, "a test")
    assert own_registry.patched() == []


def test_patch_is_atomic_across_threads(own_registry):
    import threading
    import time

    class Target:
        def method(self):
            return "original"

    made = []
    start = threading.Barrier(8)

    def make(original):
        made.append(original)
        time.sleep(0.01)  # widen the check-then-replace window a lock must close
        return lambda self: "patched"

    def install():
        start.wait()
        own_registry.patch_attribute(Target, "method", make, "a test")

    threads = [threading.Thread(target=install) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and own_registry.patched() == [(Target, "method")]
    assert own_registry.restore_patches() == 1 and Target().method() == "original"


# In a process of its own: restoring TensorFlow and Keras here would take tfdp's hooks from
# every strategy the other tests of this process build.
RESTORE_EVERY_PATCH = """
import functools
import keras
import tensorflow as tf
import tfdp
from tfdp import _tf_private as tp
from keras.src.backend.tensorflow.core import Variable as KerasTFVariable
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, TFEpochIterator
from keras.src.legacy.saving import legacy_h5_format
from keras.src.saving import saving_lib
from keras.src.trainers.epoch_iterator import EpochIterator
from keras.src.trainers.trainer import Trainer
from keras.src.utils import file_utils
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.ops import collective_ops, summary_ops_v2
from tensorflow.python.saved_model import save as saved_model_save

targets = [
    (tp.TFOptimizer, "_clip_gradients"), (tp.TFOptimizer, "_all_reduce_sum_gradients"),
    (tp.TFOptimizer, "apply"),
    (tp.LossScaleOptimizer, "check_finite"), (tp.LossScaleOptimizer, "save_own_variables"),
    (tp.LossScaleOptimizer, "load_own_variables"), (Trainer, "_resolve_auto_jit_compile"),
    (TensorFlowTrainer, "make_train_function"), (TensorFlowTrainer, "make_test_function"),
    *[(collective_ops, name) for name in tp.COLLECTIVE_OP_FUNCTIONS],
    (saving_lib, "save_model"), (saving_lib, "save_weights_only"),
    (legacy_h5_format, "save_model_to_hdf5"), (file_utils, "makedirs"), (keras.Model, "export"),
    (summary_ops_v2, "create_file_writer_v2"), (saved_model_save, "save"),
    (tf.summary, "create_file_writer"), (tf.saved_model, "save"),
    (tf.train.Checkpoint, "_write"), (tf.train.CheckpointManager, "save"),
    (keras.callbacks.CSVLogger, "on_train_begin"), (keras.callbacks.CallbackList, "on_epoch_end"),
    (multi_device_iterator_ops, "_create_device_dataset"),
    (multi_device_iterator_ops._PerDeviceGenerator, "__init__"),
    (EpochIterator, "_enumerate_iterator"), (TFEpochIterator, "_get_iterator"),
    (TensorFlowTrainer, "_maybe_symbolic_build"),
    (tp.keras_backend_distribution_lib(), "list_devices"),
    (tp.keras_distribution_lib(), "set_distribution"),
    (tp.keras_distribution_base(), "distribute_dataset"),
    (KerasTFVariable, "_initialize"),
]

def snapshot():
    return [(getattr(owner, name), name in vars(owner)) for owner, name in targets]

def wrap(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)
    return wrapper

# Importing tfdp patches only keras.distribution (tfdp.keras_distribution); reset undoes it.
assert {n for _, n in tp.patched()} >= {"list_devices", "set_distribution", "_initialize"}
tfdp.reset()
before = snapshot()
assert tp.patched() == []
tfdp.configure_cpu_replicas(2)
tfdp.DataParallelStrategy(["/device:CPU:0", "/device:CPU:1"])  # tfdp's own hooks
assert tp.TFOptimizer._clip_gradients.__module__ == "tfdp.strategy.gradient_hooks"
tp.patch_keras_gradient_reduction(wrap, wrap)
tp.patch_loss_scale_check_finite(wrap)
tp.patch_loss_scale_saving(wrap, wrap)
tp.patch_keras_auto_jit_compile(wrap)
tp.patch_keras_step_functions(wrap, wrap)
tp.patch_keras_optimizer_apply(wrap)
tp.patch_collective_ops(wrap)
tp.patch_keras_file_writers(wrap)
tp.patch_keras_makedirs(wrap)
tp.patch_keras_export(wrap)
tp.patch_tensorflow_file_writers(lambda original, parameter, keep: wrap(original))
tp.patch_checkpoint_write(wrap)
tp.patch_checkpoint_manager_save(wrap)
tp.patch_keras_callback("CSVLogger", "on_train_begin", wrap)
tp.patch_keras_callback("CallbackList", "on_epoch_end", wrap)
tp.patch_device_datasets_without_autotune()
tp.patch_per_device_generators_traced_once()
tp.patch_keras_epoch_iterators(lambda epoch_iterator: True)
tp.patch_keras_symbolic_build(lambda model: True)
tp.patch_keras_backend_distribution({"list_devices": lambda device_type=None: []})
tp.patch_keras_set_distribution(wrap)
tp.patch_keras_distribute_dataset(wrap)
tp.patch_keras_variable_initialize(wrap)
during = snapshot()
# Guard: without a restore every target differs from what TensorFlow and Keras had.
same = [t for t, b, d in zip(targets, before, during) if d[0] is b[0]]
assert not same, same
recorded = tp.patched()
assert {(id(o), n) for o, n in targets} <= {(id(o), n) for o, n in recorded}, recorded
restored = tp.restore_patches()
assert restored == len(recorded), (restored, recorded)
after = snapshot()
wrong = [t for t, b, a in zip(targets, before, after) if a[0] is not b[0] or a[1] != b[1]]
assert not wrong, wrong
assert tp.patched() == [] and tp.restore_patches() == 0
print("restored", restored, "targets", len(targets))
"""


@pytest.mark.slow
def test_restore_patches_leaves_tensorflow_and_keras_as_they_were():
    words = _python(RESTORE_EVERY_PATCH).split()
    restored, targets = int(words[words.index("restored") + 1]), int(words[-1])
    assert targets == 36 and restored >= targets, words


# Each area module imported first, with the package's __init__ not run (a stand-in package
# object holds its path): an area that needed the package, or an area importing it, would
# find nothing there. Then the real package re-exports every public name of every area.
IMPORT_EACH_AREA_FIRST = """
import importlib
import pathlib
import sys
import types

import tfdp

AREAS = {areas!r}
directory = pathlib.Path(tfdp.__file__).parent / "_tf_private"

def forget():
    for name in [n for n in sys.modules if n.startswith("tfdp._tf_private")]:
        del sys.modules[name]

first = {{}}
for area in AREAS:
    forget()
    stand_in = types.ModuleType("tfdp._tf_private")
    stand_in.__path__ = [str(directory)]
    sys.modules["tfdp._tf_private"] = stand_in
    module = importlib.import_module("tfdp._tf_private." + area)
    first[area] = sorted(n for n, v in vars(module).items() if not n.startswith("_")
                         and not isinstance(v, types.ModuleType) and n != "annotations")
    assert vars(stand_in).keys() - {{"__name__", "__doc__", "__package__", "__loader__",
                                     "__spec__", "__path__"}} <= set(AREAS), vars(stand_in)
forget()
package = importlib.import_module("tfdp._tf_private")
for area, names in first.items():
    module = sys.modules["tfdp._tf_private." + area]
    missing = [n for n in names if getattr(package, n, None) is not getattr(module, n)
               or n not in package.__all__]
    assert not missing, (area, missing)
print("ok", len(first))
"""


def test_each_area_module_imports_on_its_own_first():
    assert _python(IMPORT_EACH_AREA_FIRST.format(areas=AREAS)).split() == ["ok", str(len(AREAS))]


def test_area_modules_import_core_and_no_circle():
    """Statically: an area module imports, of tfdp, only ``tfdp._tf_private.<area>`` modules
    (never the package, whose __init__ imports the areas), core no area, and the imports
    between areas have no circle."""
    import ast
    import pathlib

    directory = pathlib.Path(_tf_private.__file__).parent
    assert sorted(p.stem for p in directory.glob("*.py")) == sorted(AREAS + ("__init__",))
    imports = {}
    for area in AREAS:
        found = set()
        for node in ast.walk(ast.parse((directory / f"{area}.py").read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"tfdp.{a.name}" for a in node.names] if isinstance(
                         node, ast.ImportFrom) and node.module == "tfdp"
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name and (name == "tfdp" or name.startswith("tfdp.")):
                    assert name.startswith("tfdp._tf_private."), (area, name)
                    found.add(name.rsplit(".", 1)[1])
        imports[area] = found
    assert imports["core"] == set()
    for area, found in imports.items():
        assert found <= set(AREAS) - {area}, (area, found)

    def reachable(area):
        seen, todo = set(), list(imports[area])
        while todo:
            dep = todo.pop()
            if dep not in seen:
                seen.add(dep)
                todo.extend(imports[dep])
        return seen

    assert not [a for a in AREAS if a in reachable(a)], imports


def test_the_layerwise_optimizers_reach_keras_internals_only_through_tf_private():
    # LARS/LAMB override Keras's private _apply_weight_decay (pinned as LAYERWISE_HOOKS); every
    # other private Keras name they use is a named accessor of _tf_private.
    import pathlib
    import re

    root = pathlib.Path(tfdp.__file__).parent / "optimizers"
    private = set(_tf_private.OPTIMIZER_HOOKS) | {"_iterations", "_variables",
                                                    "_distribution_strategy"}
    for name in ("_layerwise.py", "lamb.py", "lars.py"):
        text = (root / name).read_text()
        assert "keras.src" not in text and "tensorflow.python" not in text, name
        used = {m for m in re.findall(r"\.(_[a-z_]+)\b", text) if m in private}
        assert used <= {"_apply_weight_decay"}, (name, used)
    _tf_private.require_attributes(_tf_private.TFOptimizer, _tf_private.LAYERWISE_HOOKS, "hooks")
    optimizer = tfdp.optimizers.LARS(0.1)
    assert _tf_private.has_own_weight_decay(optimizer)


def test_lookup_ids_reads_tensorflow_gather_gradients():
    """``_tf_private.lookup_ids``: TensorFlow's gather gradient is a Reshape of the lookup's
    ids, and the tape concatenates a table's pieces (casting int32 ids to int64 among
    int64 ones); anything else is not known (None)."""
    import keras
    import numpy as np
    import tensorflow as tf

    table = keras.layers.Embedding(10, 4)
    table.build((None,))
    found = {}

    @tf.function
    def step(tokens):
        with tf.GradientTape() as tape:
            total = (tf.reduce_sum(table(tokens)) + tf.reduce_sum(table(keras.ops.arange(3)))
                     + tf.reduce_sum(table(tf.constant(2, tf.int64))))
        grad = tape.gradient(total, table.trainable_variables)[0]
        found["pieces"] = [ids.shape.as_list() for ids in _tf_private.lookup_ids(grad)]
        made = tf.IndexedSlices(grad.values, tf.range(tf.shape(grad.values)[0]), grad.dense_shape)
        found["made"] = _tf_private.lookup_ids(made)
        return total

    step.get_concrete_function(tf.TensorSpec([None, 5], tf.int32))
    assert sorted(found["pieces"], key=len) == [[], [3], [None, 5]]
    assert found["made"] is None
    assert set(_tf_private.GATHER_GRADIENT_OPS.values()) == {"Reshape", "ConcatV2", "Cast",
                                                             "Identity"}
    adam = keras.optimizers.Adam(1e-3, clipvalue=0.5)
    clipped = _tf_private.keras_clip_gradients(adam, [tf.constant([2.0, -0.1])])
    np.testing.assert_allclose(np.asarray(clipped[0]), [0.5, -0.1])


def test_sharded_variable_pieces_are_where_tfdp_expects_them():
    """ZeRO-3's variable (tfdp/_tf_private/sharded_variable.py): the MirroredVariable methods it
    replaces, the creator it reuses, the replica lookup, and Keras's layer call and scopes."""
    import keras
    from tensorflow.python.distribute import values

    for name in _tf_private.SHARDED_VARIABLE_HOOKS:
        assert hasattr(values.MirroredVariable, name), name
    assert issubclass(_tf_private.ShardedVariable, values.MirroredVariable)
    assert _tf_private.current_replica_id() is None or _tf_private.current_replica_id() == 0
    assert not _tf_private.in_keras_symbolic_scope() and not _tf_private.in_keras_stateless_scope()
    with keras.StatelessScope():
        assert _tf_private.in_keras_stateless_scope()
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert len(_tf_private.own_trainable_variables(layer)) == 2
    assert "__call__" in vars(keras.layers.Layer) or hasattr(keras.layers.Layer, "__call__")


def test_launcher_all_reduce_creates_one_collective_with_the_launchers_token():
    """Pins _tf_private.all_reduce (tfdp's gradient buckets launch through it, issue 43): one
    CollectiveReduceV2 on the launcher's device, fed its ordering token; and the reason tfdp
    does not go through ReplicaContext.all_reduce for them: TensorFlow's collective
    all-reduce reverses the tensors it is given before launching them."""
    import tensorflow as tf
    from tensorflow.python.distribute import cross_device_ops  # the pin reads its source

    assert "dense_values.reverse()" in inspect.getsource(
        cross_device_ops.CollectiveAllReduce._all_reduce)
    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    options = _tf_private.communication_options(strategy.extended)

    def replica_fn():
        index = _tf_private.local_replica_id(tf.distribute.get_replica_context())
        launcher = _tf_private.collective_launchers(strategy.extended)[index]
        return _tf_private.all_reduce(launcher, tf.constant([1.0, 2.0]), options)

    step = tf.function(lambda: strategy.run(replica_fn))
    ops = [op for op in step.get_concrete_function().graph.get_operations()
           if op.type == "CollectiveReduceV2"]
    assert len(ops) == 2 and all(op.get_attr("Nordering_token") == 1 for op in ops)
    for value in strategy.experimental_local_results(step()):
        assert value.numpy().tolist() == [2.0, 4.0]


def test_profiler_trace_reads_as_an_xspace(tmp_path):
    """Pins _tf_private.xspace_proto: a trace from tf.profiler.experimental holds a host
    plane whose events carry the executed ops' names (tools/profile_step.py reads them)."""
    import tensorflow as tf

    f = tf.function(lambda x: tf.matmul(x, x, name="pinned_matmul"))
    f(tf.ones([8, 8]))
    tf.profiler.experimental.start(str(tmp_path))
    f(tf.ones([8, 8]))
    tf.profiler.experimental.stop()
    [path] = tmp_path.glob("plugins/profile/*/*.xplane.pb")
    space = _tf_private.xspace_proto()()
    space.ParseFromString(path.read_bytes())
    host = [p for p in space.planes if p.name.startswith("/host:CPU")]
    assert host
    names = {m.name for p in host for m in p.event_metadata.values()}
    assert any(n.startswith("pinned_matmul") for n in names), sorted(names)[:20]


@pytest.mark.parametrize("steps_per_epoch", [None, 4])
def test_fit_makes_one_distributed_iterator_per_epoch(monkeypatch, steps_per_epoch):
    """Pins _tf_private.patch_keras_epoch_iterators and patch_keras_symbolic_build: under a
    tfdp strategy, ``fit`` over a dataset of known length makes one distributed iterator per
    training epoch and one per validation, and trains as before. Guard: Keras's own methods
    (the patches' originals) make one more after every epoch and every validation when no
    ``steps_per_epoch`` is given (then never used), and one per validation to read a batch
    that builds nothing; with ``steps_per_epoch`` Keras uses the one made after an epoch."""
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer, TFEpochIterator
    from keras.src.trainers.epoch_iterator import EpochIterator
    from tensorflow.python.distribute import input_lib

    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    assert getattr(EpochIterator._enumerate_iterator, "_tfdp_patch", False)
    assert getattr(TFEpochIterator._get_iterator, "_tfdp_patch", False)
    made = []
    iterate = input_lib.DistributedDataset.__iter__
    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__",
                        lambda self: made.append(1) or iterate(self))
    x = np.arange(64, dtype="float32").reshape(32, 2) / 64
    train = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)  # 4 steps
    val = train.take(2)

    def fit():
        made.clear()
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4),
                                      keras.layers.Dropout(0.25), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(train, validation_data=val, epochs=3, steps_per_epoch=steps_per_epoch,
                  verbose=0)
        return len(made), model.get_weights()

    ours, weights = fit()
    monkeypatch.setattr(EpochIterator, "_enumerate_iterator",
                        EpochIterator._enumerate_iterator.__wrapped__)
    monkeypatch.setattr(TFEpochIterator, "_get_iterator", TFEpochIterator._get_iterator.__wrapped__)
    monkeypatch.setattr(TensorFlowTrainer, "_maybe_symbolic_build",
                        TensorFlowTrainer._maybe_symbolic_build.__wrapped__)
    kerass, keras_weights = fit()
    for got, want in zip(weights, keras_weights):
        np.testing.assert_array_equal(got, want)
    # fit's build (the model's compiled loss is not built yet: Keras's own path), then per
    # epoch the training iterator and the validation's; Keras's own methods add one after
    # every epoch and validation (no steps_per_epoch), and the validation's build.
    if steps_per_epoch is None:
        assert (ours, kerass) == (3 + 3, 1 + 2 * 3 + 3 * 3)
    else:  # Keras makes the next epoch's iterator after each epoch, and uses it
        assert (ours, kerass) == (1 + 3 + 3, 1 + 1 + 3 + 3 * 3)


def test_an_unbuilt_model_is_built_from_the_element_spec_with_one_devices_shapes(monkeypatch):
    """Pins _tf_private.patch_keras_symbolic_build's unbuilt case (``PerReplicaSpec``
    unwrapped): under a tfdp strategy a model without an ``Input`` is built from one replica's
    element spec, with no iterator made and no batch averaged over the replicas, and gets the
    input shape Keras gives it on one device (batch dimension None). A padded batch (a
    dimension after the batch unknown) takes Keras's own path and trains. Guard: Keras's own
    method fixes the batch dimension at the first batch's per-replica size."""
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from tensorflow.python.distribute import input_lib

    from tfdp._tf_private import keras_trainer

    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    x = np.arange(64, dtype="float32").reshape(32, 2) / 64
    train = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)
    made = []
    iterate = input_lib.DistributedDataset.__iter__
    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__",
                        lambda self: made.append(1) or iterate(self))

    def input_shape(scope):
        made.clear()
        with scope:
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(train, epochs=1, verbose=0)
        return tuple(model.layers[0].input.shape), len(made), model.get_weights()

    one_device, _, _ = input_shape(tf.distribute.get_strategy().scope())
    ours, ours_made, weights = input_shape(strategy.scope())
    assert ours == one_device == (None, 2)
    assert ours_made == 1  # the epoch's own iterator only
    monkeypatch.setattr(TensorFlowTrainer, "_maybe_symbolic_build",
                        TensorFlowTrainer._maybe_symbolic_build.__wrapped__)
    kerass, kerass_made, keras_weights = input_shape(strategy.scope())
    assert (kerass, kerass_made) == ((4, 2), 2)  # guard: the averaged first batch's shape
    for got, want in zip(weights, keras_weights):
        np.testing.assert_array_equal(got, want)
    monkeypatch.undo()

    words = tf.data.Dataset.range(12).map(lambda i: (tf.range(i % 5 + 1), i % 2))
    padded = words.padded_batch(4, padded_shapes=([None], []))
    dist = strategy.experimental_distribute_dataset(padded)
    assert keras_trainer._per_replica_batch_spec(
        type("EpochIterator", (), {"_distributed_dataset": dist})()) is None
    with strategy.scope():
        model = keras.Sequential([keras.layers.Embedding(8, 4),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    history = model.fit(padded, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_per_replica_input_pipelines_run_without_the_autotune_thread(monkeypatch):
    """Pins _tf_private.patch_device_datasets_without_autotune: under a tfdp strategy every
    per-replica pipeline a distributed dataset builds (multi_device_iterator_ops's
    ``_create_device_dataset``) has tf.data's autotune off, so no autotune thread outlives
    an epoch's iterator (fit returned 62.8 s after its last step without it, measured on
    4 replicas, once in two runs; 0.0 s in two runs with it). Guard: TensorFlow's own
    function leaves autotune on."""
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    patched = mdi._create_device_dataset
    assert getattr(patched, "_tfdp_patch", False)
    built = []

    def recording(*args, **kwargs):
        built.append((patched(*args, **kwargs), patched.__wrapped__(*args, **kwargs)))
        return built[-1][0]

    monkeypatch.setattr(mdi, "_create_device_dataset", recording)
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
    values = [strategy.experimental_local_results(batch) for batch in dist]
    assert [[v.numpy().tolist() for v in replicas] for replicas in values] == [
        [[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert len(built) >= 2
    for ours, tensorflows in built:
        assert ours.options().autotune.enabled is False
        assert tensorflows.options().autotune.enabled is not False  # guard


@pytest.mark.parametrize("name", sorted(PER_DEVICE_ELEMENTS))
def test_per_replica_generator_functions_are_traced_once_and_give_the_same_elements(name):
    """Pins _tf_private.patch_per_device_generators_traced_once: under a tfdp strategy every
    distributed iterator's per-device generators reuse functions traced once per device and
    element structure (TensorFlow traces six per device and iterator: 0.15 s of every epoch
    at 4 CPU replicas here, 0.09 s with the patch; tools/bench_epoch_overhead.py), and
    give the same elements in the same order on every replica as TensorFlow's own (on two
    logical GPUs too: tests/test_gpu.py)."""
    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(4)])
    got = generators_against_tensorflows(strategy, PER_DEVICE_ELEMENTS[name])
    assert got["traced"] >= 4 and got["retraced"] == 0, got
    assert got["equal"], got
    assert got["elements"] > 8  # the comparison saw elements


def test_a_dropped_distributed_iterator_is_freed_without_a_garbage_collection(monkeypatch):
    """The patch's second effect: nothing of an epoch's iterator sits in a reference cycle,
    so it (and its source pipeline's threads) goes when the epoch drops it, not at the next
    full collection (tfdp/strategy/source_pipeline.py: collections that waited 90-108 s).
    Guard: TensorFlow's own per-device generators leave their function graphs in cycles."""
    import gc

    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

    strategy = tfdp.DataParallelStrategy([f"/device:CPU:{i}" for i in range(2)])
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(4))
    patched = vars(mdi._PerDeviceGenerator)["__init__"]

    def cyclic_function_graphs():
        next(iter(dist))  # one epoch's iterator, made and dropped
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return sum(type(o).__name__ == "FuncGraph" for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    next(iter(dist))  # the functions traced once, outside the measurement
    gc.collect()
    gc.disable()
    try:
        ours = cyclic_function_graphs()
        monkeypatch.setattr(mdi._PerDeviceGenerator, "__init__", patched.__wrapped__)
        tensorflows = cyclic_function_graphs()
    finally:
        gc.enable()
    assert ours == 0
    assert tensorflows > 0  # guard


def test_keras_distribution_internals_where_tfdp_puts_keras_distribution_on_tfdp():
    """tfdp.keras_distribution (issue 58): the TensorFlow backend's distribution_lib has
    Keras's list_devices and lacks the functions tfdp provides (the JAX backend's), the front
    end looks them up there at call time, set_distribution is bound in the namespaces tfdp
    patches, Keras's TF Variable creates its tf.Variable in ``_initialize``, Distribution has
    ``distribute_dataset`` and the global attribute's name."""
    import sys

    import keras
    from tfdp._tf_private import core, keras_distribution as kd

    assert tfdp.keras_distribution.install()
    backend = kd.keras_backend_distribution_lib()
    front = kd.keras_distribution_lib()
    for name in kd.BACKEND_REPLACED:
        original = getattr(backend, name)
        assert callable(getattr(original, "__wrapped__", original)), name
    entries = {(getattr(o, "__name__", o), n): v for o, n, v in core._registry}
    for name in kd.BACKEND_PROVIDED:
        # Absent from Keras's own module: tfdp's registry holds "absent" for it.
        assert entries[(backend.__name__, name)] is core._ABSENT, name
    assert "distribution_lib.list_devices(" in inspect.getsource(front.list_devices)
    assert "distribution_lib.initialize(" in inspect.getsource(front.initialize)
    assert "num_processes" in inspect.getsource(front.Distribution.__init__)
    holders = [n for n, m in list(sys.modules.items())
               if m is not None and getattr(getattr(m, "set_distribution", None),
                                            "_tfdp_patch", False)]
    assert {"keras.distribution", front.__name__} <= set(holders), holders
    from keras.src.backend.tensorflow.core import Variable

    assert "tf.Variable(" in inspect.getsource(
        getattr(Variable._initialize, "__wrapped__", Variable._initialize))
    assert callable(kd.keras_distribution_base().distribute_dataset)
    assert front.GLOBAL_ATTRIBUTE_NAME == "distribution"
    kd.set_keras_distribution_quietly(None)
    assert keras.distribution.distribution() is None


def test_operations_since_gives_the_ops_added_after_a_bookmark_without_copying_the_graph():
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0, name="before")
        mark = _tf_private.operation_count(graph)
        added = [tf.constant(2.0, name="after_a").op, tf.constant(3.0, name="after_b").op]
    assert mark == 1 == len(graph.get_operations()) - 2
    assert _tf_private.operations_since(graph, mark) == added
    assert _tf_private.operations_since(graph, graph.version) == []
    # The list TensorFlow hands out is its own, not a copy (what makes the read linear).
    assert graph.operations is graph.operations


def test_split_gradient_runs_the_backward_program_on_the_arguments_given_again():
    """``_tf_private.split_gradient``: TensorFlow's forward/backward pair of a compiled
    function (both XLA programs). The backward program reads the function's arguments (and
    casts, reshapes, transposes of them: PASS_THROUGH_OPS) from what ``backward`` is given, and
    the forward's kept values from ``forward``; its gradients equal TensorFlow's own. Another
    value of the parameters alone (a normalised kernel) is reported by ``kept_reading_only``."""
    import numpy as np
    import tensorflow as tf

    def unit(x, w):
        w64 = tf.transpose(tf.reshape(tf.cast(w, tf.float64), [32, 16]))
        return tf.nn.relu(tf.matmul(tf.cast(tf.tanh(x), tf.float64), w64))

    def normalised(x, w):
        return tf.tanh(tf.matmul(x, w / tf.norm(w, axis=0)))

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(8, 16)), tf.float32)
    w = tf.constant(rng.normal(size=(16, 32)), tf.float32)
    compiled = tf.function(unit, jit_compile=True, autograph=False)
    found = {}

    @tf.function
    def step(x, w):
        split = _tf_private.split_gradient(compiled.get_concrete_function(x, w))
        (y,), kept = split.forward([x, w])
        dy = 2.0 * y
        found["sources"] = [s[0] for s in split.sources]
        found["replays"] = [(s[1], [op.type for _, op, _ in s[2]]) for s in split.sources
                            if s[0] == "replay"]
        found["parameters_alone"] = split.kept_reading_only([1])
        found["kept"] = len(split.kept_outputs)
        found["kept_arguments"] = [j for j in split.kept_outputs
                                   if split._graph.outputs[j].op.type == "Placeholder"]
        found["recording"] = _tf_private.tape_is_recording()
        dx, dw = split.backward([dy], [x, w], kept)
        dx_zero_w, _ = split.backward([dy], [x, tf.zeros_like(w)], kept)
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            loss = tf.reduce_sum(unit(x, w) ** 2)
        return dx, dw, dx_zero_w, tape.gradient(loss, [x, w])

    dx, dw, dx_zero_w, (rx, rw) = step(x, w)
    np.testing.assert_allclose(dx.numpy(), rx.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.numpy(), rw.numpy(), rtol=1e-5, atol=1e-5)
    assert not np.any(dx_zero_w.numpy())  # dx = dy w^T read the w it was given again
    assert found["replays"] == [(1, ["Cast", "Reshape", "Transpose"])], found["replays"]
    assert "output" in found["sources"] and found["parameters_alone"] == []
    assert set(_tf_private.PASS_THROUGH_OPS) == {"Cast", "Identity", "Reshape", "Transpose",
                                                 "ExpandDims", "Squeeze"}
    library = step.get_concrete_function(x, w).graph.as_graph_def().library.function
    programs = [f for f in library
                if f.signature.name.startswith(("__forward", "__inference___backward"))]
    assert len(programs) == 2 and all(f.attr["_XlaMustCompile"].b for f in programs)
    # The forward program returns the outputs and the kept values only: no argument (XLA
    # would copy a gathered parameter out of every call).
    forward = next(f for f in library if f.signature.name.startswith("__forward"))
    assert len(forward.signature.output_arg) == 1 + found["kept"], found["kept"]
    assert found["kept"] >= 1 and not found["kept_arguments"]

    compiled_n = tf.function(normalised, jit_compile=True, autograph=False)

    @tf.function
    def step_n(x, w):
        split = _tf_private.split_gradient(compiled_n.get_concrete_function(x, w))
        found["normalised"] = len(split.kept_reading_only([1]))
        return split.forward([x, w])[0]

    step_n(x, w)
    assert found["normalised"] >= 1
    assert found["recording"] is False
    with tf.GradientTape():
        assert _tf_private.tape_is_recording()

    # Several outputs, one an integer (no gradient) and one without a gradient given; a
    # kernel reshaped to the input's (dynamic) shape is still the parameter's alone.
    def several(x, w):
        kernel = tf.reshape(w, [tf.shape(x)[-1], -1])
        y = tf.tanh(tf.matmul(x, kernel))
        return {"y": y, "z": 3.0 * y, "rows": tf.shape(x)[0]}

    compiled_s = tf.function(several, jit_compile=True, autograph=False)

    @tf.function
    def step_s(x, w):
        split = _tf_private.split_gradient(compiled_s.get_concrete_function(x, w))
        outputs, kept = split.forward([x, w])
        rows, y, z = outputs  # the dict's keys in order
        found["several_alone"] = len(split.kept_reading_only([1]))
        dx, dw = split.backward([None, 2.0 * y, None], [x, w], kept)
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            loss = tf.reduce_sum(several(x, w)["y"] ** 2)
        return rows, dx, dw, tape.gradient(loss, [x, w])

    rows, dx, dw, (rx, rw) = step_s(x, w)
    assert int(rows) == 8 and found["several_alone"] == 1
    np.testing.assert_allclose(dx.numpy(), rx.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.numpy(), rw.numpy(), rtol=1e-5, atol=1e-5)
