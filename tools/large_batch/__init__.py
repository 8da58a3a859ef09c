"""The large-batch study (steps to a target vs batch size, per optimizer), run as
``python tools/large_batch.py``: ``core`` holds the pure rules (no TensorFlow), ``data`` the
datasets, ``train`` one trial, ``sweep`` the loop over trials, ``report`` the tables and plots,
``cli`` the flags and the run."""
