"""The job tests/test_slurm_signals.py submits with submitit: cluster_train.py, run inside
submitit's own process (``python -m submitit.core._submit``), so that submitit's SIGUSR2
handler (checkpoint, ``scontrol requeue``, exit) is the one tfdp's BackupAndRestore finds
when ``fit`` starts and hands the signal to after its backup.

``Train`` is a ``submitit.helpers.Checkpointable``: its ``checkpoint`` resubmits the same call,
which resumes from the backup, so submitit requeues it on a timeout as well as on a
preemption. Submitted by reference: the job's ``PYTHONPATH`` must hold this directory.
Environment knobs: those of cluster_train.py.
"""

import os
import runpy

import submitit

HERE = os.path.dirname(os.path.abspath(__file__))


class Train(submitit.helpers.Checkpointable):
    def __call__(self):
        runpy.run_path(os.path.join(HERE, "cluster_train.py"))
        return "done"
