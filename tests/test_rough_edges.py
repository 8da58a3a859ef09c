"""Rough edges a new user hits (issue 10): jit_compile under several CPU replicas, a
gradient captured from outside ``strategy.run``, the orderly exit of multi-worker jobs (real
3-worker runs on 127.0.0.1 through tfdp-run), and examples whose output carries no
warnings."""

import os
import re
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp import strategy as strategy_lib
from helpers import (assert_weights_close, classification_data, cpu_devices, initial_weights,
                     mlp, train)


# --- jit_compile ------------------------------------------------------------------------

JIT_MESSAGE = "jit_compile=True cannot compile a step of 2 CPU replicas"


def test_jit_compile_policy_refuses_several_cpu_replicas_only():
    message = strategy_lib.jit_compile_error("CPU", 4)
    for needed in ("jit_compile=True", "4 CPU replicas",
                   "XLA on CPU cannot compile the cross-replica collectives",
                   "jit_compile=False", "jit_compile='auto'", "one replica"):
        assert needed in message, needed
    assert strategy_lib.jit_compile_error("CPU", 1) is None  # no collective to compile
    # Guard: GPUs are left to TensorFlow, which compiles collectives with XLA there.
    assert strategy_lib.jit_compile_error("GPU", 8) is None


def _jit_model(strategy, jit_compile):
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
    return model


def test_jit_compile_true_on_cpu_replicas_is_one_clear_error_at_first_fit():
    x, y = classification_data(n=32)
    model = _jit_model(tfdp.DataParallelStrategy(cpu_devices(2)), True)
    with pytest.raises(ValueError, match=JIT_MESSAGE) as raised:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert "XLA on CPU" in str(raised.value) and "jit_compile=False" in str(raised.value)
    with pytest.raises(ValueError, match=JIT_MESSAGE):  # evaluate's step has collectives too
        model.evaluate(x, y, batch_size=16, verbose=0)
    # predict jit-compiles only the per-replica function (no collective inside): allowed.
    assert model.predict(x, batch_size=16, verbose=0).shape == (32, 3)


def test_jit_compile_in_a_custom_loop_is_the_same_clear_error():
    strategy = tfdp.DataParallelStrategy(cpu_devices(2))

    @tf.function(jit_compile=True)
    def step(v):
        return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("sum", t),
                            args=(v,))

    with pytest.raises(ValueError, match=JIT_MESSAGE):
        step(tf.constant(1.0))


def test_keras_auto_jit_compile_is_not_refused():
    x, y = classification_data(n=32)
    model = _jit_model(tfdp.DataParallelStrategy(cpu_devices(2)), "auto")
    assert model.jit_compile is False  # Keras's "auto" leaves XLA off under a strategy
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][0])


def test_one_replica_trains_with_jit_compile_true_like_without():
    x, y = classification_data(n=64)
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    compiled, _ = train(tfdp.DataParallelStrategy(cpu_devices(1)), mlp, sgd, x, y, 16,
                        weights=initial_weights(mlp), compile_kwargs={"jit_compile": True},
                        fit_kwargs={"shuffle": False})
    assert compiled.jit_compile is True
    plain, _ = train(tfdp.DataParallelStrategy(cpu_devices(1)), mlp, sgd, x, y, 16,
                     weights=initial_weights(mlp), fit_kwargs={"shuffle": False})
    assert_weights_close(compiled.get_weights(), plain.get_weights())


# --- a gradient captured from outside strategy.run --------------------------------------

def _apply_captured_gradient(strategy):
    """SGD(lr=1) applies a gradient tensor made outside ``strategy.run`` (captured by the
    replica function); returns every replica's copy of the variable afterwards."""
    with strategy.scope():
        variable = keras.Variable(np.ones(2, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])
    gradient = tf.constant([1.0, 2.0])  # one tensor, the same object in every replica

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply([gradient], [variable]))

    step()
    return [np.asarray(v) for v in strategy.experimental_local_results(variable.value)]


def test_captured_gradient_is_summed_over_replicas():
    # tfdp's rule: every replica contributes what it passes to optimizer.apply, as when each
    # replica computes its own gradient, so a captured g enters N times: w - lr * N * g.
    for value in _apply_captured_gradient(tfdp.DataParallelStrategy(cpu_devices(4))):
        np.testing.assert_allclose(value, 1.0 - 4 * np.array([1.0, 2.0]), rtol=1e-6)


def test_guard_mirrored_strategy_does_not_sum_a_captured_gradient():
    # MirroredStrategy regroups the identical object into one value and applies it once
    # (Keras's optimizer_distribute_test.py::test_ema relies on this). Reduction-to-one-
    # device cross-device ops: no collective keys that could clash with other tests.
    mirrored = tf.distribute.MirroredStrategy(
        cpu_devices(4), cross_device_ops=tf.distribute.ReductionToOneDevice())
    values = _apply_captured_gradient(mirrored)
    for value in values:
        np.testing.assert_allclose(value, 1.0 - np.array([1.0, 2.0]), rtol=1e-6)
    assert not np.allclose(values[0], 1.0 - 4 * np.array([1.0, 2.0]))


