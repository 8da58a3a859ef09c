"""``hvd.elastic``: Horovod Elastic's API on tfdp's restart-based elasticity.

Rule. Horovod keeps the processes alive and re-forms the ring in-process after a failure;
tfdp cannot (TensorFlow's collective runtime is joined once per process), so a worker failure
ends the attempt and ``tfdp-run --min-np/--reset-limit`` (``--min-workers``/``--max-restarts``)
starts the script again on the slots that remain. What makes that Horovod's semantics:

* ``state.commit()`` is a durable, atomic checkpoint: the state's variables (model and optimizer
  weights) and its attributes (``epoch``, ``batch``, ...) are pickled by rank 0 to
  ``<dir>/<state>.pkl`` (written aside, fsynced, renamed into place), where ``<dir>`` is
  ``TFDP_ELASTIC_DIR`` if set (a directory rank 0 reaches in every attempt: shared storage on
  several hosts), else, under tfdp-run on this machine, the job's own directory (one per
  ``tfdp-run``, removed when it ends), else a private temporary directory (no resume across
  launches). The other ranks write nothing: every rank holds the whole state, and a restore
  broadcasts rank 0's.
* ``@hvd.elastic.run`` at the start of every attempt: rank 0 loads the last commit (if any),
  ``state.sync()`` broadcasts rank 0's state to every rank, and when a commit was loaded (a
  relaunch: a reset) the reset callbacks run with the new ``hvd.size()`` (e.g. Horovod's LR
  rescale); then the function runs. An exception ends the process (and the attempt): tfdp-run
  restarts, and the next attempt resumes from the last commit.
* ``check_host_updates()`` never raises: tfdp-run does not change a running attempt's members.
* Keras 3 cannot shorten an epoch from a callback (Horovod's callback changed
  ``params['steps']``, which Keras 3 ignores): ``UpdateBatchStateCallback`` ends a resumed
  partial epoch after its remaining batches (``model.stop_training``) and ``run`` calls the
  function again, which (re-entrant by Horovod's contract: ``epochs=E - state.epoch``)
  continues with the next epoch. ``state.batch`` counts the batches finished in the current
  epoch (Horovod stored the last batch's index, repeating one batch on resume), and
  ``CommitStateCallback`` also commits at every epoch boundary, so no commit ever stands at the
  last batch of an epoch.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import tempfile

import keras
import numpy as np

from tfdp import process_state
from tfdp.horovod import _runtime, collectives
from tfdp.protocol import CONTROL_DIR_ENV, ELASTIC_DIR_ENV, JOB_DIR_PREFIX

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
           "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt",
           "ELASTIC_DIR_ENV", "commit_dir"]

log = logging.getLogger("tfdp")

class HorovodInternalError(RuntimeError):
    """Horovod's error for a failed collective. In tfdp a failed peer ends the attempt (the
    collective raises TensorFlow's error, or the process is stopped by tfdp-run); the name is
    here so that scripts that catch it run."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's interrupt when hosts were added or removed. tfdp-run never changes a running
    attempt, so tfdp never raises it; the name is here so that scripts that catch it run."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


_private_dir = None


def commit_dir(environ=None) -> str:
    """Where commits live (the module docstring); created if need be."""
    global _private_dir
    environ = os.environ if environ is None else environ
    path = environ.get(ELASTIC_DIR_ENV, "").strip()
    if not path:
        control = environ.get(CONTROL_DIR_ENV, "").strip()
        parent = os.path.dirname(os.path.abspath(control)) if control else ""
        if parent and os.path.basename(parent).startswith(JOB_DIR_PREFIX):
            path = os.path.join(parent, "elastic")
        else:
            if _private_dir is None:
                _private_dir = tempfile.mkdtemp(prefix="tfdp-elastic-")
                if control:  # a tfdp-run worker on another host: no resume after a restart
                    log.warning("hvd.elastic: commits go to %s, private to this process: a "
                                "restarted job will not resume from them. Set %s to a "
                                "directory rank 0 reaches in every attempt (shared storage "
                                "on several hosts).", _private_dir, ELASTIC_DIR_ENV)
            path = _private_dir
    os.makedirs(path, exist_ok=True)
    return path


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size() -> int:
    return _runtime.size() if _runtime.is_initialized() else 1


