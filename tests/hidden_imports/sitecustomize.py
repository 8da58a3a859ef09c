"""Every process the tests start runs this at start-up (Python's ``site`` imports a
``sitecustomize`` from the path, and tests/hidden_imports is first on the ``PYTHONPATH`` of
every process of the test session: tests/launching.py, HIDDEN_IMPORTS).

It makes the process's exit cheaper, and only that. At the end of a Python process the
interpreter clears every module and runs full garbage collections over what is left; with
TensorFlow imported that heap is a few million objects, and the collections cost 0.7-0.9 s of
CPU per process (measured here: `import tensorflow` then exit, 0.75 s; a process that fit a
model on 2 replicas, 0.8 s; with ``gc.freeze()`` first, 0.05-0.09 s), for a suite that starts a
few hundred processes on 2 cores. ``gc.freeze()`` moves every object alive at that moment out of
the collector's reach, so the final collections have nothing to scan.

It runs last, after everything else the process registered with ``atexit`` (tfdp's orderly
exit, TensorFlow's and Keras's own handlers: ``atexit`` runs the last registered first, and
this is registered before anything else). What changes is only that objects in reference
cycles at exit are not collected, so their ``__del__`` does not run; CPython does not promise it
at exit either. Tests that judge what a process prints at exit (tests/test_orderly_exit.py, the
examples' output) set ``TFDP_TEST_FULL_FINALIZATION=1`` and keep the interpreter's full
finalization, as users' processes have it.
"""

import atexit
import gc
import os

if os.environ.get("TFDP_TEST_FULL_FINALIZATION") != "1":
    atexit.register(gc.freeze)
