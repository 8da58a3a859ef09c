"""Soak: runs multi-worker jobs many times under load and counts the ones that hang.

An intermittent hang shows in one run out of ten or a hundred, under load, and never when
a test runs once on a quiet host. This tool runs each job of a list ``--runs`` times, one after
another, while ``--busy`` processes spin on the CPU, each run bounded by ``--timeout``. A run is

* ``ended``: exit 0 and its check passed (the trained weights equal one device's where the
  job has a check);
* ``failed``: a non-zero exit, or a check that did not pass (the reason is kept);
* ``hung``: still running at ``--timeout``: every one of its processes' Python stacks
  (py-spy) is written to ``OUT/<job>-<run>.stacks.txt`` before the job is killed.

Jobs (``--jobs``):

* ``hvd_fit``: Horovod's Keras fit idiom under ``tfdp-run -np 2`` (issue 40, hang 1:
  tests/workers/hvd_keras_fit.py); check: every rank's final weights equal one process's fit
  from the broadcast start (1e-5, the suite's bound for it).
* ``rebuild``: a strategy rebuilt round after round in one process on 2 workers x 4 replicas
  (issue 40, hang 2: tests/workers/mw_rebuild.py, ShardedOptimizer, BackupAndRestore,
  StragglerMonitor); check: every round of every rank equals one device (1e-6).
* ``readme``: the README's ``tfdp-run --workers 2 --cpu-replicas 2 -- python
  examples/multi_worker.py``.
* ``hvd_keras``, ``hvd_synthetic``: the Horovod examples under ``tfdp-run -np 2``.
* ``zero3``: ZeRO-3 on 2 workers x 2 replicas (issue 57's hang report:
  tests/workers/mw_zero3_mlp.py, a 16-64-64-4 MLP with Adam, 2 epochs of 8 steps, the chief's
  save served by the other worker); check: both workers' final weights and the chief's saved
  model equal one device's (1e-5).

Output: a table per job, OUT/soak.json, OUT/soak.png (runs per outcome and job, and each run's
duration). Processes are killed by process group (each job runs in a session of its own),
never by name.

Example:
    python tools/soak_jobs.py --jobs=hvd_fit,rebuild --runs=30 --busy=1 --out=/tmp/soak
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
WORKERS = os.path.join(TESTS, "workers")

OUTCOMES = ("ended", "failed", "hung")
LOCAL_BATCH = 8  # hvd_fit's per-rank batch (tests/test_horovod.py's)


# --- pure pieces ---------------------------------------------------------------------------

def summarize(results: list[dict]) -> dict:
    """Counts per job and outcome: ``{job: {"ended": n, "failed": n, "hung": n, "runs": n,
    "seconds": [durations of the ended runs]}}``."""
    table: dict = {}
    for r in results:
        row = table.setdefault(r["job"], {**{o: 0 for o in OUTCOMES}, "runs": 0, "seconds": []})
        row[r["outcome"]] += 1
        row["runs"] += 1
        if r["outcome"] == "ended":
            row["seconds"].append(r["seconds"])
    return table


def outcome_of(code, timed_out: bool, check_error: str | None) -> str:
    """A run's outcome from its exit code, whether it ran past the timeout and its check."""
    if timed_out:
        return "hung"
    if code != 0 or check_error:
        return "failed"
    return "ended"


# --- the jobs ------------------------------------------------------------------------------

def _tfdp_run(*args):
    return [sys.executable, "-m", "tfdp.run", *args]


def _job_env(out, **extra):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, ROOT] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(TFDP_TEST_OUT=out, TF_CPP_MIN_LOG_LEVEL="2")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _check_hvd_fit(out):
    import numpy as np

    sys.path.insert(0, TESTS)
    import keras
    import tensorflow as tf
    from helpers import classification_data, mlp

    def weights(saved, prefix):
        return [saved[f"{prefix}{k}"] for k in range(sum(1 for n in saved.files
                                                         if n.startswith(prefix)))]

    ranks = [np.load(os.path.join(out, f"fit-{r}.npz")) for r in range(2)]
    x, y = classification_data(n=96)
    reference = mlp()
    reference.set_weights(weights(ranks[0], "init_"))  # BroadcastGlobalVariablesCallback(0)
    reference.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # The ranks' .shard(2, rank).batch(8) batches at each step: contiguous global batches of 16.
    reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * LOCAL_BATCH), epochs=2,
                  verbose=0)
    for rank, saved in enumerate(ranks):
        for k, (a, b) in enumerate(zip(weights(saved, "final_"), reference.get_weights())):
            gap = float(np.max(np.abs(a - b)))
            if gap > 1e-5:
                return f"rank {rank} weight {k} is {gap:.2e} off one process"
    return None


