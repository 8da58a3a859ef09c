"""Large-batch experiments: steps to a target validation accuracy vs batch size, per optimizer
(SGD with momentum, Adam, LARS, LAMB), learning rate tuned per batch size, several seeds,
every trial trained under tfdp.DataParallelStrategy (Shallue et al. 2018's measurement).

    python tools/large_batch.py                       # digits, tiny; writes ./large_batch_digits*
    python tools/large_batch.py --dataset=fashion_mnist --out=docs/large_batch \\
        --batch_sizes=32,64,128,256,512,1024,2048,4096,8192 --threads=1
    python tools/large_batch.py --out=docs/large_batch --report_only   # tables/plots only
    python tools/large_batch.py --shard=1/2 --results=b.jsonl ...      # half the groups
    python tools/large_batch.py --merge=a.jsonl,b.jsonl --results=all.jsonl

Every trial is one JSON line of the results file (``--results``, default ``{out}.jsonl``),
written when it finishes. A rerun with the same flags skips the trials already there, so an
interrupted sweep continues where it stopped; ``--shard=i/n`` runs every n-th (optimizer, batch,
warmup) group, and ``--merge`` unites result files (one record per trial). The report (``{out}.md``
generated section, ``{out}.csv``, ``{out}_steps.png``, ``{out}_compare.png``, ``{out}_lr.png``) is
regenerated from the results file alone. The rules (budget, evaluation schedule, learning-rate
search, regions) are in tools/large_batch/core.py's docstring; data in large_batch/data.py;
training in large_batch/train.py; the flags and the run in large_batch/cli.py.

Exit status: 0; 1 for bad flags, files or a target the untrained model already meets; 2 when
no trial reached the target (the trials stay in the results file); 3 when --max_trials stopped
the sweep with trials left (rerun to continue). With --trials_per_process=N (default 40) the
sweep runs in a series of child processes of N trials each (a multi-replica TensorFlow process
does not give back the memory of the functions it traced).
"""

import os
import sys

from absl import app

# tools/ and the repository (for tfdp) on the path: the package beside this script wins
# over the script itself for ``import large_batch``.
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from large_batch import cli  # noqa: E402 (after the path it needs)

if __name__ == "__main__":
    app.run(cli.main)
