"""Slurm's own signals: SIGUSR1 and SIGUSR2 take SIGTERM's path (issue 36, part 3).

Rules under test (tfdp.resilience.preemption):

* A preemption signal during ``fit`` (SIGTERM always; SIGUSR1/SIGUSR2 inside a Slurm job, or
  as ``preemption_signals=``/``TFDP_PREEMPTION_SIGNALS`` say) makes BackupAndRestore back up
  at the next step boundary and leave ``fit`` with ``Preempted`` (``SystemExit(143)``); the
  relaunch resumes step-exactly. A signal outside the set keeps the handler it had.
* A preemption signal whose handler before ``fit`` was a Python function (submitit's) is
  handed to that function once the backup exists.
* Under a real Slurm (the controller and two emulated nodes of tests/slurm_cluster.py, whose
  fixture and helpers these tests reuse): USR1 to the batch script (what ``sbatch
  --signal=B:USR1@120`` sends), forwarded by its trap to the tasks, or USR2 to the tasks
  (``--signal=USR2@90``), ends with 143 and ``scontrol requeue``; the requeued job resumes at
  the next step and ends with the weights of an uninterrupted run (1e-5). submitit
  (``AutoExecutor(cluster="slurm")``) requeues the job itself after tfdp's backup.

The in-process tests restore the signal handlers they change. The Slurm tests signal and
cancel only their own job ids, and wait for files or job states with deadlines.
"""

import os
import signal
import sys
import threading

import pytest
import tensorflow as tf
import keras

import tfdp
from helpers import classification_data, cpu_devices, initial_weights, mlp
from tfdp.callbacks import Preempted
from tfdp.protocol import EXIT_PREEMPTED, PREEMPTION_SIGNALS_ENV
from tfdp.resilience.preemption import PreemptionWatcher, preemption_signals

from slurm_cluster import (MISSING, SKIP_REASON, WORKER, assert_close, held_at_13,
                           reference_weights, saved_weights, steps_of)

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
HANDLED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
STEPS = 2 * 8  # 2 epochs x 256 examples / global batch 32
needs_slurm = pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)


# --- which signals -------------------------------------------------------------------------

def test_default_is_sigterm_plus_usr1_usr2_only_inside_a_slurm_job():
    assert preemption_signals(environ={}) == (signal.SIGTERM,)
    assert preemption_signals(environ={"SLURM_JOB_ID": "7"}) == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    # The environment variable, then the argument, replace the default.
    env = {"SLURM_JOB_ID": "7", PREEMPTION_SIGNALS_ENV: "SIGTERM, usr2"}
    assert preemption_signals(environ=env) == (signal.SIGTERM, signal.SIGUSR2)
    assert preemption_signals(("SIGTERM", "USR1", 10), environ=env) == (
        signal.SIGTERM, signal.SIGUSR1)


@pytest.mark.parametrize("bad,problem", [
    ("SIGUSR1", "leaves out SIGTERM"),
    ("SIGTERM,SIGKILL", "SIGKILL cannot be handled"),
    ("SIGTERM,SIGBOGUS", "'SIGBOGUS' is not a signal"),
])
def test_a_wrong_set_is_refused_when_the_callback_is_built(tmp_path, monkeypatch, bad, problem):
    with pytest.raises(ValueError, match=problem):
        tfdp.callbacks.BackupAndRestore(tmp_path, preemption_signals=bad)
    monkeypatch.setenv(PREEMPTION_SIGNALS_ENV, bad)
    with pytest.raises(ValueError, match=f"{PREEMPTION_SIGNALS_ENV}=.*{problem}"):
        tfdp.callbacks.BackupAndRestore(tmp_path)


# --- in one process ------------------------------------------------------------------------