_rebuild_reference: list = []


def _check_rebuild(out, rounds):
    import numpy as np

    sys.path.insert(0, TESTS)
    if not _rebuild_reference:
        import keras
        from helpers import classification_data, initial_weights, mlp, train
        x, y = classification_data(n=128)
        model, _ = train(None, mlp, lambda: keras.optimizers.Adam(0.01), x, y, 32, epochs=1,
                         weights=initial_weights(mlp))
        _rebuild_reference.extend(model.get_weights())
    for k in range(rounds):
        for r in range(2):
            saved = np.load(os.path.join(out, f"round{k}-{r}.npz"))
            for i, want in enumerate(_rebuild_reference):
                gap = float(np.max(np.abs(saved[f"arr_{i}"] - want)))
                if gap > 1e-6:
                    return f"round {k} rank {r} weight {i} is {gap:.2e} off one device"
    return None


_zero3_reference: list = []


def _check_zero3(out):
    import numpy as np

    sys.path.insert(0, WORKERS)
    import keras
    import mw_zero3_mlp

    if not _zero3_reference:
        _zero3_reference.extend(mw_zero3_mlp.one_device())
    saved = {f"rank {r}": [np.load(os.path.join(out, f"weights-{r}.npz"))[f"arr_{i}"]
                           for i in range(len(_zero3_reference))] for r in range(2)}
    saved["the chief's save"] = keras.saving.load_model(
        os.path.join(out, "model.keras")).get_weights()
    for who, weights in saved.items():
        for i, (a, b) in enumerate(zip(weights, _zero3_reference)):
            gap = float(np.max(np.abs(a - b)))
            if gap > 1e-5:
                return f"{who}: weight {i} is {gap:.2e} off one device"
    return None


def job(name, out, rebuild_rounds):
    """(command, environment, check) of job ``name`` writing into ``out``."""
    if name == "hvd_fit":
        return (_tfdp_run("--workers", "2", "--output", "all", "--", sys.executable,
                          os.path.join(WORKERS, "hvd_keras_fit.py")),
                _job_env(out, HVD_LOCAL_BATCH=LOCAL_BATCH, HVD_EPOCHS=2),
                lambda: _check_hvd_fit(out))
    if name == "rebuild":
        return (_tfdp_run("--workers", "2", "--cpu-replicas", "4", "--output", "all", "--",
                          sys.executable, os.path.join(WORKERS, "mw_rebuild.py")),
                _job_env(out, TFDP_TEST_ROUNDS=rebuild_rounds, TFDP_TEST_EPOCHS=1),
                lambda: _check_rebuild(out, rebuild_rounds))
    if name == "readme":
        return (_tfdp_run("--workers", "2", "--cpu-replicas", "2", "--", sys.executable,
                          os.path.join(ROOT, "examples", "multi_worker.py"), "--epochs", "1",
                          "--model_dir", out), _job_env(out), lambda: None)
    if name == "hvd_keras":
        return (_tfdp_run("-np", "2", "--", sys.executable,
                          os.path.join(ROOT, "examples", "horovod_keras.py"), "--epochs", "2",
                          "--warmup_epochs", "1", "--checkpoint_dir", out),
                _job_env(out), lambda: None)
    if name == "hvd_synthetic":
        return (_tfdp_run("-np", "2", "--", sys.executable,
                          os.path.join(ROOT, "examples", "horovod_synthetic_benchmark.py"),
                          "--num_iters", "2", "--num_batches_per_iter", "2"),
                _job_env(out), lambda: None)
    if name == "zero3":
        return (_tfdp_run("--workers", "2", "--cpu-replicas", "2", "--output", "all", "--",
                          sys.executable, os.path.join(WORKERS, "mw_zero3_mlp.py")),
                _job_env(out), lambda: _check_zero3(out))
    raise ValueError(f"unknown job {name!r}: one of hvd_fit, rebuild, readme, hvd_keras, "
                     "hvd_synthetic, zero3")


# --- running -------------------------------------------------------------------------------

