"""Pure pieces of the large-batch harness (tools/large_batch.py): no TensorFlow here.

The question (Shallue et al. 2018): how many training steps does it take to reach a target
validation accuracy, as a function of the batch size, with the learning rate tuned for every
batch size? One rule per mechanism:

- **Budget.** A trial at batch ``B`` may take ``budget_steps(B) = min(ceil(max_epochs * N / B),
  max_steps)`` optimizer updates (``N`` training examples; ``max_steps`` 0 = no cap). The
  learning-rate schedule warms up over ``round(warmup_fraction * budget)`` steps and then decays
  (cosine) to 0 at the end of the budget, so every batch size gets the same schedule shape.
- **Evaluation schedule.** The validation accuracy is measured at step 0 and at the steps
  ``round(ratio**i)`` (geometric spacing, ``eval_steps``) and at the end of the budget. The
  steps to target of a trial is the first evaluated step whose accuracy is >= the target
  (``steps_to_target``): an upper bound on the first crossing, at most a factor ``ratio`` above it.
  A trial that has not reached the target at the end of its budget records ``None``.
- **Divergence.** A trial stops as ``"diverged"`` when its training loss is not finite, or when
  its validation accuracy is at most ``1/classes + 0.02`` at three evaluations in a row after
  ``max(warmup, budget/10)`` steps (``diverged``).
- **Score of a learning rate.** For one (optimizer, batch, warmup, learning rate) the score is the
  median over seeds of the steps to target (``inf`` for a seed that missed), ties and misses
  ordered by the median of the best accuracy seen (``score``): lower is better.
- **Learning-rate search.** Learning rates lie on a lattice ``ref_lr * lr_ratio**k`` (``k`` an
  integer). For each (optimizer, batch, warmup) the search starts at the lattice point nearest
  to the square-root rule from the reference batch (``start_index``), evaluates a first grid of
  ``initial`` points around it, then extends the grid one point past whichever end holds the best
  score until the best point has an evaluated neighbour on each side (it is bracketed) or
  ``max_points`` points were tried (``next_lr_indices``). A best point at the end of its grid is
  reported as not bracketed.
- **Regions.** Between consecutive evaluated batch sizes the local log-log slope of the best
  median steps is ``s = log(S2/S1) / log(B2/B1)`` (``regions``): ``s <= -0.75`` is perfect
  scaling (a doubling cuts the steps by at least 1.68x), ``s >= -0.25`` is maximal data
  parallelism (a doubling cuts them by less than 16%, or not at all), anything between is
  diminishing returns. A segment whose larger batch missed the target is ``"unreached"``.
  Local slopes follow the noise of single points, so the regions are also read off a fit of
  McCandlish et al.'s (2018) model ``S(B) = S_min * (1 + B_crit / B)`` (``fit_critical_batch``:
  least squares on log steps): its slope ``-B_crit / (B + B_crit)`` crosses the same thresholds at
  ``B_crit / 3`` (perfect scaling below) and ``3 * B_crit`` (maximal data parallelism above).
- **Learning-rate rules.** The best learning rates are compared with the linear rule
  (``lr ∝ B``, Goyal et al.) and the square-root rule (``lr ∝ √B``), both through the smallest
  batch's best rate, and summarised by the least-squares exponent of ``lr ∝ B^a``
  (``power_law_exponent``).
- **Records.** One trial = one JSON line (``trial_key`` identifies it; ``setup`` holds everything
  else that changes its result). A sweep skips every trial whose key is in its results file, so
  an interrupted sweep continues where it stopped; ``merge_records`` de-duplicates several files;
  groups (optimizer, batch, warmup) are split over machines by ``shard_groups``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile

FORMAT_VERSION = 1
REGION_PERFECT, REGION_DIMINISHING, REGION_MAXIMAL, REGION_UNREACHED = (
    "perfect", "diminishing", "maximal", "unreached")
PERFECT_SLOPE = -0.75
MAXIMAL_SLOPE = -0.25


class HarnessError(ValueError):
    """A problem with the flags, the results file or the target; the message says the fix."""


# ---------------------------------------------------------------------------------------------
# Budget, evaluation schedule, steps to target


def validate_target(target: float) -> float:
    """``target`` if it is a reachable validation accuracy, else a ``HarnessError``."""
    if not (isinstance(target, (int, float)) and math.isfinite(target)) or not 0.0 < target <= 1.0:
        raise HarnessError(
            f"--target={target} is not a validation accuracy in (0, 1]: no trial can reach it. "
            "Give a fraction, e.g. --target=0.85.")
    return float(target)


def budget_steps(batch: int, n_train: int, max_epochs: float, max_steps: int = 0) -> int:
    """Optimizer updates a trial at ``batch`` may take (see the module docstring)."""
    if batch <= 0 or n_train <= 0 or max_epochs <= 0 or max_steps < 0:
        raise HarnessError(f"budget needs positive batch, examples and epochs, got batch={batch}, "
                           f"n_train={n_train}, max_epochs={max_epochs}, max_steps={max_steps}.")
    steps = math.ceil(max_epochs * n_train / batch)
    return max(1, min(steps, max_steps) if max_steps else steps)


def eval_steps(budget: int, ratio: float) -> list[int]:
    """Evaluation steps: 0, the distinct ``round(ratio**i)`` below ``budget``, and ``budget``."""
    if ratio <= 1.0:
        raise HarnessError(f"--eval_ratio={ratio} must be > 1 (e.g. 1.12 = 2**(1/6)).")
    steps, i = {0, budget}, 0
    while True:
        step = round(ratio ** i)
        if step >= budget:
            return sorted(steps)
        steps.add(step)
        i += 1


def steps_to_target(curve, target: float):
    """The first evaluated step of ``curve`` ([step, accuracy, ...] rows in step order) whose
    accuracy is >= ``target``; ``None`` if there is none."""
    for row in curve:
        if row[1] >= target:
            return int(row[0])
    return None


def retarget(records: list[dict], target: float) -> list[dict]:
    """``records`` read at a lower target than the one they ran for (exact: a trial's curve
    runs at least to its first evaluation at or above the target it ran for)."""
    target = validate_target(target)
    ran_for = {r["setup"]["target"] for r in records}
    if any(target > t for t in ran_for):
        raise HarnessError(
            f"--report_target={target} is above the target the trials ran for ({min(ran_for)}): "
            "they stopped at their first evaluation at or above it. A higher target needs a new "
            "sweep (and a new --results file).")
    out = []
    for r in records:
        steps = steps_to_target(r["curve"], target)
        status = "reached" if steps is not None else r["status"]
        out.append({**r, "steps_to_target": steps, "status": status,
                    "setup": {**r["setup"], "target": target,
                              "ran_for_target": r["setup"]["target"]}})
    return out


def diverged(curve, loss: float, *, classes: int, after_step: int) -> bool:
    """The divergence rule of the module docstring for the ``curve`` so far and the latest
    training ``loss``."""
    if not math.isfinite(loss):
        return True
    chance = 1.0 / classes + 0.02
    late = [row[1] for row in curve if row[0] >= after_step]
    return len(late) >= 3 and all(acc <= chance for acc in late[-3:])


# ---------------------------------------------------------------------------------------------
# Trials, scores and the learning-rate search


def trial_key(optimizer: str, batch: int, warmup: float, lr_index: int, seed: int) -> tuple:
    """The identity of a trial within one setup."""
    return (str(optimizer), int(batch), round(float(warmup), 6), int(lr_index), int(seed))


def record_key(record: dict) -> tuple:
    return trial_key(record["optimizer"], record["batch"], record["warmup"], record["lr_index"],
                     record["seed"])


def lattice_lr(ref_lr: float, lr_ratio: float, index: int) -> float:
    return float(f"{ref_lr * lr_ratio ** index:.6g}")


def start_index(batch: int, ref_batch: int, lr_ratio: float) -> int:
    """Lattice index nearest to the square-root rule from ``ref_batch`` (index 0) to ``batch``."""
    return round(0.5 * math.log(batch / ref_batch) / math.log(lr_ratio))


def score(records: list[dict]) -> tuple:
    """Score of one learning rate from its trials (one per seed): (median steps, -median best
    accuracy); steps are ``inf`` for a trial that missed the target."""
    steps = [math.inf if r["steps_to_target"] is None else r["steps_to_target"] for r in records]
    return (statistics.median(steps), -statistics.median(r["best_accuracy"] for r in records))


def next_lr_indices(scores: dict, start: int, initial: int = 3, max_points: int = 6) -> list[int]:
    """Lattice indices to evaluate next for one (optimizer, batch, warmup).

    Args:
        scores: lattice index -> score (``score``) for every point whose seeds are all done;
            index -> None for a point started but not complete.
        start: the search's centre (``start_index``).
        initial: size of the first grid around ``start``.
        max_points: most points evaluated.

    Returns:
        The indices to run (the incomplete ones first); [] when the search is over.
    """
    if initial < 1 or max_points < initial:
        raise HarnessError(f"need 1 <= --lr_initial_points ({initial}) <= --lr_max_points "
                           f"({max_points}).")
    first = [start - (initial - 1) // 2 + i for i in range(initial)]
    pending = sorted({i for i in first if scores.get(i) is None}
                     | {i for i, s in scores.items() if s is None})
    if pending:
        return pending
    done = sorted(scores)
    if len(done) >= max_points:
        return []
    best = min(done, key=lambda i: (scores[i], i))
    lo, hi = done[0], done[-1]
    if best == hi:
        return [hi + 1]
    if best == lo:
        return [lo - 1]
    return []


def is_bracketed(scores: dict, best: int) -> bool:
    """Whether ``best`` has an evaluated neighbour on both sides."""
    return best - 1 in scores and best + 1 in scores


def group_scores(records: list[dict], seeds: list[int]) -> dict:
    """Lattice index -> score (or None until every seed in ``seeds`` is done) for the records of
    one (optimizer, batch, warmup)."""
    by_index: dict = {}
    for r in records:
        by_index.setdefault(r["lr_index"], {})[r["seed"]] = r
    return {i: score([runs[s] for s in seeds]) if all(s in runs for s in seeds) else None
            for i, runs in by_index.items()}


# ---------------------------------------------------------------------------------------------
# Sweep order and shards


def coarse_to_fine(values: list) -> list:
    """``values`` reordered so that every prefix covers their range as evenly as it can: both
    ends first, then the middles of the largest gaps (a partial sweep still spans the batches)."""
    values = list(values)
    if len(values) <= 2:
        return values
    order, chosen = [0, len(values) - 1], {0, len(values) - 1}
    while len(order) < len(values):
        marks = sorted(chosen)
        gaps = [(b - a, a, b) for a, b in zip(marks, marks[1:]) if b - a > 1]
        width, a, b = max(gaps, key=lambda g: (g[0], -g[1]))
        middle = (a + b) // 2
        order.append(middle)
        chosen.add(middle)
    return [values[i] for i in order]


def sweep_groups(optimizers: list[str], batches: list[int], warmups: list[float]) -> list[tuple]:
    """(optimizer, batch, warmup) groups in sweep order: batches coarse to fine, then optimizers."""
    return [(opt, b, w) for b in coarse_to_fine(sorted(batches)) for opt in optimizers
            for w in warmups]


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise HarnessError(f"--shard={text!r} is not 'i/n' (e.g. --shard=0/2).") from None
    if not 0 <= i < n:
        raise HarnessError(f"--shard={text!r}: need 0 <= i < n.")
    return i, n


def shard_groups(groups: list, shard: tuple[int, int]) -> list:
    """The groups shard ``i`` of ``n`` runs: every n-th, starting at i."""
    i, n = shard
    return groups[i::n]


# ---------------------------------------------------------------------------------------------
# Results files


def setup_difference(a: dict, b: dict) -> list[str]:
    """Fields whose values differ between two setups, as 'name: a != b'."""
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def read_records(path: str) -> list[dict]:
    """Records of a results file ([] if it does not exist). A last line cut short by an
    interruption is ignored (``append_record`` removes it); any other bad line is an error."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: the write was interrupted
                continue
            raise HarnessError(f"{path}:{number} is not a JSON trial record; remove the line or "
                               "use another --results file.") from None
    return records