# --- orderly multi-worker exit ----------------------------------------------------------

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_TIMEOUT = 240

# What a successful job must not print: TensorFlow's error-severity log lines ("E0000
# 00:00:... file.cc:123] ...", "F..." for fatal) whatever their text, and any other line
# saying error (gRPC's "Error received from peer", Python's "...Error: ..."). TensorFlow's
# info/warning lines are judged by their severity: the oneDNN notice TensorFlow 2.21 prints
# at import (whatever TF_CPP_MIN_LOG_LEVEL says) mentions "round-off errors".
_TF_LOG_LINE = re.compile(r"(^|\s)([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\]")
_ERROR_WORD = re.compile(r"error", re.IGNORECASE)


# Captured from a real 3-worker run without the orderly exit (TFDP_ORDERLY_EXIT=0), worker
# 2 slower than the chief: the lines the issue reported.
CAPTURED_WITHOUT_ORDERLY_EXIT = """\
[w0] rank 0: done
[w1] rank 1: done
[w2] E0000 00:00:1795304136.110058    5227 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues.
[w2] Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/Heartbeat:
[w2] :UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:36577: Failed to connect to remote host: Connection refused"}
[w2] rank 2: done
[tfdp-run] job finished with exit code 0
"""


def error_lines(output):
    def is_error(line):
        tf_log = _TF_LOG_LINE.search(line)
        return tf_log.group(2) in "EF" if tf_log else bool(_ERROR_WORD.search(line))
    return [line for line in output.splitlines() if is_error(line)]


def test_error_line_check_catches_the_reported_heartbeat_errors():
    caught = error_lines(CAPTURED_WITHOUT_ORDERLY_EXIT)
    assert len(caught) == 3
    assert any("CoordinationService/Heartbeat" in line for line in caught)
    assert any("Connection refused" in line for line in caught)
    assert error_lines("[w2] E0000 00:00:1795304136.110058 5227 x.cc:252] Abort UNAVAILABLE")
    assert not error_lines("[w0] rank 0: done\n[tfdp-run] job finished with exit code 0\n"
                           "[w0] I0000 00:00:1795304126.483107    4817 port.cc:153] oneDNN "
                           "custom operations "
                           "are on. You may see ... round-off errors ...\n")


@pytest.mark.parametrize("uncaught,code,env,expected", [
    (False, None, {}, True),                        # script ended, or sys.exit() / sys.exit(0)
    (False, 0, {}, True),
    (True, None, {}, False),                        # uncaught exception: failing, leave now
    (False, 3, {}, False),                          # sys.exit(3)
    (False, "bad accuracy", {}, False),             # sys.exit("message") exits 1
    (False, None, {"TFDP_ORDERLY_EXIT": "0"}, False),
    (False, None, {"TFDP_ORDERLY_EXIT": "1"}, True),
])
def test_orderly_exit_policy(uncaught, code, env, expected):
    assert strategy_lib.leave_together_at_exit(uncaught, code, env) is expected


def test_chief_waits_until_peer_processes_are_gone():
    # A refused address is gone at once; a listener that closes the connection counts as
    # gone when it does; one that keeps it open is reported after the bound.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused = closed.getsockname()
    closed.close()
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    accepted = []

    def accept_then_close(server):
        conn, _ = server.accept()
        conn.close()  # what the operating system does when the peer process ends

    def accept_and_keep(server):
        accepted.append(server.accept()[0])

    threads = [threading.Thread(target=accept_then_close, args=(listeners[0],)),
               threading.Thread(target=accept_and_keep, args=(listeners[1],))]
    for t in threads:
        t.start()
    try:
        addresses = [refused] + [s.getsockname() for s in listeners]
        left = strategy_lib._wait_until_gone(addresses, timeout_seconds=0.3)
        assert left == [listeners[1].getsockname()]
    finally:
        for t in threads:
            t.join(timeout=10)
        for s in listeners + accepted:
            s.close()


def _launch_clean(workers=3, **env):
    environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    environ.pop("TF_CONFIG", None)
    environ.update({k: str(v) for k, v in env.items()})
    cmd = [sys.executable, "-m", "tfdp.run", "--workers", str(workers), "--output", "all", "--",
           sys.executable, os.path.join(HERE, "mw_clean_worker.py")]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("slow_rank", [2, 0], ids=["worker-after-chief", "chief-after-workers"])
def test_successful_job_with_a_slower_worker_ends_without_error_lines(slow_rank):
    code, out = _launch_clean(TFDP_TEST_SLOW_RANK=slow_rank)
    assert code == 0, out
    assert all(f"rank {r}: done" in out for r in range(3)), out
    assert error_lines(out) == [], out


