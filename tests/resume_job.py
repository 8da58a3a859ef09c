"""The job of tests/workers/mw_resume_worker.py (tests/test_preemption.py, test_elastic.py): its
command and environment, and what its workers wrote (the steps each ran, final weights)."""

import os

import numpy as np

from launching import tfdp_run_command, worker_env, worker_script

WORKER = worker_script("mw_resume_worker.py")
TIMEOUT = 300  # seconds for one launch, one wait for a file


def environment(out, backup=None, **knobs):
    """The worker's environment: output in ``out``, shuffled input, backups in ``backup``,
    and TFDP_TEST_* ``knobs`` (see the worker's docstring)."""
    env = worker_env(TFDP_TEST_OUT=out, TF_CPP_MIN_LOG_LEVEL=2, TFDP_TEST_SHUFFLE=1)
    if backup is not None:
        env["TFDP_TEST_BACKUP"] = str(backup)
    env.update({k: str(v) for k, v in knobs.items()})
    return env


def launcher(workers=2, cpu_replicas=2, extra=()):
    return tfdp_run_command(WORKER, workers=workers, cpu_replicas=cpu_replicas, flags=extra)


def steps_run(out, slot=0):
    """[(attempt, rank, iteration)] for every step the worker of ``slot`` ran."""
    with open(os.path.join(out, f"steps-slot{slot}.txt")) as f:
        return [tuple(int(v) for v in line.split()[:3]) for line in f if line.strip()]


def weights(out, rank=0):
    saved = np.load(os.path.join(out, f"weights-{rank}.npz"))
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def assert_same_weights(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