@pytest.fixture
def own_handlers(monkeypatch):
    """Puts back the handlers of the signals the tests send, and a clean environment."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(PREEMPTION_SIGNALS_ENV, raising=False)
    saved = {s: signal.getsignal(s) for s in HANDLED}
    yield
    for s, handler in saved.items():
        signal.signal(s, signal.SIG_DFL if handler is None else handler)


class SignalAt(keras.callbacks.Callback):
    """Records every step (the optimizer's counter); sends ``signum`` to this process after
    step ``at``, before BackupAndRestore's hook of that step runs (it comes later in the
    list). Python runs the handler before ``os.kill`` returns to this code."""

    def __init__(self, signum, at):
        super().__init__()
        self.signum, self.at, self.steps = signum, at, []

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        self.steps.append(step)
        if step == self.at:
            os.kill(os.getpid(), self.signum)


def _fit(backup_dir, callbacks=(), **backup_kwargs):
    """One worker, one replica, tfdp.data input: the MLP for 2 epochs with BackupAndRestore
    (save_freq=100: no periodic backup, so a backup found is the preemption's). Returns the
    model and the callback; a preemption escapes as SystemExit with the callback in
    ``exc.backup``."""
    # The backstop would end this process (an xdist worker) with os._exit if the backup took
    # longer than the grace period: the default 30 s is within reach of a slow CI host's
    # contended step, and these tests judge the agreed stop, not the backstop (which
    # test_resilience checks in a process of its own).
    backup_kwargs.setdefault("grace_seconds", 600)
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(1))
    x, y = classification_data(n=256)
    data = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, y)), 32)
    with strategy.scope():
        model = mlp()
        model.set_weights(initial_weights(mlp))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = tfdp.callbacks.BackupAndRestore(backup_dir, save_freq=100, dataset=data,
                                             **backup_kwargs)
    try:
        model.fit(data, epochs=2, verbose=0, callbacks=[*callbacks, backup])
    except SystemExit as e:
        e.backup = backup
        raise
    return model, backup


def _backstops():
    """The armed backstop timers of preemption watchers in this process (a cancelled one
    may still be alive for a moment, on its way out)."""
    return [t for t in threading.enumerate() if isinstance(t, threading.Timer)
            and getattr(t.function, "__name__", "") == "_backstop" and not t.finished.is_set()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, _ = _fit(tmp_path_factory.mktemp("uninterrupted"))
    return model.get_weights()


@pytest.mark.parametrize("name,env,argument", [
    ("SIGTERM", {}, None),
    ("SIGUSR1", {}, ("SIGTERM", "SIGUSR1")),
    ("SIGUSR2", {"SLURM_JOB_ID": "4242"}, None),
    ("SIGUSR1", {PREEMPTION_SIGNALS_ENV: "SIGTERM,SIGUSR1"}, None),
], ids=["SIGTERM by default", "SIGUSR1 as preemption_signals=", "SIGUSR2 inside a Slurm job",
        "SIGUSR1 in TFDP_PREEMPTION_SIGNALS"])
def test_a_preemption_signal_backs_up_exits_143_and_the_relaunch_is_exact(
        tmp_path, monkeypatch, own_handlers, uninterrupted, name, env, argument):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sender = SignalAt(signal.Signals[name], at=11)  # mid-epoch 2
    with pytest.raises(SystemExit) as exit_info:
        _fit(tmp_path, [sender], preemption_signals=argument, delete_checkpoint=False)
    assert isinstance(exit_info.value, Preempted) and exit_info.value.code == EXIT_PREEMPTED
    assert f"after {name}" in exit_info.value.message, exit_info.value.message
    assert sender.steps == list(range(1, 12))  # stopped at the step boundary it was sent at
    assert tfdp.callbacks.BackupAndRestore.saved_info(tmp_path)["global_step"] == 11
    # What the requeued job does: the same script again, resuming at step 12.
    resumed, backup = _fit(tmp_path, [sender])
    assert backup.restored_step == 11 and sender.steps[11:] == list(range(12, STEPS + 1))
    assert_close(resumed.get_weights(), uninterrupted)


def test_guard_a_signal_outside_the_set_keeps_its_handler(tmp_path, own_handlers):
    # Outside Slurm the default set is SIGTERM alone: a script's own SIGUSR1 handler stays in
    # place during fit and runs, and SIGUSR2 keeps its default action.
    received = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    seen = {}

    class Look(SignalAt):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("usr2", signal.getsignal(signal.SIGUSR2))
            super().on_train_batch_end(batch, logs)

    sender = Look(signal.SIGUSR1, at=3)
    _, backup = _fit(tmp_path, [sender])
    assert received == [signal.SIGUSR1]
    assert sender.steps == list(range(1, STEPS + 1))  # trained to the end
    assert seen["usr2"] == signal.SIG_DFL
    assert backup.restored_step is None
    # Guard of the guard: with SIGUSR1 in the set the same signal stops training at step 3,
    # and the script's handler runs only after the backup.
    sender = SignalAt(signal.SIGUSR1, at=3)
    with pytest.raises(SystemExit) as exit_info:
        _fit(tmp_path / "b", [sender], preemption_signals="SIGTERM,SIGUSR1")
    assert exit_info.value.code == EXIT_PREEMPTED and sender.steps == [1, 2, 3]
    assert received == [signal.SIGUSR1, signal.SIGUSR1]


@pytest.mark.parametrize("exits", [False, True], ids=["handler returns", "handler exits"])
def test_the_handler_a_signal_had_before_fit_runs_after_the_backup(tmp_path, monkeypatch,
                                                                   own_handlers, exits):
    # Stands for submitit: its SIGUSR2 handler checkpoints, runs `scontrol requeue` and
    # exits (-1) on rank 0, and returns on the other ranks.
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    calls = []

    def submitit_like(signum, frame):
        calls.append((signum, tfdp.callbacks.BackupAndRestore.saved_info(tmp_path)["global_step"]))
        if exits:
            sys.exit(-1)

    signal.signal(signal.SIGUSR2, submitit_like)
    with pytest.raises(SystemExit) as exit_info:
        _fit(tmp_path, [SignalAt(signal.SIGUSR2, at=5)], delete_checkpoint=False)
    assert calls == [(signal.SIGUSR2, 5)]  # once, after the backup of step 5
    assert exit_info.value.code == (-1 if exits else EXIT_PREEMPTED)
    assert signal.getsignal(signal.SIGUSR2) is submitit_like  # put back when fit ended


class FailAfterSignal(SignalAt):
    """Sends the signal at step ``at``, notes the live backstops, then fails the step (a
    bug in the script, an OOM) before the backup's hook of that step runs."""

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self.steps[-1] == self.at:
            self.backstops_during_fit = _backstops()
            raise RuntimeError("the step failed")


@pytest.mark.parametrize("how", ["preempted", "failed"])
def test_fit_left_by_an_exception_puts_the_handler_back_and_stops_the_backstop(
        tmp_path, own_handlers, how):
    # Keras calls on_train_end only when fit returns. Left behind, the watcher would keep
    # SIGTERM and its backstop would end this process with os._exit(143) a grace period
    # later, in whatever the process does next (seen: a pytest-xdist worker lost mid-suite).
    def mine(signum, frame):
        return None
    signal.signal(signal.SIGTERM, mine)
    if how == "preempted":
        with pytest.raises(SystemExit) as exit_info:
            _fit(tmp_path, [SignalAt(signal.SIGTERM, at=3)], delete_checkpoint=False)
        assert exit_info.value.code == EXIT_PREEMPTED
    else:
        sender = FailAfterSignal(signal.SIGTERM, at=3)
        with pytest.raises(RuntimeError, match="the step failed"):
            _fit(tmp_path, [sender])
        assert len(sender.backstops_during_fit) == 1  # guard: the signal armed a backstop
    assert signal.getsignal(signal.SIGTERM) is mine
    assert _backstops() == []


def test_watcher_hands_each_received_signal_on_once(own_handlers):
    calls = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    watcher = PreemptionWatcher(grace_seconds=60, signals="SIGTERM,SIGUSR1,SIGUSR2")
    watcher.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # SIG_DFL before: nothing to pass on
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.requested and watcher.received == [signal.SIGUSR2, signal.SIGUSR1]
        assert calls == []  # the process lives on; the handler waits for the backup
        watcher.pass_on()
        watcher.pass_on()
        assert calls == [signal.SIGUSR1]
    finally:
        watcher.cancel_backstop()
        watcher.uninstall()


# --- under a real Slurm --------------------------------------------------------------------

# The batch script docs/clusters.md documents. bash runs a trap only once the foreground
# command returns, so srun runs in the background and the script waits for it; the trap
# ends that wait early (status 138), so it waits a second time for srun's own code.
BATCH_SCRIPT = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append
#SBATCH --signal=B:USR1@120
trap 'echo "batch script: USR1, forwarding it to the tasks"; kill -USR1 "$pid"; forwarded=1' USR1
srun --kill-on-bad-exit=1 {python} {worker} &
pid=$!
wait "$pid"; code=$?
if [ -n "$forwarded" ] && [ "$code" -eq 138 ]; then wait "$pid"; code=$?; fi
if [ "$code" -eq 143 ] || [ "$code" -eq 137 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit $code
"""

def _check_resumed_exactly(out):
    reference = reference_weights(epochs=3)
    for rank in range(2):
        steps = steps_of(out, rank)
        assert [it for launch, it in steps if launch == 0] == list(range(1, 14))
        assert [it for launch, it in steps if launch == 1] == list(range(14, 25))  # none twice
        assert_close(saved_weights(out, rank), reference)


@pytest.mark.slow
@pytest.mark.multiworker
@needs_slurm
@pytest.mark.parametrize("sig,scancel", [("USR1", ("--batch",)), ("USR2", ())],
                         ids=["USR1 to the batch script (--signal=B:USR1@n), forwarded",
                              "USR2 to the tasks (--signal=USR2@n)"])
def test_slurm_signal_backs_up_requeues_and_resumes_exactly(slurm, tmp_path, sig,
                                                            scancel):
    script = tmp_path / "job.sh"
    script.write_text(BATCH_SCRIPT.format(python=sys.executable, worker=WORKER))
    log = tmp_path / "job.log"
    code, out = slurm.run("sbatch", "--parsable", "-o", str(log), str(script), timeout=30,
                          TFDP_TEST_OUT=str(tmp_path), TFDP_TEST_BACKUP=str(tmp_path / "backup"),
                          TFDP_TEST_EPOCHS="3", TFDP_TEST_HOLD="0:13")
    assert code == 0, out
    job = int(out.strip().split(";")[0])
    # Rank 0 holds before step 13 until its watcher has the signal: the signal lands
    # mid-training, in fit, and step 13 carries the stop flag.
    state, fields = slurm.signal_when_held_and_finish(
        job, held_at_13(slurm, job, tmp_path, log), f"--signal={sig}", *scancel)
    text = log.read_text()
    assert state == "COMPLETED" and fields.get("Restarts") == "1", (fields, text)
    assert ("batch script: USR1, forwarding" in text) == (scancel == ("--batch",)), text
    assert "Exited with exit code 143" in text, text  # srun reports the first run's tasks
    assert "backed up at global step 13" in text and f"after SIG{sig}" in text, text
    _check_resumed_exactly(tmp_path)


@pytest.mark.slow
@pytest.mark.multiworker
@needs_slurm
def test_submitit_requeues_the_job_after_tfdp_backs_up(slurm, tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit", reason="submitit is not installed (pip install "
                                   "submitit): its USR2-and-requeue path is not tested")
    # submitit runs sbatch/scontrol with this process's environment: give it the test
    # cluster's, the worker's knobs, and this directory for the job to unpickle Train from.
    for key in [k for k in os.environ if k.startswith("SLURM") or k == "TF_CONFIG"]:
        monkeypatch.delenv(key)
    for key, value in dict(slurm.env, TFDP_TEST_OUT=str(tmp_path), TFDP_TEST_EPOCHS="3",
                           TFDP_TEST_BACKUP=str(tmp_path / "backup"), TFDP_TEST_HOLD="0:13",
                           PYTHONPATH=os.pathsep.join(
                               [WORKERS] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                           ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(WORKERS)
    import submitit_train

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    # timeout_min=60: the signal comes long before 80 % of it, so submitit calls the job
    # preempted (it requeues a timed-out job only if it is Checkpointable, as Train is).
    executor.update_parameters(nodes=2, tasks_per_node=1, timeout_min=60)
    job = executor.submit(submitit_train.Train())
    job_id = int(job.job_id)
    log = tmp_path / "submitit" / f"{job_id}_0_log.err"
    # What Slurm sends at --signal=USR2@90, submitit's own ask (job._interrupt(timeout=True)).
    state, fields = slurm.signal_when_held_and_finish(
        job_id, held_at_13(slurm, job_id, tmp_path, log), "--signal=USR2")
    text = log.read_text()
    assert state == "COMPLETED" and fields.get("Restarts") == "1", (fields, text)
    assert "backed up at global step 13" in text and "after SIGUSR2" in text, text
    # submitit's handler ran after the backup and requeued the job (rank 0 then exits 255 or
    # is killed by the requeue first: a race, not asserted; rank 1 leaves with tfdp's 143).
    assert "Caught signal SIGUSR2" in text and "DUE TO JOB REQUEUE" in text, text
    assert text.index("after SIGUSR2") < text.index("Caught signal SIGUSR2"), text
    assert job.results() == ["done", "done"]  # both tasks, from the result files
    _check_resumed_exactly(tmp_path)
