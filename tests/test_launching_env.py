"""The worker environment tests/launching.py gives every job: the packages Keras would import
at its own import and no worker uses stay unimported (tests/hidden_imports), so each of the
suite's few hundred worker processes starts about 2 s of CPU sooner; scikit-learn, which the
examples use, is hidden from Keras's import only."""

import subprocess
import sys

from launching import worker_env

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


def run_in_worker_env(code):
    out = subprocess.run([sys.executable, "-c", code], env=worker_env(TF_CPP_MIN_LOG_LEVEL=3),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_worker_processes_import_keras_without_the_hidden_packages():
    # Guard: with TFDP_TEST_SHOW_OPTIONAL=1 in pytest's environment the list is not empty.
    assert run_in_worker_env(PROBE) == "[]"


def test_an_example_in_a_worker_process_gets_the_real_scikit_learn():
    # Guard: with TFDP_TEST_SHOW_OPTIONAL=1 Keras's wrappers see the real package.
    path, shape, auc, keras_sees = run_in_worker_env(EXAMPLE).split("|")
    assert path.endswith("site-packages/sklearn/__init__.py"), path
    assert "hidden_imports" not in path
    assert (shape, auc, keras_sees) == ("(1797, 64)", "1.0", "None")
