"""The sweep loop of the large-batch harness, free of flags and of TensorFlow: it decides which
trials to run from the results file alone (so a rerun continues where a sweep stopped) and
hands each one to a ``train(key) -> record`` function."""

from __future__ import annotations

import time

from large_batch import core


def build_setup(data, *, hidden, target, max_epochs, max_steps, eval_ratio, lr_ratio, ref_lrs,
                ref_batch, momentum, trust_coefficient, weight_decay) -> dict:
    """Everything besides the trial key that changes a trial's result (stored in every record;
    a results file holds one setup)."""
    return {"dataset": data.name, "n_train": len(data.x_train), "n_val": len(data.x_val),
            "features": data.features, "classes": data.classes,
            "hidden": [int(h) for h in hidden], "target": core.validate_target(target),
            "max_epochs": float(max_epochs), "max_steps": int(max_steps),
            "eval_ratio": round(float(eval_ratio), 6), "lr_ratio": float(lr_ratio),
            "ref_lrs": {k: float(v) for k, v in ref_lrs.items()}, "ref_batch": int(ref_batch),
            "momentum": float(momentum), "trust_coefficient": float(trust_coefficient),
            "weight_decay": float(weight_decay), "schedule": "warmup_cosine",
            "format": core.FORMAT_VERSION}


class Sweep:
    """Runs the learning-rate search of every group, appending each finished trial to the
    results file.

    Args:
        setup: ``build_setup``'s dict; the results file must hold only this setup.
        results: path of the results file (JSON lines).
        groups: (optimizer, batch, warmup) tuples, in order (``core.sweep_groups``, sharded).
        seeds: seeds per learning rate.
        train: ``train(key) -> record`` for a ``core.trial_key``.
        initial, max_points: the learning-rate search's first grid size and limit.
        max_trials: stop after training this many (0: no limit).
        on_group_done: called with no argument after a group in which something was trained.
        log: progress printer.
    """

    def __init__(self, setup, results, groups, seeds, train, *, initial=3, max_points=6,
                 max_trials=0, on_group_done=None, log=print):
        core.next_lr_indices({}, 0, initial, max_points)  # validates the search sizes
        if not seeds:
            raise core.HarnessError("need at least one seed.")
        self.setup, self.results, self.groups = setup, results, list(groups)
        self.seeds, self.train = list(seeds), train
        self.initial, self.max_points, self.max_trials = initial, max_points, max_trials
        self.on_group_done, self.log = on_group_done, log
        self.records = core.read_records(results)
        core.check_setup(self.records, setup, results)
        self.trained = 0
        self.started = time.time()

    def _group_records(self, group):
        return [r for r in self.records if (r["optimizer"], r["batch"], r["warmup"]) == group]

    def pending(self, group) -> list[tuple]:
        """Trial keys the search of ``group`` needs next (none: the group is finished)."""
        opt, batch, warmup = group
        start = core.start_index(batch, self.setup["ref_batch"], self.setup["lr_ratio"])
        scores = core.group_scores(self._group_records(group), self.seeds)
        indices = core.next_lr_indices(scores, start, self.initial, self.max_points)
        have = {core.record_key(r) for r in self.records}
        keys = [core.trial_key(opt, batch, warmup, i, s) for i in indices for s in self.seeds]
        return [k for k in keys if k not in have]

    def _run_one(self, key, where):
        record = self.train(key)
        core.append_record(self.results, record)
        self.records.append(record)
        self.trained += 1
        outcome = (f"reached at step {record['steps_to_target']}" if record["status"] == "reached"
                   else f"{record['status']} (best {record['best_accuracy']:.3f})")
        self.log(f"[{(time.time() - self.started) / 60:6.1f} min] trial {self.trained} ({where}) "
                 f"{key[0]} batch {key[1]} lr {record['lr']:.4g} seed {key[4]}: {outcome} of "
                 f"{record['budget_steps']} budget steps in {record['seconds']:.1f} s")

    def run(self) -> bool:
        """Runs every group's search to its end; False when ``max_trials`` stopped it first."""
        groups = [(o, b, round(w, 6)) for o, b, w in self.groups]
        in_file = sum(1 for r in self.records
                      if (r["optimizer"], r["batch"], r["warmup"]) in set(groups))
        n = len(groups)
        self.log(f"sweep: {n} (optimizer, batch, warmup) groups, {len(self.seeds)} seed(s): "
                 f"{n * self.initial * len(self.seeds)} to {n * self.max_points * len(self.seeds)} "
                 f"trials; {in_file} already in {self.results}")
        for number, group in enumerate(groups, 1):
            trained_before = self.trained
            while True:
                keys = self.pending(group)
                if not keys:
                    break
                for key in keys:
                    if self.max_trials and self.trained >= self.max_trials:
                        self.log(f"stopped after {self.trained} trials (max_trials); rerun the "
                                 "same command to continue")
                        return False
                    self._run_one(key, f"group {number}/{n}")
            if self.on_group_done and self.trained > trained_before:
                self.on_group_done()
        return True
