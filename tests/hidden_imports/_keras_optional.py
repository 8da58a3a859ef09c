"""Stand-ins that hide an optional package from Keras's own import and give everyone else the
real one.

Keras imports matplotlib (``keras.src.visualization``), pandas (its array data adapters) and
scikit-learn (``keras.wrappers``) at its own import when they are installed, each in a
``try: import ... except ImportError``. Together they cost about 1.5 s of CPU per process
(scikit-learn pulls in scipy.stats), no test or worker uses those Keras features, and the suite
starts a few hundred processes. tests/conftest.py puts tests/hidden_imports first on the
``PYTHONPATH`` of the whole test session (every process a test starts inherits it), so these
stand-ins are found before the real packages:

* an import made by the Keras module that wants the package fails with ImportError, and Keras
  carries on as if the package were absent;
* any other import (a tool's plot, an example's scikit-learn metric, a test) gets the real
  package: the stand-in finds it on ``sys.path`` past tests/hidden_imports and puts it in its
  own place in ``sys.modules`` (a module may replace itself while it runs; the import
  statement returns the replacement, and submodules such as ``matplotlib.pyplot`` are found
  through the real package's ``__path__``).
"""

import importlib.machinery
import importlib.util
import os
import sys

HIDDEN = os.path.dirname(os.path.abspath(__file__))


def _imported_from(directory):
    frame = sys._getframe(2)
    while frame is not None:
        if directory in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def stand_in(name, keras_module):
    """Called by the stand-in package ``name`` as it is imported: refuses the import made from
    Keras's ``keras_module`` (a path under keras/src/), otherwise loads the real package."""
    keras_dir = os.sep.join(("", "keras", "src", *keras_module.split("/"), ""))
    if _imported_from(keras_dir):
        raise ImportError(f"{name} is hidden from Keras's import in the test suite's processes "
                          "(tests/hidden_imports)", name=name)
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != HIDDEN]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        raise ImportError(f"No module named {name!r}", name=name)
    real = importlib.util.module_from_spec(spec)
    sys.modules[name] = real
    try:
        spec.loader.exec_module(real)
    except BaseException:
        sys.modules.pop(name, None)
        raise