def check_setup(records: list[dict], setup: dict, path: str) -> None:
    """Refuses records made under another setup (their results would not be comparable)."""
    for record in records:
        diff = setup_difference(record["setup"], setup)
        if diff:
            raise HarnessError(
                f"{path} holds trials of another setup ({'; '.join(diff)}). Rerun with the flags "
                "that made it, or give a new --results file.")


def _drop_partial_last_line(path: str) -> None:
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def append_record(path: str, record: dict) -> None:
    """Appends one record as one line, flushed to disk before returning."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        _drop_partial_last_line(path)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


def merge_records(record_lists: list[list[dict]]) -> tuple[list[dict], int]:
    """One record per trial key, the first seen kept; returns (records, duplicates dropped).
    All records must share one setup."""
    merged, seen, duplicates = [], set(), 0
    for records in record_lists:
        for record in records:
            if merged:
                diff = setup_difference(merged[0]["setup"], record["setup"])
                if diff:
                    raise HarnessError("cannot merge trials of different setups: " + "; ".join(diff))
            key = record_key(record)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            merged.append(record)
    return merged, duplicates


def write_records(path: str, records: list[dict]) -> None:
    """Writes ``records`` to ``path`` atomically (a temporary file renamed over it)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Reading the results: best point per batch, regions, learning-rate rules


