"""The large-batch study's flags and its run: the sweep, the merge and the report
(``python tools/large_batch.py``; the usage is that script's docstring)."""


from __future__ import annotations

import os
import sys
import time
import traceback

from absl import flags, logging as absl_logging

import harness
from large_batch import core
from large_batch import data as large_batch_data

SCRIPT = os.path.join(harness.HERE, "large_batch.py")

FLAGS = flags.FLAGS
flags.DEFINE_enum("dataset", "digits", ["digits", "fashion_mnist"], "Dataset.")
flags.DEFINE_string("data_dir", "", "Directory with the four Fashion-MNIST *-ubyte.gz files "
                    "(default: Keras's cache, then /usr/share/datasets/fashion-mnist, then "
                    "keras.datasets.fashion_mnist.load_data()).")
flags.DEFINE_integer("validation_examples", 0, "Validation examples held out from the training "
                     "split (0: 360 for digits, 5000 for Fashion-MNIST).")
flags.DEFINE_list("hidden", ["128"], "Hidden layer widths of the MLP.")
flags.DEFINE_float("target", 0.0, "Target validation accuracy (0: 0.95 digits, 0.85 Fashion-MNIST).")
flags.DEFINE_list("batch_sizes", ["auto"], "Global batch sizes ('auto': powers of two from 32 to "
                  "the training-set size).")
flags.DEFINE_list("optimizers", ["sgd", "adam", "lars", "lamb"], "Optimizers.")
flags.DEFINE_integer("seeds", 2, "Seeds per learning rate (0..seeds-1).")
flags.DEFINE_list("warmup_fractions", ["0.05"], "Warmup lengths to try, as fractions of the budget.")
flags.DEFINE_float("max_epochs", 0.0, "Budget in epochs per trial (0: 60 digits, 20 Fashion-MNIST).")
flags.DEFINE_integer("max_steps", -1, "Cap on the budget in steps (0: none; -1: 400 digits, "
                     "3000 Fashion-MNIST).")
flags.DEFINE_float("eval_ratio", 2 ** (1 / 6), "Geometric spacing of the evaluation steps.")
flags.DEFINE_float("lr_ratio", 2.0, "Spacing of the learning-rate lattice.")
flags.DEFINE_list("ref_lrs", ["sgd=0.05", "adam=0.001", "lars=2.0", "lamb=0.002"],
                  "Lattice centre per optimizer at --ref_batch.")
flags.DEFINE_integer("ref_batch", 32, "Batch size of --ref_lrs (larger batches start the search "
                     "at the square-root rule).")
flags.DEFINE_integer("lr_initial_points", 3, "First learning-rate grid size per batch size.")
flags.DEFINE_integer("lr_max_points", 6, "Most learning rates tried per batch size.")
flags.DEFINE_float("momentum", 0.9, "SGD and LARS momentum.")
flags.DEFINE_float("trust_coefficient", 0.001, "LARS trust coefficient.")
flags.DEFINE_float("weight_decay", 0.0, "Weight decay (all optimizers; 0: none).")
flags.DEFINE_integer("replicas", 2, "Logical CPU replicas when there is no GPU.")
flags.DEFINE_integer("threads", 0, "TensorFlow intra- and inter-op threads (0: TensorFlow's "
                     "default; 1 to share a machine).")
flags.DEFINE_integer("max_replica_batch", 4096, "Largest batch per replica at once; larger "
                     "batches use gradient accumulation (0: no limit).")
flags.DEFINE_string("out", "", "Output prefix of the report (default: large_batch_<dataset>).")
flags.DEFINE_string("results", "", "Results file, one JSON trial per line (default: {out}.jsonl).")
flags.DEFINE_string("shard", "0/1", "Run shard i of n of the (optimizer, batch, warmup) groups.")
flags.DEFINE_integer("max_trials", 0, "Stop after training this many trials (0: no limit).")
flags.DEFINE_boolean("report_only", False, "Only regenerate the report from --results.")
flags.DEFINE_float("report_target", 0.0, "With --report_only: read the trials at this lower "
                   "target instead of the one they ran for (0: theirs).")
flags.DEFINE_list("merge", [], "Result files to merge into --results (then report).")
flags.DEFINE_boolean("report_every_group", True, "Regenerate the report after every group.")
flags.DEFINE_integer("trials_per_process", 40, "Train at most this many trials per process, then "
                     "continue in a fresh one (TensorFlow keeps ~22 MB per multi-replica trial "
                     "it traced; 0: one process for the whole sweep).")

STOPPED_EARLY = 3
DEFAULTS = {"digits": {"target": 0.95, "max_epochs": 60.0, "max_steps": 400},
            "fashion_mnist": {"target": 0.85, "max_epochs": 20.0, "max_steps": 3000}}


def _paths():
    out = FLAGS.out or f"large_batch_{FLAGS.dataset}"
    return out, FLAGS.results or f"{out}.jsonl"


def _ref_lrs() -> dict:
    ref = {}
    for item in FLAGS.ref_lrs:
        name, _, value = item.partition("=")
        try:
            ref[name] = float(value)
        except ValueError:
            raise core.HarnessError(f"--ref_lrs item {item!r} is not name=float.") from None
    missing = [o for o in FLAGS.optimizers if o not in ref]
    if missing:
        raise core.HarnessError(f"--ref_lrs has no entry for {', '.join(missing)}.")
    return ref


def _batches(n_train: int) -> list[int]:
    if FLAGS.batch_sizes == ["auto"]:
        return [2 ** i for i in range(5, 40) if 2 ** i <= n_train]
    return sorted({int(b) for b in FLAGS.batch_sizes})


