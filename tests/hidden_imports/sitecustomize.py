"""Every process the tests start runs this at start-up (Python's ``site`` imports a
``sitecustomize`` from the path, and tests/hidden_imports is first on the ``PYTHONPATH`` of
every process of the test session: tests/launching.py, HIDDEN_IMPORTS).

It makes the garbage collector skip TensorFlow's import, and only that. A process that imports
TensorFlow creates about 290,000 objects that live as long as the process; with Python's default
thresholds the collector runs about 600 times during that import (5 full collections) and scans
them again and again afterwards. Measured here (gc.callbacks), a process that imports
TensorFlow and fits an MLP on 2 replicas spent 0.81 s of its 5.7 s of CPU in the collector; with
this, 0.01 s. The suite starts a few hundred such processes on 2 cores.

1. At start-up the collector's first threshold is raised (1,000,000 allocations), so it does
   not run during the imports.
2. When ``tensorflow`` has been imported, the default thresholds are restored and
   ``gc.freeze()`` moves every object alive at that moment (the interpreter's, TensorFlow's,
   Keras's modules and what they hold) out of the collector's reach, as CPython's
   documentation suggests for a process's long-lived start-up state: later collections scan
   only what the program creates afterwards. What changes: the few cycles the imports leave
   unreachable (about 1,500 objects) are not collected. A process that never imports
   TensorFlow (the launcher, helper scripts) keeps the raised threshold for its short life.
3. At exit, ``gc.freeze()`` runs last, after everything else the process registered with
   ``atexit`` (tfdp's orderly exit, TensorFlow's and Keras's own handlers: ``atexit`` runs the
   last registered first, and this is registered before anything else). The interpreter's
   final collections then have nothing to scan: 0.7-0.9 s of CPU per process with TensorFlow
   imported (measured: `import tensorflow` then exit, 0.75 s; a process that fit a model on 2
   replicas, 0.8 s; with ``gc.freeze()`` first, 0.05-0.09 s). What changes is only that
   objects in reference cycles at exit are not collected, so their ``__del__`` does not run;
   CPython does not promise it at exit either.

Tests that judge what a process prints (tests/test_orderly_exit.py, the examples' output) set
``TFDP_TEST_FULL_FINALIZATION=1`` and keep the interpreter's default collection throughout, as
users' processes have it. tests/test_launching_env.py pins all three, with that as the guard.
"""

import atexit
import gc
import os
import sys

if os.environ.get("TFDP_TEST_FULL_FINALIZATION") != "1":
    import importlib.abc
    import importlib.machinery

    _DEFAULT_THRESHOLDS = gc.get_threshold()

    class _FreezeAfterTensorflow(importlib.abc.MetaPathFinder):
        """Finds ``tensorflow`` as Python would, and has its loader restore the collector's
        thresholds and freeze what is alive once the package has been executed."""

        def find_spec(self, name, path, target=None):
            if name != "tensorflow":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                gc.set_threshold(*_DEFAULT_THRESHOLDS)
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                try:
                    execute(module)
                finally:
                    gc.set_threshold(*_DEFAULT_THRESHOLDS)
                    gc.freeze()

            spec.loader.exec_module = exec_module
            return spec

    gc.set_threshold(1_000_000, *_DEFAULT_THRESHOLDS[1:])
    sys.meta_path.insert(0, _FreezeAfterTensorflow())
    atexit.register(gc.freeze)