def best_points(records: list[dict], seeds: list[int] | None = None) -> dict:
    """(optimizer, batch) -> the best learning rate's summary over warmups and lattice points.

    A learning rate counts only when all ``seeds`` (default: every seed in the records) are done.
    The summary: lr, lr_index, warmup, median_steps (None if the median missed the target),
    seed_steps, bracketed, points (lattice points evaluated), trials.
    """
    seeds = sorted({r["seed"] for r in records}) if seeds is None else seeds
    groups: dict = {}
    for r in records:
        groups.setdefault((r["optimizer"], r["batch"], r["warmup"]), []).append(r)
    best: dict = {}
    for (opt, batch, warmup), rs in groups.items():
        scores = {i: s for i, s in group_scores(rs, seeds).items() if s is not None}
        if not scores:
            continue
        index = min(scores, key=lambda i: (scores[i], i))
        runs = sorted((r for r in rs if r["lr_index"] == index and r["seed"] in seeds),
                      key=lambda r: r["seed"])
        steps = scores[index][0]
        point = {"optimizer": opt, "batch": batch, "warmup": warmup, "lr": runs[0]["lr"],
                 "lr_index": index, "score": scores[index],
                 "median_steps": None if math.isinf(steps) else steps,
                 "seed_steps": [r["steps_to_target"] for r in runs],
                 "bracketed": is_bracketed(scores, index), "points": len(scores),
                 "trials": len(rs)}
        current = best.get((opt, batch))
        if current is None or (point["score"], warmup) < (current["score"], current["warmup"]):
            best[(opt, batch)] = point
    return best


