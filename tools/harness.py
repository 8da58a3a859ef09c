"""What the tools share: the ``--child`` pattern (a tool re-runs its own script in a fresh
process, through ``tfdp-run`` where it needs workers, and reads back the JSON its child
prints), interleaved rounds, and the report (Markdown, CSV, matplotlib figure; CPU time from
/proc). Importing it puts tools/ on sys.path and quiets TensorFlow's C++ log before any tool
imports TensorFlow."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # tests import tools beside each other, not through this folder
    sys.path.insert(0, HERE)


# --- the child process -------------------------------------------------------------------

def define_flags(flag_values=None, **specs) -> None:
    """The flags most tools have, each ``name=default`` (the help below) or
    ``name=(default, help)``; the flag's type is its default's. ``child`` takes only its help:
    its default is empty, which means the parent."""
    from absl import flags
    defines = {bool: flags.DEFINE_boolean, int: flags.DEFINE_integer,
               float: flags.DEFINE_float, str: flags.DEFINE_string, list: flags.DEFINE_list}
    for name, spec in specs.items():
        default, help_text = spec if isinstance(spec, tuple) else (spec, COMMON_HELP.get(name))
        if name == "child":
            default, help_text = "", "Internal: " + spec
        defines[type(default)](name, default, help_text, flag_values=flag_values or flags.FLAGS)


COMMON_HELP = {
    "rounds": "Interleaved rounds (each configuration once per round).",
    "out": "Output prefix ('' to skip writing).",
}


def forward(flag_values, *names) -> list[str]:
    """``--name=value`` for each named flag, as the parent passes its own settings on."""
    args = []
    for name in names:
        value = flag_values[name].value
        args.append(f"--{name}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return args


def command(script: str, *args, workers: int = 0, cpu_replicas=None, launcher=()) -> list[str]:
    """The command that re-runs ``script`` with ``args``; with ``workers`` under
    ``python -m tfdp.run`` (``launcher``: its further options, before ``--``)."""
    cmd = [sys.executable, os.path.abspath(script), *args]
    if not workers:
        return cmd
    run = [sys.executable, "-m", "tfdp.run", "--workers", str(workers)]
    if cpu_replicas is not None:
        run += ["--cpu-replicas", str(cpu_replicas)]
    return run + list(launcher) + ["--"] + cmd


def child_env(*path_first: str) -> dict:
    """This environment for a child, without the parent's TF_CONFIG (a launcher writes each
    worker's own) and with ``path_first`` ahead on PYTHONPATH."""
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    if path_first:
        env["PYTHONPATH"] = os.pathsep.join([*path_first, env.get("PYTHONPATH", "")])
    return env


def results(text: str, prefix: str = "RESULT ") -> list[dict]:
    """The JSON objects printed after ``prefix`` (anywhere in a line: tfdp-run prefixes the
    workers' lines); with ``prefix=""`` the lines that are a JSON object. A line that only
    looks like one (a Python dict in a log) is passed over."""
    found = []
    for line in text.splitlines():
        if prefix and prefix in line:
            line = line.split(prefix, 1)[1]
        elif prefix or not line.startswith("{"):
            continue
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` to its end with its output captured as text."""
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def tail(text: str, lines: int, sep: str = "\n") -> str:
    return sep.join(text.strip().splitlines()[-lines:])


def worktree(path: str, commit: str) -> str:
    """A detached git worktree of ``commit`` at ``path`` (made once): an older tfdp to compare."""
    if not os.path.isdir(os.path.join(path, "tfdp")):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit],
                       check=True, capture_output=True)
    return path


def pin_to_one_core() -> None:
    """Worker i of TF_CONFIG on core i (mod the cores), before TensorFlow sizes its pools."""
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[index % len(cores)]})


def vm_hwm_bytes() -> int:
    """This process's peak resident memory (VmHWM), in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def timer(keras, times: list, per: str = "batch", after=None):
    """A Keras callback appending each training batch's (or epoch's) wall time in seconds to
    ``times``; ``after(index, logs)`` runs after each append."""
    import time

    class Timer(keras.callbacks.Callback):
        def _begin(self, index, logs=None):
            self.start = time.perf_counter()

        def _end(self, index, logs=None):
            times.append(time.perf_counter() - self.start)
            if after:
                after(index, logs)

    setattr(Timer, f"on_{'train_batch' if per == 'batch' else 'epoch'}_begin", Timer._begin)
    setattr(Timer, f"on_{'train_batch' if per == 'batch' else 'epoch'}_end", Timer._end)
    return Timer()


# --- interleaved rounds ------------------------------------------------------------------

def interleaved(keys, rounds: int, measure, describe=None, rotate: bool = False) -> list:
    """``measure(*key)`` for every key, once a round, the keys in turn (A, B, A, B...), so that
    a slow spell of a shared host falls on all of them; with ``rotate`` each round starts one
    key later, so that no key always follows the same one. Returns (round from 0, key, result)
    in the order run; ``describe(key, result)`` is printed after each as
    ``round i/n <description>``."""
    keys, runs = list(keys), []
    for index in range(rounds):
        shift = index % len(keys) if rotate and keys else 0
        for key in keys[shift:] + keys[:shift]:
            result = measure(*key) if isinstance(key, tuple) else measure(key)
            runs.append((index, key, result))
            if describe:
                print(f"round {index + 1}/{rounds} {describe(key, result)}", flush=True)
    return runs


def by_key(runs) -> dict:
    """key -> its results in round order, from what ``interleaved`` returns."""
    grouped = {}
    for _, key, result in runs:
        grouped.setdefault(key, []).append(result)
    return grouped


def read_jsonl(path: str) -> list[dict]:
    """The records of a results file, one JSON object a line (none where there is no file)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_jsonl(path: str, record: dict) -> None:
    """One record more at the end of a results file: a run that stops keeps what it measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# --- the report --------------------------------------------------------------------------

def write_csv(path: str, rows: list[dict]) -> None:
    """Writes ``rows`` (dicts with the same keys) to ``path``, creating its directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def cpu_seconds(stat_path: str) -> float | None:
    """User + system CPU seconds from a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat``
    file; None where it cannot be read (the process or thread has ended)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend (the tools run headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def label_axes(ax, xlabel=None, ylabel=None, title=None, *, log2_x=False, legend=None):
    """The labels most of the tools' plots set; ``legend``: None for none, else its keywords."""
    if log2_x:
        ax.set_xscale("log", base=2)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if legend is not None:
        ax.legend(**legend)


def write_report(out: str, text: str, rows=None, plot=None, figsize=(6, 3.2)) -> None:
    """``out``.md from ``text``, ``out``.csv from ``rows`` and ``out``.png from ``plot(ax)``
    (each where given), the set of files most tools write."""
    write_text(out + ".md", text)
    if rows:
        write_csv(out + ".csv", rows)
    if plot:
        fig, ax = pyplot().subplots(figsize=figsize)
        plot(ax)
        save_figure(fig, out + ".png")