def _rank() -> int:
    return _runtime.rank() if _runtime.is_initialized() else 0


_counter = [0]


class State:
    """Horovod's ``State``: attributes (``state.epoch``, ...), commit, restore, sync, reset
    callbacks. Subclasses say which variables it holds."""

    def __init__(self, **kwargs):
        self._reset_callbacks = []
        self._rerun = False
        self._key = f"state-{_counter[0]}"
        _counter[0] += 1
        self._attrs = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved = None

    # --- what subclasses hold ---
    def _variables(self) -> list:
        return []

    def _prepare(self, payload) -> None:
        """Makes the variables ``payload`` holds exist (e.g. builds the optimizer)."""

    # --- Horovod's API ---
    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp=None, update_res=None):
        """Horovod's host-change notice: tfdp-run never changes a running attempt."""

    def check_host_updates(self):
        """Never raises in tfdp (tfdp-run does not change a running attempt's members)."""

    def _payload(self) -> dict:
        variables = self._variables()
        return {"attrs": {n: copy.deepcopy(getattr(self, n)) for n in self._attrs},
                "values": [np.array(v.numpy()) for v in variables], "size": _size(),
                **self._extra()}

    def _extra(self) -> dict:
        return {}

    def _apply(self, payload) -> None:
        self._prepare(payload)
        variables = self._variables()
        if len(variables) != len(payload["values"]):
            raise ValueError(f"hvd.elastic: the commit holds {len(payload['values'])} "
                             f"variables, the state {len(variables)}: the script must build "
                             "the same model and optimizer in every attempt")
        for v, value in zip(variables, payload["values"]):
            v.assign(value)
        for name, value in payload["attrs"].items():
            setattr(self, name, copy.deepcopy(value))
            self._attrs.setdefault(name, None)

    def save(self):
        """Keeps the current state in memory (what ``restore()`` returns to)."""
        self._saved = self._payload()

    def restore(self):
        """Returns to the last ``save()``/``commit()`` of this process."""
        if self._saved is not None:
            self._apply(self._saved)

    def commit(self):
        """Saves the state and, on rank 0, writes it durably and atomically (the module
        docstring); then ``check_host_updates()``."""
        self.save()
        if _rank() == 0:
            path = os.path.join(commit_dir(), f"{self._key}.pkl")
            _write_atomic(path, pickle.dumps(self._saved, protocol=pickle.HIGHEST_PROTOCOL))
        self.check_host_updates()

    def sync(self):
        """Every rank takes rank 0's state (variables and attributes)."""
        if _size() == 1:
            return
        head = collectives.broadcast_object(
            {"attrs": {n: getattr(self, n) for n in self._attrs}, **self._extra()}, 0)
        self._prepare(head)
        variables = self._variables()
        if variables:
            collectives.broadcast_variables(variables, 0)
        for name, value in head["attrs"].items():
            setattr(self, name, value)
            self._attrs.setdefault(name, None)

    # --- what @run and UpdateBatchStateCallback need (tfdp's, not Horovod's) ---
    def resume_from_commit(self) -> bool:
        """Rank 0 loads the last durable commit; True on every rank when it found one (a
        relaunch). Collective: every rank calls it."""
        found = False
        if _rank() == 0:
            path = os.path.join(commit_dir(), f"{self._key}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    payload = pickle.load(f)
                self._apply(payload)
                found = True
                log.info("hvd.elastic: resuming from the commit in %s (made with %d "
                         "process(es), now %d)", path, payload["size"], _size())
        if _size() > 1:
            found = bool(collectives.broadcast_object(found, 0))
        return found

    def request_rerun(self) -> None:
        """Asks ``@run`` to call the function again once it returns: a resumed partial epoch
        ended early, and Keras 3 cannot shorten an epoch (the module docstring)."""
        self._rerun = True

    def take_rerun_request(self) -> bool:
        """Whether ``request_rerun()`` was called since the last take; clears it."""
        requested, self._rerun = self._rerun, False
        return requested


class ObjectState(State):
    """Horovod's ``ObjectState``: attributes only (pickled)."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__(**kwargs)


class TensorFlowState(State):
    """Horovod's ``TensorFlowState``: ``variables`` and attributes."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise NotImplementedError("hvd.elastic.TensorFlowState(session=...) is "
                                      "TensorFlow 1; pass variables only")
        self.variables = list(variables or [])
        super().__init__(**kwargs)

    def _variables(self):
        return self.variables


