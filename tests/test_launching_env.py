"""The environment of every process the suite starts (tests/conftest.py gives it to the whole
session, tests/launching.py's worker_env to every job): the packages Keras would import at its
own import and no test uses through Keras stay unimported (tests/hidden_imports), so each of
the suite's few hundred processes starts about 1.5 s of CPU sooner; they are hidden from Keras's
import only, and everyone else (the examples' scikit-learn, the tools' plots) gets the real one."""

import gc
import os
import subprocess
import sys

from launching import HIDDEN_IMPORTS, worker_env

HIDDEN = ("matplotlib", "pandas", "sklearn", "scipy.stats")

PROBE = ("import sys, keras; "
         f"print(sorted(m for m in {HIDDEN!r} if m in sys.modules))")

# What the examples do with scikit-learn (examples/common.py, examples/recommender.py), after
# Keras's import: the real package, while Keras's own wrappers were told it is absent.
EXAMPLE = """
import keras, sklearn
from sklearn.datasets import load_digits
from sklearn.metrics import roc_auc_score
from keras.src.wrappers import fixes
print(sklearn.__file__, load_digits().data.shape, roc_auc_score([0, 1], [0.2, 0.7]),
      fixes.sklearn, sep="|")
"""


# What a tool does with matplotlib and what pandas users do, after Keras's import.
PLOT_AND_FRAME = """
import keras, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt, pandas
from keras.src.trainers.data_adapters import array_slicing
from keras.src.visualization import plot_image_gallery
plt.plot([0, 1]); plt.savefig("plot.png")
print(matplotlib.__file__, pandas.__file__, pandas.DataFrame({"a": [1, 2]}).shape,
      array_slicing.pandas, plot_image_gallery.plt, sep="|")
"""


def run_in_worker_env(code, env=None, cwd=None):
    env = worker_env(TF_CPP_MIN_LOG_LEVEL=3) if env is None else env
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_worker_processes_import_keras_without_the_hidden_packages():
    assert run_in_worker_env(PROBE) == "[]"


def test_any_process_the_session_starts_imports_keras_without_them():
    # This process's own environment, as a test's plain subprocess.run inherits it.
    assert HIDDEN_IMPORTS in os.environ["PYTHONPATH"].split(os.pathsep)
    assert run_in_worker_env(PROBE, env=dict(os.environ)) == "[]"


def test_guard_without_the_stand_ins_keras_imports_them():
    env = dict(os.environ, TFDP_TEST_SHOW_OPTIONAL="1", PYTHONPATH=os.pathsep.join(
        p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p != HIDDEN_IMPORTS))
    assert run_in_worker_env(PROBE, env=env) == str(sorted(HIDDEN))


def test_a_tool_in_a_worker_process_gets_the_real_matplotlib_and_pandas(tmp_path):
    plot, frame, shape, keras_pandas, keras_plt = run_in_worker_env(
        PLOT_AND_FRAME, cwd=tmp_path).split("|")
    assert "hidden_imports" not in plot + frame
    assert plot.endswith("site-packages/matplotlib/__init__.py"), plot
    assert frame.endswith("site-packages/pandas/__init__.py"), frame
    assert (shape, keras_pandas, keras_plt) == ("(2, 1)", "None", "None")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_an_example_in_a_worker_process_gets_the_real_scikit_learn():
    # Guard: with TFDP_TEST_SHOW_OPTIONAL=1 Keras's wrappers see the real package.
    path, shape, auc, keras_sees = run_in_worker_env(EXAMPLE).split("|")
    assert path.endswith("site-packages/sklearn/__init__.py"), path
    assert "hidden_imports" not in path
    assert (shape, auc, keras_sees) == ("(1797, 64)", "1.0", "None")


# A program with an atexit handler of its own and an object in a reference cycle whose
# __del__ only the interpreter's final garbage collection would run.
EXIT = """
import atexit, gc, sys
class Cycle:
    def __del__(self):
        print("cycle collected", flush=True)
c = Cycle(); c.me = c; del c
atexit.register(lambda: print("own handler ran, frozen:", gc.get_freeze_count() > 0, flush=True))
print("sitecustomize" in sys.modules, flush=True)
"""


def test_worker_processes_exit_without_the_final_collections_after_their_own_handlers():
    lines = subprocess.run([sys.executable, "-c", EXIT], env=worker_env(), capture_output=True,
                           text=True, timeout=60).stdout.splitlines()
    # The program's own handler ran, before the freeze; the cycle was left to the OS.
    assert lines == ["True", "own handler ran, frozen: False"], lines


def test_guard_full_finalization_collects_the_cycle_at_exit():
    # TFDP_TEST_FULL_FINALIZATION=1 (tests that judge exit output): the interpreter's exit.
    lines = subprocess.run([sys.executable, "-c", EXIT], capture_output=True, text=True,
                           env=worker_env(TFDP_TEST_FULL_FINALIZATION=1),
                           timeout=60).stdout.splitlines()
    assert lines == ["True", "own handler ran, frozen: False", "cycle collected"], lines


# What the collector does around TensorFlow's import in a process of the session.
GC_AROUND_IMPORT = """
import gc
during = gc.get_threshold()[0]
import tensorflow
print(during, gc.get_threshold(), gc.get_freeze_count() > 100_000, sep="|")
"""


def test_worker_processes_skip_tensorflows_import_in_the_collector_and_freeze_it():
    # While importing: a raised threshold; afterwards Python's own (this process's: it either
    # never ran the stand-in or had them restored), with the imports frozen.
    line = run_in_worker_env(GC_AROUND_IMPORT)
    assert line == f"1000000|{gc.get_threshold()}|True", line


def test_guard_full_finalization_keeps_the_default_collector_throughout():
    line = run_in_worker_env(GC_AROUND_IMPORT, env=worker_env(
        TF_CPP_MIN_LOG_LEVEL=3, TFDP_TEST_FULL_FINALIZATION=1))
    assert line == f"{gc.get_threshold()[0]}|{gc.get_threshold()}|False", line
