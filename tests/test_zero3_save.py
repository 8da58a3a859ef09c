"""Horovod's save idiom under ZeRO-3 on several workers (issue 57, item 5;
tfdp/strategy/zero3/whole_reads.py): only the chief calls ``model.save``, and the other workers,
done with their script, serve its whole-tensor reads from their exit. The job ends, the file
loads in a plain process with one device's weights; a worker that is gone fails the chief's
save within seconds, naming it.

Two real workers on 127.0.0.1: through tfdp-run for the idiom, started directly with
``TF_CONFIG`` for the guard (tfdp-run would stop the chief as soon as the other worker died,
before the chief could say anything itself).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from helpers import assert_weights_close, classification_data, initial_weights
from launching import run_job, tfdp_run_command, worker_env, worker_script
from procs import process_alive
from tfdp.launcher.processes import free_ports
from tfdp.strategy.zero3 import whole_reads
from zero3_cases import OPTIMIZERS, compile_for, dense_stack

LAUNCH_TIMEOUT = 240


def one_device():
    """dense_stack after 2 epochs of Adam + global_clipnorm at global batch 64 on one device
    (mw_zero3_worker.py's training)."""
    import tensorflow as tf

    x, y = classification_data()
    model = dense_stack()
    model.set_weights(initial_weights(dense_stack))
    compile_for(model, OPTIMIZERS["adam_global_clipnorm"]())
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=2, verbose=0)
    return model.get_weights()


@pytest.mark.multiworker
@pytest.mark.slow
def test_only_the_chief_saves_and_the_other_worker_serves_it_from_its_exit(tmp_path):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_SAVE_ON="chief",
                         TF_CPP_MIN_LOG_LEVEL=2)
    start = time.monotonic()
    code, out = run_job(tfdp_run_command(worker_script("mw_zero3_worker.py"), cpu_replicas=2,
                                         flags=["--output", "all"]), environ, LAUNCH_TIMEOUT)
    elapsed = time.monotonic() - start
    assert code == 0, out[-4000:]
    assert "rank 1: done" in out and "rank 0: done" in out, out[-4000:]
    seconds = float(out.split("rank 0: saved in ")[1].split()[0])
    print(f"job {elapsed:.0f} s, the chief's save and get_weights {seconds:.1f} s")
    # A hang is the deadline (300 s) or the job's timeout; the save itself takes seconds.
    assert seconds < 60, out[-4000:]
    ref = one_device()
    loaded = keras.saving.load_model(tmp_path / "model.keras")  # a plain process: one device
    assert_weights_close(loaded.get_weights(), ref, atol=1e-5, rtol=1e-5)
    saved = np.load(tmp_path / "weights-0.npz")
    assert_weights_close([saved[f"arr_{i}"] for i in range(len(ref))], ref, atol=1e-5,
                         rtol=1e-5)


def _start_worker(rank, addresses, environ):
    env = dict(environ, TF_CONFIG=json.dumps({"cluster": {"worker": addresses},
                                              "task": {"type": "worker", "index": rank}}),
               TFDP_RANK=str(rank))
    return subprocess.Popen([sys.executable, str(worker_script("mw_zero3_worker.py"))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class _Lines:
    """Every line a process writes, read by a thread of its own (a select() on the pipe would
    miss lines already in the reader's buffer), and waited for by content."""

    def __init__(self, proc):
        self.lines = []
        self._cond = threading.Condition()
        self._ended = False
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait_for(self, marker, timeout, after=0):
        """The first line from index ``after`` on holding ``marker``; fails after ``timeout``
        seconds or once the process has ended without it."""
        def found():
            return next((line for line in self.lines[after:] if marker in line), None)

        with self._cond:
            if not self._cond.wait_for(lambda: found() or self._ended, timeout) or not found():
                raise AssertionError(f"no {marker!r} within {timeout} s (ended: {self._ended}):"
                                     f"\n{''.join(self.lines)}")
            return found()


@pytest.mark.multiworker
@pytest.mark.slow
def test_guard_a_killed_worker_fails_the_chiefs_save_within_seconds_naming_it(tmp_path):
    environ = worker_env(TFDP_TEST_OUT=tmp_path, TFDP_TEST_SAVE_ON="chief",
                         TFDP_TEST_OTHER="wait", TF_CPP_MIN_LOG_LEVEL=2)
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    procs = [_start_worker(rank, addresses, environ) for rank in range(2)]
    chief, other = _Lines(procs[0]), _Lines(procs[1])
    try:
        other.wait_for("rank 1: waiting", LAUNCH_TIMEOUT)
        chief.wait_for("rank 0: saving at", LAUNCH_TIMEOUT)
        saving = len(chief.lines)
        # The chief now waits for worker 1, which is alive and takes no part.
        assert process_alive(procs[1].pid)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        line = chief.wait_for("rank 0: ", 60, after=saving)
        procs[0].wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    text = "".join(chief.lines)
    assert "WholeReadError at" in line, text[-4000:]
    failed_at = float(line.split(" at ")[1].split(":")[0])
    assert "the process of worker 1 (" in line and "is gone" in line, line
    assert "reading the sharded variable" in line and "on worker 0 of 2" in line, line
    print(f"the chief's save failed {failed_at - killed_at:.1f} s after the kill")
    assert failed_at - killed_at < 10, (failed_at - killed_at, text[-4000:])
    assert procs[0].returncode == 1, text[-4000:]
    assert "rank 0: saved in" not in text, text[-4000:]


def test_read_numbers_survive_a_reset_and_the_registry_does_not():
    # The coordination service keeps its keys for the job's life: a number used before
    # tfdp.reset() is never announced again (a worker would read the old announcement).
    import tfdp

    class Cluster:
        rank = 1

    class Strategy:
        cluster = Cluster()

        def __init__(self, key):
            self.key_base = key

    before = whole_reads.take_number()
    first, second = Strategy(7_000_000), Strategy(8_000_000)
    ids = [whole_reads.register(first, lambda: None), whole_reads.register(second, lambda: None),
           whole_reads.register(first, lambda: None)]
    # Ids count per strategy and are never reused, though a later strategy's registration
    # lets the earlier one's variables go: two variables never share an id.
    assert ids == ["7000000:0", "8000000:0", "7000000:1"]
    assert whole_reads.registered() == 3
    tfdp.reset()
    assert whole_reads.registered() == 0
    assert whole_reads.take_number() == before + 1