@pytest.mark.slow
@pytest.mark.multiworker
def test_guard_without_the_orderly_exit_the_same_job_prints_heartbeat_errors():
    code, out = _launch_clean(TFDP_TEST_SLOW_RANK=2, TFDP_ORDERLY_EXIT=0)
    assert code == 0, out  # the job succeeds either way ...
    assert any("CoordinationService/Heartbeat" in line or "coordination service" in line
               for line in error_lines(out)), out  # ... but printed errors without it


@pytest.mark.slow
@pytest.mark.multiworker
def test_exit_barrier_does_not_hang_when_a_peer_is_dead():
    # Worker 1 leaves after training without any exit handler (os._exit): the others' exit
    # barrier fails once the coordination service declares it dead (heartbeat timeout),
    # not after the 300 s barrier timeout, which would overrun LAUNCH_TIMEOUT.
    code, out = _launch_clean(TFDP_TEST_SLOW_SECONDS=0, TFDP_TEST_VANISH_RANK=1)
    assert code == 0, out
    assert "tfdp: orderly exit: the exit barrier failed" in out, out


@pytest.mark.slow
@pytest.mark.multiworker
@pytest.mark.parametrize("how,expected_code", [("exit", 3), ("raise", 1)])
def test_failing_worker_does_not_wait_at_the_exit_barrier(how, expected_code):
    # Worker 2 keeps working far longer than LAUNCH_TIMEOUT: had worker 1 waited for it at
    # the exit barrier, the launch would time out. Its own exit code ends the job.
    code, out = _launch_clean(TFDP_TEST_SLOW_RANK=2, TFDP_TEST_SLOW_SECONDS=100_000,
                              TFDP_TEST_FAIL_AFTER_FIT=f"1:{how}")
    assert code == expected_code, out
    assert f"worker 1 exited with code {expected_code}" in out, out


# --- examples print only what the user needs --------------------------------------------

ROOT = os.path.dirname(HERE)

# The warning the examples used to print (Keras 3.15, fit on a dataset with shuffle=True).
CAPTURED_KERAS_SHUFFLE_WARNING = (
    "/x/keras/src/trainers/epoch_iterator.py:74: UserWarning: `shuffle=True` was passed, but "
    "will be ignored since the data `x` was provided as a tf.data.Dataset.\n"
    "  self.data_adapter = data_adapters.get_data_adapter(\n")
# What TensorFlow 2.21 writes to stderr while it is imported, whatever TF_CPP_MIN_LOG_LEVEL.
CAPTURED_TF_IMPORT_STDERR = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795306282.361210    1691 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1795306282.387771    1691 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795306283.522022    1691 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
"""


def noise_lines(output):
    """Lines a user should not have to read after a successful run: warnings and errors."""
    return [line for line in output.splitlines() if re.search(r"warn", line, re.IGNORECASE)
            ] + error_lines(output)


def test_noise_check_catches_keras_and_tensorflow_warnings():
    assert len(noise_lines(CAPTURED_KERAS_SHUFFLE_WARNING)) == 1
    assert len(noise_lines(CAPTURED_TF_IMPORT_STDERR)) == 2  # absl's pre-init WARNING lines
    assert noise_lines("epoch 3/3: loss 0.2952 accuracy 0.9126\ntest accuracy: 0.9499\n") == []


def test_examples_drop_only_tensorflows_startup_notices():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import common

    assert common.drop_startup_notices(CAPTURED_TF_IMPORT_STDERR) == ""
    # Guard: anything else written during the import stays, including TF's own errors.
    other = ("W0000 00:00:1795306282.4 1691 x.cc:1] something to act on\n"
             "E0000 00:00:1795306282.5 1691 y.cc:2] a real error\n"
             "Traceback (most recent call last):\n")
    assert common.drop_startup_notices(CAPTURED_TF_IMPORT_STDERR + other) == other


def _run_readme_command(cmd, timeout=LAUNCH_TIMEOUT):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the examples set what they need themselves
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_keras_fit_example_prints_no_warnings():
    # README: python examples/keras_fit.py (fewer epochs).
    code, out = _run_readme_command([sys.executable, "examples/keras_fit.py", "--epochs", "2",
                                     "--replicas", "2"])
    assert code == 0, out
    assert "test accuracy:" in out, out
    assert noise_lines(out) == [], out


@pytest.mark.slow
@pytest.mark.multiworker
def test_multi_worker_example_prints_no_warnings(tmp_path):
    # README: tfdp-run --workers 2 --cpu-replicas 2 -- python examples/multi_worker.py
    code, out = _run_readme_command(
        [sys.executable, "-m", "tfdp.run", "--workers", "2", "--cpu-replicas", "2", "--",
         sys.executable, "examples/multi_worker.py", "--epochs", "1",
         "--model_dir", str(tmp_path)])
    assert code == 0, out
    assert "[w0] saved" in out, out
    assert noise_lines(out) == [], out
