"""scikit-learn, hidden from Keras's own import in test worker processes and real for the rest.

Keras imports scikit-learn at its import, for its scikit-learn wrappers (``keras.wrappers``),
when it is installed; that costs about 0.7 s of CPU per process (scikit-learn pulls in
scipy.stats), and no worker uses the wrappers. The examples do use scikit-learn (the digits
dataset, the recommender's AUC), so an import from anywhere but Keras's wrappers gets the real
package: this module finds it on ``sys.path`` past tests/hidden_imports and puts it in its
place (a module may replace itself in ``sys.modules`` while it runs; the import returns the
replacement). Keras, told scikit-learn is absent, leaves its wrappers unusable in that process.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HIDDEN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KERAS_WRAPPERS = os.sep.join(("", "keras", "src", "wrappers", ""))


def _imported_by_keras_wrappers():
    frame = sys._getframe(1)
    while frame is not None:
        if _KERAS_WRAPPERS in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


if _imported_by_keras_wrappers():
    raise ImportError("scikit-learn is hidden from Keras's import in test worker processes "
                      "(tests/hidden_imports/sklearn)")

_path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HIDDEN]
_spec = importlib.machinery.PathFinder.find_spec(__name__, _path)
if _spec is None:
    raise ImportError("No module named 'sklearn'", name=__name__)
_real = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _real
try:
    _spec.loader.exec_module(_real)
except BaseException:
    sys.modules.pop(__name__, None)
    raise