def regions(batches: list[int], steps: list) -> list[str]:
    """Label of each segment between consecutive ``batches`` (see the module docstring);
    ``steps`` holds the best median steps, None where the target was missed."""
    labels = []
    for b1, b2, s1, s2 in zip(batches, batches[1:], steps, steps[1:]):
        if s2 is None or s1 is None:
            labels.append(REGION_UNREACHED)
            continue
        slope = math.log(s2 / s1) / math.log(b2 / b1)
        labels.append(REGION_PERFECT if slope <= PERFECT_SLOPE else
                      REGION_MAXIMAL if slope >= MAXIMAL_SLOPE else REGION_DIMINISHING)
    return labels


def region_runs(batches: list[int], labels: list[str]) -> list[tuple[str, int, int]]:
    """Consecutive segments with the same label merged: (label, first batch, last batch)."""
    runs: list = []
    for label, b1, b2 in zip(labels, batches, batches[1:]):
        if runs and runs[-1][0] == label:
            runs[-1] = (label, runs[-1][1], b2)
        else:
            runs.append((label, b1, b2))
    return runs


def fit_critical_batch(batches: list[int], steps: list):
    """Least-squares fit of ``log S = log S_min + log(1 + B_crit / B)`` over the points that
    reached the target: (S_min, B_crit, rms of the log residuals), or None with fewer than 3.

    ``B_crit`` is searched on a fine log grid from batches[0]/64 to batches[-1]*64 (for a given
    ``B_crit``, the best ``log S_min`` is the mean residual); a fit at an end of the grid means the
    data shows only one regime.
    """
    points = [(b, s) for b, s in zip(batches, steps) if s is not None]
    if len(points) < 3:
        return None
    lo, hi = math.log(points[0][0] / 64), math.log(points[-1][0] * 64)
    best = None
    for i in range(2001):
        b_crit = math.exp(lo + (hi - lo) * i / 2000)
        shape = [math.log(1 + b_crit / b) for b, _ in points]
        residual = [math.log(s) - f for (_, s), f in zip(points, shape)]
        log_s_min = sum(residual) / len(residual)
        error = sum((r - log_s_min) ** 2 for r in residual) / len(residual)
        if best is None or error < best[0]:
            best = (error, math.exp(log_s_min), b_crit)
    error, s_min, b_crit = best
    return s_min, b_crit, math.sqrt(error)


def model_steps(s_min: float, b_crit: float, batches: list[int]) -> list[float]:
    return [s_min * (1 + b_crit / b) for b in batches]


def model_regions(b_crit: float) -> tuple[float, float]:
    """(end of perfect scaling, start of maximal data parallelism) of the fitted model: where
    its slope ``-B_crit / (B + B_crit)`` crosses PERFECT_SLOPE and MAXIMAL_SLOPE (B_crit/3, 3·B_crit)."""
    return (b_crit * (1 / -PERFECT_SLOPE - 1), b_crit * (1 / -MAXIMAL_SLOPE - 1))


def perfect_scaling_line(batch0: int, steps0: float, batches: list[int]) -> list[float]:
    """Steps under perfect scaling from (batch0, steps0): steps0 * batch0 / B."""
    return [steps0 * batch0 / b for b in batches]


def rule_learning_rates(base_lr: float, base_batch: int, batches: list[int], rule: str) -> list:
    """``base_lr`` scaled from ``base_batch`` to each batch by ``"linear"`` or ``"sqrt"``."""
    power = {"linear": 1.0, "sqrt": 0.5}.get(rule)
    if power is None:
        raise HarnessError(f"rule={rule!r} is not 'linear' or 'sqrt'.")
    return [base_lr * (b / base_batch) ** power for b in batches]


def power_law_exponent(batches: list[int], values: list[float]):
    """Least-squares ``a`` in ``value ∝ batch^a`` (None with fewer than two points)."""
    if len(batches) < 2:
        return None
    xs = [math.log(b) for b in batches]
    ys = [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None