def report_from(results: str, out: str) -> int:
    """Writes the report of ``results``; 2 when no trial reached the target."""
    from large_batch import report as large_batch_report

    records = core.read_records(results)
    if not records:
        raise core.HarnessError(f"{results} holds no trials: run a sweep first.")
    if FLAGS.report_target:
        records = core.retarget(records, FLAGS.report_target)
    paths = large_batch_report.write_report(records, out)
    print(f"report from {len(records)} trials in {results}: wrote {', '.join(paths)}", flush=True)
    message = large_batch_report.unreached_message(records)
    if message:
        print(f"large_batch: {message}", file=sys.stderr, flush=True)
        return 2
    return 0


def _report_between_groups(results: str, out: str) -> None:
    """The report after a group; a failure to draw it is printed and the sweep goes on."""
    try:
        report_from(results, out)
    except Exception:  # the trials matter more than an intermediate plot
        traceback.print_exc()
        print("large_batch: the intermediate report failed (above); the sweep continues",
              file=sys.stderr, flush=True)


def _checked_lists():
    warmups = [round(float(w), 6) for w in FLAGS.warmup_fractions]
    if any(not 0 <= w < 1 for w in warmups):
        raise core.HarnessError(f"--warmup_fractions={FLAGS.warmup_fractions}: need 0 <= w < 1.")
    for name in FLAGS.optimizers:
        if name not in ("sgd", "adam", "lars", "lamb"):
            raise core.HarnessError(f"--optimizers: {name!r} is not sgd, adam, lars or lamb.")
    if FLAGS.seeds < 1:
        raise core.HarnessError(f"--seeds={FLAGS.seeds} must be >= 1.")
    return warmups


def run_sweep(out, results) -> int:
    from large_batch import sweep as large_batch_sweep

    warmups = _checked_lists()
    shard = core.parse_shard(FLAGS.shard)
    data = large_batch_data.load(FLAGS.dataset, FLAGS.validation_examples, FLAGS.data_dir)
    defaults = DEFAULTS[FLAGS.dataset]
    setup = large_batch_sweep.build_setup(
        data, hidden=FLAGS.hidden, target=FLAGS.target or defaults["target"],
        max_epochs=FLAGS.max_epochs or defaults["max_epochs"],
        max_steps=defaults["max_steps"] if FLAGS.max_steps < 0 else FLAGS.max_steps,
        eval_ratio=FLAGS.eval_ratio, lr_ratio=FLAGS.lr_ratio, ref_lrs=_ref_lrs(),
        ref_batch=FLAGS.ref_batch, momentum=FLAGS.momentum,
        trust_coefficient=FLAGS.trust_coefficient, weight_decay=FLAGS.weight_decay)
    core.eval_steps(1, setup["eval_ratio"])  # validates the ratio
    groups = core.shard_groups(core.sweep_groups(FLAGS.optimizers, _batches(setup["n_train"]),
                                                 warmups), shard)
    strategy = []

    def train(key):
        from large_batch import train as large_batch_train

        if not strategy:  # TensorFlow starts only when there is something to train
            strategy.append(large_batch_train.configure(FLAGS.replicas, FLAGS.threads))
        return large_batch_train.run_trial(strategy[0], data, setup, key,
                                           max_replica_batch=FLAGS.max_replica_batch,
                                           threads=FLAGS.threads)

    sweep = large_batch_sweep.Sweep(
        setup, results, groups, list(range(FLAGS.seeds)), train,
        initial=FLAGS.lr_initial_points, max_points=FLAGS.lr_max_points,
        max_trials=FLAGS.max_trials,
        on_group_done=(lambda: _report_between_groups(results, out))
        if FLAGS.report_every_group else None,
        log=lambda line: print(line, flush=True))
    finished = sweep.run()
    print(f"trained {sweep.trained} new trial(s) in {(time.time() - sweep.started) / 60:.1f} min; "
          f"{len(sweep.records)} in {results}" + ("" if finished else " (stopped early)"),
          flush=True)
    if not finished:
        return STOPPED_EARLY
    return report_from(results, out) if sweep.records else 0


def run_in_child_processes() -> int:
    """The sweep as a series of child processes of --trials_per_process trials each."""
    import subprocess

    command = harness.command(SCRIPT, *sys.argv[1:],
                              f"--max_trials={FLAGS.trials_per_process}", "--trials_per_process=0")
    children = 0
    while True:
        children += 1
        code = subprocess.call(command)
        if code != STOPPED_EARLY:
            print(f"sweep ran in {children} process(es)", flush=True)
            return code


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    out, results = _paths()
    try:
        if FLAGS.merge:
            lists = [core.read_records(p) for p in [results, *FLAGS.merge]]
            merged, duplicates = core.merge_records(lists)
            core.write_records(results, merged)
            print(f"merged {sum(map(len, lists[1:]))} trials from {len(FLAGS.merge)} file(s) "
                  f"into {results}: {len(merged)} trials, {duplicates} duplicate(s) dropped",
                  flush=True)
            return report_from(results, out)
        if FLAGS.report_only:
            return report_from(results, out)
        core.validate_target(FLAGS.target or DEFAULTS[FLAGS.dataset]["target"])
        _checked_lists()
        if FLAGS.trials_per_process > 0 and not FLAGS.max_trials:
            return run_in_child_processes()
        code = run_sweep(out, results)
        if "tensorflow" in sys.modules:
            # Measured: a process that trained tens of multi-replica trials (hundreds of
            # input-pipeline threads left behind) can hang in interpreter shutdown, every
            # thread in a futex wait. Everything is written and flushed: leave at once.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except (core.HarnessError, large_batch_data.DataUnavailableError) as error:
        print(f"large_batch: {error}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        # After an uncaught exception too (see above): print it and leave at once.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