def start_busy(count):
    """``count`` processes that spin on the CPU (the load); killed by pid in stop_busy."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(count)]


def stop_busy(procs):
    for p in procs:
        p.kill()
        p.wait()


def run_once(name, index, out_dir, timeout, rebuild_rounds):
    out = tempfile.mkdtemp(prefix=f"{name}-{index}-", dir=out_dir)
    cmd, env, check = job(name, out, rebuild_rounds)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        sys.path.insert(0, TESTS)
        from launching import stacks_of
        with open(os.path.join(out_dir, f"{name}-{index}.stacks.txt"), "w") as f:
            f.write(stacks_of(proc.pid, env))
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - start
    with open(os.path.join(out, "output.txt"), "w") as f:
        f.write(output or "")
    error = None
    if not timed_out and proc.returncode == 0:
        try:
            error = check()
        except Exception as e:  # a check that cannot run is a failed run
            error = f"check failed: {type(e).__name__}: {e}"
    elif not timed_out:
        error = f"exit {proc.returncode}: {(output or '')[-300:]!r}"
    return {"job": name, "run": index, "outcome": outcome_of(proc.returncode, timed_out, error),
            "seconds": seconds, "error": error, "dir": out}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarize(results)
    jobs = sorted(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0] * len(jobs)
    for outcome, color in zip(OUTCOMES, ("tab:green", "tab:orange", "tab:red")):
        counts = [table[j][outcome] for j in jobs]
        left.bar(jobs, counts, bottom=bottom, label=outcome, color=color)
        bottom = [b + c for b, c in zip(bottom, counts)]
    left.set_ylabel("runs")
    left.legend()
    left.set_title("outcome per job")
    for j in jobs:
        runs = [r for r in results if r["job"] == j]
        right.plot([r["run"] for r in runs], [r["seconds"] for r in runs], "o-", label=j)
    right.set_xlabel("run")
    right.set_ylabel("seconds")
    right.set_title("duration of each run")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv):
    del argv
    f = flags.FLAGS
    os.makedirs(f.out, exist_ok=True)
    names = [n for n in f.jobs.split(",") if n]
    for n in names:
        job(n, f.out, f.rebuild_rounds)  # unknown names fail before any run
    busy = start_busy(f.busy)
    results = []
    try:
        for index in range(f.runs):
            for name in names:
                r = run_once(name, index, f.out, f.timeout, f.rebuild_rounds)
                results.append(r)
                print(f"[{len(results)}/{f.runs * len(names)}] {name} run {index}: "
                      f"{r['outcome']} in {r['seconds']:.1f} s"
                      + (f" ({r['error'][:200]})" if r["error"] else ""), flush=True)
    finally:
        stop_busy(busy)
    table = summarize(results)
    print(f"\n{'job':<15}{'runs':>6}{'ended':>7}{'failed':>8}{'hung':>6}  seconds (ended: "
          "min / median / max)")
    for name, row in sorted(table.items()):
        s = sorted(row["seconds"])
        spread = f"{s[0]:.1f} / {s[len(s) // 2]:.1f} / {s[-1]:.1f}" if s else "-"
        print(f"{name:<15}{row['runs']:>6}{row['ended']:>7}{row['failed']:>8}{row['hung']:>6}"
              f"  {spread}")
    with open(os.path.join(f.out, "soak.json"), "w") as out:
        json.dump({"busy": f.busy, "timeout": f.timeout, "results": results}, out, indent=1)
    plot(results, os.path.join(f.out, "soak.png"))
    print(f"wrote {os.path.join(f.out, 'soak.json')} and soak.png")
    hung = [r for r in results if r["outcome"] == "hung"]
    for r in hung:
        print(f"hung: {r['job']} run {r['run']}: stacks in "
              f"{os.path.join(f.out, r['job'] + '-' + str(r['run']) + '.stacks.txt')}")


if __name__ == "__main__":
    flags.DEFINE_string("jobs", "hvd_fit,rebuild", "comma-separated jobs (module docstring)")
    flags.DEFINE_integer("runs", 30, "runs of each job")
    flags.DEFINE_integer("busy", 1, "processes spinning on the CPU during the soak (the load)")
    flags.DEFINE_float("timeout", 240.0, "seconds before a run counts as hung")
    flags.DEFINE_integer("rebuild_rounds", 6, "rounds of the rebuild job")
    flags.DEFINE_string("out", "/tmp/tfdp-soak", "output directory")
    app.run(main)
