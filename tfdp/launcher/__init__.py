"""tfdp-run, the launcher: one module per mechanism, pure Python (no TensorFlow).

* ``cli``: the command line and the supervision loop (start an attempt, watch it, act on the
  policy's decision). ``tfdp-run`` and ``python -m tfdp.run`` enter here.
* ``arguments``: the flags, their checks and defaults (``parse_args``).
* ``policy``: the pure restart and membership rule (``decide``): what happened -> what to do.
* ``processes``: starting and stopping worker processes, local or over ssh, and their logs.
* ``hosts``: ``--hosts``/``--hostfile`` parsing, slots, the address each worker binds.
* ``remote``: what runs on the far side of ssh (the remote wrapper that ties a worker's life
  to its ssh connection).
* ``horovodrun``: horovodrun's flags translated to tfdp-run's (pure): ``tfdp-run -np 4 -H
  a:2,b:2 python train.py`` keeps a Horovod job's command line.

The launcher <-> worker protocol (environment variables, control files, exit codes) has one
home, ``tfdp.protocol``, which both sides import.
"""
