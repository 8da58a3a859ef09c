# Hidden from the worker processes tests start (tests/launching.py, worker_env): Keras imports
# pandas at its own import when it is installed (about 0.4-0.6 s of CPU per process), and no
# worker script uses it.
raise ImportError("pandas is hidden from test worker processes (tests/launching.py)")