class TensorFlowKerasState(State):
    """Horovod's ``TensorFlowKerasState`` (``KerasState``): a Keras model, its optimizer (or
    ``optimizer``), and attributes."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                        None)
        super().__init__(**kwargs)

    def _optimizer(self):
        if self.optimizer is None:
            self.optimizer = getattr(self.model, "optimizer", None)
        return self.optimizer

    def _extra(self):
        optimizer = self._optimizer()
        return {"optimizer_built": bool(optimizer is not None and optimizer.built)}

    def _prepare(self, payload):
        optimizer = self._optimizer()
        if payload.get("optimizer_built") and optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)

    def _variables(self):
        optimizer = self._optimizer()
        built = optimizer if optimizer is not None and optimizer.built else None
        return collectives.model_and_optimizer_variables(self.model, built)


KerasState = TensorFlowKerasState


def run(func):
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` resumes from the last commit on
    every rank (the module docstring); reset callbacks run when it resumed."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        _runtime.initialized_placement()  # hvd.init() first, as Horovod requires
        resumed = state.resume_from_commit()
        state.sync()
        if resumed:
            state.on_reset()
        state.save()
        state.take_rerun_request()  # one left from before this call is not this call's
        while True:
            result = func(state, *args, **kwargs)
            if not state.take_rerun_request():
                return result

    return wrapper


# --- Keras callbacks --------------------------------------------------------------------------

class CommitStateCallback(keras.callbacks.Callback):
    """Commits every ``batches_per_commit`` batches, and at every epoch boundary (after the
    epoch's state updates, whatever the callbacks' order)."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._remaining = self.batches_per_commit
        self._pending = False
        self._done = 0

    def on_train_begin(self, logs=None):
        self._remaining, self._pending = self.batches_per_commit, False

    def on_epoch_begin(self, epoch, logs=None):
        if self._pending:
            self.state.commit()
            self._pending = False
        self._done = int(getattr(self.state, "batch", 0) or 0)

    def on_train_batch_end(self, batch, logs=None):
        self._done += 1
        self._remaining -= 1
        if self._remaining <= 0:
            self._remaining = self.batches_per_commit
            steps = self.params.get("steps") if self.params else None
            if steps and self._done >= steps:
                self._pending = True  # the epoch ends here: committed once it has
            else:
                self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self._pending = True

    def on_train_end(self, logs=None):
        if self._pending:
            self.state.commit()
            self._pending = False


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """``state.batch``: the batches finished in the current epoch; a resumed epoch runs only
    its remaining batches (the module docstring)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._offset = 0
        self._limit = None

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = int(getattr(self.state, "batch", 0) or 0)
        steps = self.params.get("steps") if self.params else None
        self._limit = steps - self._offset if steps and self._offset else None

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        if self._limit is not None and batch + 1 >= self._limit:
            self.model.stop_training = True
            self.state.request_rerun()

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """``state.epoch``: the epochs finished (counted from ``state.epoch`` when ``fit``
    started, so a resumed ``fit(epochs=E - state.epoch)`` continues the count)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = getattr(state, "epoch", 0)

    def on_train_begin(self, logs=None):
        self.initial_epoch = int(getattr(self.state, "epoch", 0) or 0)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


def _forget() -> None:
    global _private_dir
    _private_dir = None
    _counter[0] = 0


process_state.register("horovod elastic", __name__, lambda: (_private_dir, _counter[0]), _forget)
