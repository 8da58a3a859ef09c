"""The large-batch harness (tools/large_batch.py and its package tools/large_batch/): its pure
rules, then real sweeps on digits under DataParallelStrategy (the conftest's 4 logical CPU
replicas)."""

import csv
import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from large_batch import core  # tools/ is on pytest's pythonpath
from large_batch import data as large_batch_data
from large_batch import sweep as large_batch_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")

SCRIPT = os.path.join(TOOLS, "large_batch.py")


# --------------------------------------------------------------------------------------------
# Pure rules


def test_eval_steps_are_geometric_start_at_zero_and_end_at_the_budget():
    steps = core.eval_steps(100, 2 ** 0.5)
    assert steps[0] == 0 and steps[-1] == 100
    assert steps == sorted(set(steps))
    assert steps[1:8] == [1, 2, 3, 4, 6, 8, 11]
    # Each gap is at most a factor ratio (+ rounding) past the first few steps.
    assert all(b / a <= 2 ** 0.5 + 0.2 for a, b in zip(steps[4:], steps[5:]))
    assert core.eval_steps(1, 1.1) == [0, 1]
    with pytest.raises(core.HarnessError, match="eval_ratio"):
        core.eval_steps(10, 1.0)


def test_steps_to_target_is_the_first_evaluated_step_at_or_above_the_target():
    curve = [[0, 0.1, None], [10, 0.5, 1.0], [20, 0.86, 0.5], [40, 0.84, 0.4], [80, 0.9, 0.3]]
    assert core.steps_to_target(curve, 0.85) == 20
    assert core.steps_to_target(curve, 0.86) == 20
    assert core.steps_to_target(curve, 0.87) == 80
    assert core.steps_to_target(curve, 0.95) is None


def test_records_read_at_a_lower_target_but_not_a_higher_one():
    record = {"curve": [[0, 0.1, None], [10, 0.7, 1.0], [20, 0.86, 0.5]], "status": "reached",
              "steps_to_target": 20, "setup": {"target": 0.85}}
    lower = core.retarget([record], 0.6)[0]
    assert lower["steps_to_target"] == 10 and lower["setup"]["target"] == 0.6
    assert lower["setup"]["ran_for_target"] == 0.85 and record["steps_to_target"] == 20
    assert core.retarget([record], 0.85)[0]["steps_to_target"] == 20
    with pytest.raises(core.HarnessError, match="above the target the trials ran for"):
        core.retarget([record], 0.9)


def test_budget_is_epochs_capped_by_steps():
    assert core.budget_steps(32, 55000, 24, 3000) == 3000
    assert core.budget_steps(8192, 55000, 24, 3000) == math.ceil(24 * 55000 / 8192) == 162
    assert core.budget_steps(8192, 55000, 24, 0) == 162
    assert core.budget_steps(100000, 10, 1, 0) == 1


@pytest.mark.parametrize("target", [1.5, 0.0, -0.2, float("nan")])
def test_targets_no_trial_can_reach_are_refused(target):
    with pytest.raises(core.HarnessError, match="not a validation accuracy in"):
        core.validate_target(target)
    assert core.validate_target(1.0) == 1.0


def test_divergence_rule():
    stuck = [[s, 0.1] for s in (0, 5, 10, 20, 40)]
    assert core.diverged([], float("nan"), classes=10, after_step=0)
    assert core.diverged(stuck, 1.0, classes=10, after_step=10)
    assert not core.diverged(stuck, 1.0, classes=10, after_step=20)  # only two late evals
    assert not core.diverged(stuck[:-1] + [[40, 0.5]], 1.0, classes=10, after_step=0)


def _search(objective, start=0, initial=3, max_points=8):
    """Runs the learning-rate search against ``objective(index) -> steps`` (None = missed)."""
    scores, order = {}, []
    while True:
        todo = core.next_lr_indices(scores, start, initial, max_points)
        if not todo:
            return scores, order
        for i in todo:
            steps = objective(i)
            scores[i] = core.score([{"steps_to_target": steps, "best_accuracy": 0.9}])
            order.append(i)


@pytest.mark.parametrize("optimum", [-3, 0, 2, 5])
def test_learning_rate_search_walks_to_a_bracketed_optimum(optimum):
    scores, order = _search(lambda i: 100 + 10 * (i - optimum) ** 2)
    best = min(scores, key=lambda i: scores[i])
    assert best == optimum and core.is_bracketed(scores, best)
    assert order[:3] == [-1, 0, 1]
    assert len(order) == 3 + abs(optimum)  # one step past the optimum, no more


def test_learning_rate_search_stops_at_max_points_unbracketed():
    scores, order = _search(lambda i: 1000 - i, max_points=5)  # keeps improving upward
    assert order == [-1, 0, 1, 2, 3]
    assert not core.is_bracketed(scores, 3)


def test_learning_rate_search_moves_away_from_divergence_and_misses():
    def objective(i):
        return None if i >= 1 else 200 - 50 * i if i >= -1 else 300
    scores, order = _search(objective)
    best = min(scores, key=lambda i: scores[i])
    assert best == 0 and core.is_bracketed(scores, best)
    # A missed point with a better accuracy ranks ahead of one with a worse accuracy.
    a = core.score([{"steps_to_target": None, "best_accuracy": 0.8}])
    b = core.score([{"steps_to_target": None, "best_accuracy": 0.3}])
    reached = core.score([{"steps_to_target": 10 ** 6, "best_accuracy": 0.9}])
    assert reached < a < b


def test_score_is_the_median_over_seeds_with_misses_as_infinity():
    runs = [{"steps_to_target": s, "best_accuracy": 0.9} for s in (100, 300, None)]
    assert core.score(runs)[0] == 300
    assert core.score(runs[:2])[0] == 200
    assert math.isinf(core.score([runs[0], runs[2]])[0])


def test_regions_by_local_slope():
    batches = [32, 64, 128, 256, 512, 1024]
    steps = [1000, 500, 260, 180, 170, None]
    labels = core.regions(batches, steps)
    assert labels == ["perfect", "perfect", "diminishing", "maximal", "unreached"]
    assert core.region_runs(batches, labels) == [
        ("perfect", 32, 128), ("diminishing", 128, 256), ("maximal", 256, 512),
        ("unreached", 512, 1024)]
    assert core.regions([32, 64], [100, 120]) == ["maximal"]  # more steps: no gain at all


@pytest.mark.parametrize("b_crit", [20.0, 700.0, 5000.0])
def test_critical_batch_fit_recovers_the_model_and_its_regions(b_crit):
    batches = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    steps = core.model_steps(50.0, b_crit, batches)
    noisy = [s * (1.1 if i % 2 else 0.9) for i, s in enumerate(steps)]
    s_min, fitted, rms = core.fit_critical_batch(batches, steps)
    assert s_min == pytest.approx(50.0, rel=0.01) and fitted == pytest.approx(b_crit, rel=0.01)
    assert rms < 1e-3
    s_min, fitted, rms = core.fit_critical_batch(batches, noisy)
    assert fitted == pytest.approx(b_crit, rel=0.35) and 0.05 < rms < 0.15
    end_perfect, start_maximal = core.model_regions(b_crit)
    assert (end_perfect, start_maximal) == pytest.approx((b_crit / 3, 3 * b_crit))
    # The model's slope at those batches is the rule's thresholds.
    for batch, slope in ((end_perfect, core.PERFECT_SLOPE), (start_maximal, core.MAXIMAL_SLOPE)):
        assert -b_crit / (batch + b_crit) == pytest.approx(slope)
    assert core.fit_critical_batch(batches[:3], [100, None, 30]) is None


def test_learning_rate_rules_and_fitted_exponent():
    batches = [32, 64, 128, 1024]
    linear = core.rule_learning_rates(0.1, 32, batches, "linear")
    sqrt = core.rule_learning_rates(0.1, 32, batches, "sqrt")
    assert linear == pytest.approx([0.1, 0.2, 0.4, 3.2])
    assert sqrt[-1] == pytest.approx(0.1 * math.sqrt(32))
    assert core.power_law_exponent(batches, linear) == pytest.approx(1.0)
    assert core.power_law_exponent(batches, sqrt) == pytest.approx(0.5)
    assert core.power_law_exponent([32], [0.1]) is None
    assert core.perfect_scaling_line(32, 1000, [32, 64, 256]) == [1000, 500, 125]
    assert core.start_index(32, 32, 2.0) == 0 and core.start_index(2048, 32, 2.0) == 3


def test_coarse_to_fine_order_and_shards_cover_every_group_once():
    assert core.coarse_to_fine([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [1, 9, 5, 3, 7, 2, 4, 6, 8]
    assert core.coarse_to_fine([4, 8]) == [4, 8]
    groups = core.sweep_groups(["sgd", "lamb"], [32, 64, 128], [0.05])
    assert groups[:2] == [("sgd", 32, 0.05), ("lamb", 32, 0.05)]
    shards = [core.shard_groups(groups, (i, 3)) for i in range(3)]
    assert sorted(g for s in shards for g in s) == sorted(groups)
    assert core.parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "a/b", "1"):
        with pytest.raises(core.HarnessError, match="shard"):
            core.parse_shard(bad)


def _record(opt="sgd", batch=32, lr_index=0, seed=0, steps=100, setup=None):
    return {"optimizer": opt, "batch": batch, "warmup": 0.05, "lr_index": lr_index, "seed": seed,
            "lr": 0.05 * 2 ** lr_index, "steps_to_target": steps, "best_accuracy": 0.9,
            "setup": setup or {"target": 0.9}}


def test_results_file_keeps_finished_lines_and_drops_a_cut_last_line(tmp_path):
    path = str(tmp_path / "r.jsonl")
    core.append_record(path, _record(seed=0))
    core.append_record(path, _record(seed=1))
    with open(path, "a") as f:
        f.write('{"optimizer": "sgd", "bat')  # the process died mid-write
    assert [r["seed"] for r in core.read_records(path)] == [0, 1]
    core.append_record(path, _record(seed=2))
    assert [r["seed"] for r in core.read_records(path)] == [0, 1, 2]
    with open(path, "a") as f:
        f.write("not json\n" + json.dumps(_record(seed=3)) + "\n")
    with pytest.raises(core.HarnessError, match=r"r.jsonl:4 is not a JSON trial record"):
        core.read_records(path)


def test_records_of_another_setup_are_refused(tmp_path):
    records = [_record(setup={"target": 0.9, "max_epochs": 10})]
    with pytest.raises(core.HarnessError, match=r"max_epochs: 10 != 20.*new --results"):
        core.check_setup(records, {"target": 0.9, "max_epochs": 20}, "r.jsonl")
    with pytest.raises(core.HarnessError, match="different setups"):
        core.merge_records([records, [_record(seed=1, setup={"target": 0.8})]])


def test_merge_keeps_one_record_per_trial():
    a = [_record(seed=0), _record(seed=1, steps=110)]
    b = [_record(seed=1, steps=999), _record(batch=64, seed=0)]
    merged, duplicates = core.merge_records([a, b])
    assert duplicates == 1
    assert [(r["batch"], r["seed"], r["steps_to_target"]) for r in merged] == [
        (32, 0, 100), (32, 1, 110), (64, 0, 100)]


def test_best_points_pick_the_best_complete_learning_rate():
    records = [_record(lr_index=0, seed=0, steps=100), _record(lr_index=0, seed=1, steps=140),
               _record(lr_index=1, seed=0, steps=90), _record(lr_index=1, seed=1, steps=None),
               _record(lr_index=-1, seed=0, steps=150), _record(lr_index=-1, seed=1, steps=160),
               _record(lr_index=2, seed=0, steps=10)]  # seed 1 missing: not complete
    point = core.best_points(records)[("sgd", 32)]
    assert point["lr_index"] == 0 and point["median_steps"] == 120
    assert point["seed_steps"] == [100, 140] and point["bracketed"] and point["points"] == 3


def _full_record(opt, batch, lr_index, seed, steps):
    setup = {"dataset": "synthetic", "n_train": 1000, "n_val": 100, "features": 8, "classes": 10,
             "hidden": [16], "target": 0.9, "max_epochs": 10.0, "max_steps": 0,
             "eval_ratio": 1.1, "lr_ratio": 2.0, "ref_lrs": {"sgd": 0.1, "lars": 1.0},
             "ref_batch": 32, "momentum": 0.9, "trust_coefficient": 0.001, "weight_decay": 0.0}
    curve = [[0, 0.1, None]] + ([[steps, 0.95, 0.1]] if steps else [[50, 0.5, 1.0]])
    return {"optimizer": opt, "batch": batch, "warmup": 0.05, "lr_index": lr_index, "seed": seed,
            "lr": 0.1 * 2 ** lr_index, "status": "reached" if steps else "budget",
            "steps_to_target": steps, "best_accuracy": 0.95 if steps else 0.5,
            "budget_steps": 50, "curve": curve, "accumulation": 1, "replicas": 2,
            "examples": (steps or 50) * batch, "seconds": 1.0, "cpu_seconds": 2.0, "host": "h",
            "setup": setup}


def test_report_reads_regions_and_keeps_hand_written_text(tmp_path):
    from large_batch import report as large_batch_report

    # sgd: perfect 32->64, diminishing 64->128, maximal 128->256; lars misses at 256.
    best = {"sgd": {32: 800, 64: 400, 128: 280, 256: 270}, "lars": {32: 800, 64: 400, 128: 200,
                                                                      256: None}}
    records = []
    for opt, points in best.items():
        for batch, steps in points.items():
            for lr_index, factor in ((-1, 1.5), (0, 1.0), (1, 1.3)):
                for seed in (0, 1):
                    records.append(_full_record(opt, batch, lr_index, seed,
                                                steps and round(steps * factor)))
    out = str(tmp_path / "lb")
    with open(out + ".md", "w") as f:
        f.write("# Title\n\nAnalysis by hand.\n\n" + large_batch_report.BEGIN + "\nold\n"
                + large_batch_report.END + "\n\nMore by hand.\n")
    large_batch_report.write_report(records, out)
    text = open(out + ".md").read()
    assert text.startswith("# Title\n\nAnalysis by hand.") and text.endswith("More by hand.\n")
    assert "\nold\n" not in text
    assert "| 64 | 400 @ 0.1 | 400 @ 0.1 |" in text and "| 256 | 270 @ 0.1 | missed |" in text
    assert ("Local slopes: perfect scaling 32→64; diminishing returns 64→128; maximal data "
            "parallelism 128→256.") in text
    assert "- sgd: fit S_min = " in text and "perfect scaling up to ~" in text
    assert ("Local slopes: perfect scaling 32→128; target missed at the larger batch 128→256."
            in text)
    assert "48 trials (42 reached the target, 6 ran out of budget, 0 diverged)" in text
    rows = list(csv.DictReader(open(out + ".csv")))
    assert [r["region_to_next_batch"] for r in rows[:4]] == ["perfect", "diminishing", "maximal", ""]
    assert large_batch_report.unreached_message(records) is None
    missed = [dict(r, steps_to_target=None) for r in records]
    assert "no trial reached --target=0.9" in large_batch_report.unreached_message(missed)


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reads_the_standard_files_and_names_both_ways_when_missing(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30, 28, 28))
    labels = rng.integers(0, 10, 30)
    for key, array in (("x_train", images), ("y_train", labels), ("x_test", images[:5]),
                       ("y_test", labels[:5])):
        _write_idx(str(tmp_path / large_batch_data.FASHION_FILES[key]), array)
    split = large_batch_data.load_fashion_mnist(10, data_dir=str(tmp_path))
    assert split.x_train.shape == (20, 784) and split.x_train.dtype == np.uint8
    np.testing.assert_array_equal(split.x_val, images[20:].reshape(10, 784))
    np.testing.assert_array_equal(split.y_train, labels[:20])

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(large_batch_data.DataUnavailableError) as error:
        large_batch_data.load_fashion_mnist(data_dir=str(empty))
    message = str(error.value)
    assert "train-images-idx3-ubyte.gz" in message and "keras.datasets.fashion_mnist" in message
    assert "--data_dir" in message and "dataset-fashion-mnist" in message
    with pytest.raises(large_batch_data.DataUnavailableError, match="internet"):
        large_batch_data.load_fashion_mnist(download=False, search=(str(empty),))


def test_cli_refuses_a_target_above_one_before_training(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--target=1.2", f"--out={tmp_path}/x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--target=1.2 is not a validation accuracy in (0, 1]" in proc.stderr
    assert not os.path.exists(f"{tmp_path}/x.jsonl")


# --------------------------------------------------------------------------------------------
# Real trials on digits


@pytest.fixture(scope="module")
def digits():
    return large_batch_data.load_digits()


@pytest.fixture(scope="module")
def strategy():
    import tfdp
    return tfdp.DataParallelStrategy()


def _setup(data, **overrides):
    params = dict(hidden=[64], target=0.9, max_epochs=30, max_steps=200, eval_ratio=2 ** 0.25,
                  lr_ratio=2.0, ref_lrs={"sgd": 0.1, "adam": 0.004, "lars": 4.0, "lamb": 0.008},
                  ref_batch=32, momentum=0.9, trust_coefficient=0.001, weight_decay=0.0)
    params.update(overrides)
    return large_batch_sweep.build_setup(data, **params)


def _counting_trainer(strategy, data, setup, **kwargs):
    from large_batch import train as large_batch_train

    trained = []

    def train(key):
        trained.append(key)
        return large_batch_train.run_trial(strategy, data, setup, key, **kwargs)
    return train, trained


def test_trial_finds_steps_to_target_under_the_strategy(strategy, digits):
    from large_batch import train as large_batch_train

    setup = _setup(digits)
    record = large_batch_train.run_trial(strategy, digits, setup, core.trial_key("adam", 64, 0.05, 0, 0))
    assert record["replicas"] == strategy.num_replicas_in_sync == 4
    assert record["status"] == "reached"
    steps = record["steps_to_target"]
    accuracies = {row[0]: row[1] for row in record["curve"]}
    schedule = core.eval_steps(record["budget_steps"], setup["eval_ratio"])
    evaluated = [row[0] for row in record["curve"]]
    assert evaluated == schedule[:len(evaluated)] and evaluated[-1] == steps
    assert accuracies[steps] >= 0.9 > max(a for s, a in accuracies.items() if s < steps)
    assert accuracies[0] < 0.3  # the untrained model is far from the target
    assert record["examples"] == steps * 64


@pytest.mark.slow
def test_gradient_accumulation_gives_the_same_trial(strategy, digits):
    from large_batch import train as large_batch_train

    setup = _setup(digits, target=0.95)
    key = core.trial_key("lamb", 128, 0.05, 0, 1)
    whole = large_batch_train.run_trial(strategy, digits, setup, key)
    accumulated = large_batch_train.run_trial(strategy, digits, setup, key, max_replica_batch=8)
    assert whole["accumulation"] == 1 and accumulated["accumulation"] == 4
    assert accumulated["steps_to_target"] == whole["steps_to_target"] is not None
    np.testing.assert_allclose([r[1] for r in accumulated["curve"]],
                               [r[1] for r in whole["curve"]], atol=1 / 360 + 1e-9)


def test_untrained_model_meeting_the_target_is_refused(strategy, digits):
    from large_batch import train as large_batch_train

    with pytest.raises(core.HarnessError, match="untrained model already has validation accuracy"):
        large_batch_train.run_trial(strategy, digits, _setup(digits, target=0.01),
                                    core.trial_key("sgd", 64, 0.05, 0, 0))


def test_interrupted_sweep_resumes_without_redoing_trials(strategy, digits, tmp_path):
    setup = _setup(digits)
    groups = [("sgd", 64, 0.05)]
    options = dict(initial=1, max_points=2)  # 2 learning rates x 2 seeds = 4 trials
    path = str(tmp_path / "r.jsonl")
    train, trained = _counting_trainer(strategy, digits, setup)
    first = large_batch_sweep.Sweep(setup, path, groups, [0, 1], train, max_trials=1, **options)
    assert first.run() is False and len(trained) == 1 and len(core.read_records(path)) == 1
    second = large_batch_sweep.Sweep(setup, path, groups, [0, 1], train, **options)
    assert second.run() is True and second.trained == 3 and len(trained) == 4
    keys = [core.record_key(r) for r in core.read_records(path)]
    assert len(keys) == len(set(keys)) == 4 and sorted(keys) == sorted(trained)
    third = large_batch_sweep.Sweep(setup, path, groups, [0, 1], train, **options)
    assert third.run() is True and third.trained == 0 and len(trained) == 4
    # Another setup (here: another budget) is refused rather than mixed in.
    with pytest.raises(core.HarnessError, match="max_steps: 200 != 300"):
        large_batch_sweep.Sweep(_setup(digits, max_steps=300), path, groups, [0, 1], train)


@pytest.mark.slow
def test_sweep_split_over_shards_merges_into_the_whole_sweep(strategy, digits, tmp_path):
    setup = _setup(digits)
    groups = core.sweep_groups(["sgd"], [64, 256], [0.05])
    options = dict(initial=1, max_points=2)
    whole = str(tmp_path / "whole.jsonl")
    train, trained = _counting_trainer(strategy, digits, setup)
    results = {}

    def remembering(key):
        results[key] = train(key)
        return results[key]

    large_batch_sweep.Sweep(setup, whole, groups, [0, 1], remembering, **options).run()
    keys = sorted(core.record_key(r) for r in core.read_records(whole))
    assert len(keys) == len(trained) == 8

    # The same sweep split over two "machines" (shards 0/2 and 1/2), then merged with the CLI.
    # Each trial a shard asks for is answered with the whole sweep's run of it (trials are
    # deterministic; a trial the whole sweep did not run is a KeyError here).
    parts = [str(tmp_path / f"part{i}.jsonl") for i in range(2)]
    for i, part in enumerate(parts):
        shard_groups = core.shard_groups(groups, (i, 2))
        trained_i = []

        def train_i(key, trained_i=trained_i):
            trained_i.append(key)
            return results[key]

        large_batch_sweep.Sweep(setup, part, shard_groups, [0, 1], train_i, **options).run()
        assert {k[1] for k in trained_i} == {g[1] for g in shard_groups} and len(trained_i) == 4
    merged = str(tmp_path / "merged.jsonl")
    core.write_records(merged, core.read_records(parts[0])[:1])  # an overlap to de-duplicate
    proc = subprocess.run([sys.executable, SCRIPT, f"--merge={parts[0]},{parts[1]}",
                           f"--results={merged}", f"--out={tmp_path}/merged"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 trials, 1 duplicate(s) dropped" in proc.stdout
    assert sorted(core.record_key(r) for r in core.read_records(merged)) == keys
    # The report comes from the results file alone.
    text = open(f"{tmp_path}/merged.md").read()
    assert "| 64 |" in text and "| 256 |" in text and "- sgd:" in text
    for suffix in ("_steps.png", "_compare.png", "_lr.png", ".csv"):
        assert os.path.getsize(f"{tmp_path}/merged{suffix}") > 0


def test_a_target_no_trial_reaches_is_reported_with_the_best_accuracy(strategy, digits, tmp_path):
    setup = _setup(digits, target=0.999, max_steps=12)
    path = str(tmp_path / "r.jsonl")
    train, trained = _counting_trainer(strategy, digits, setup)
    sweep = large_batch_sweep.Sweep(setup, path, [("adam", 64, 0.05)], [0], train, initial=1,
                                    max_points=2)
    assert sweep.run() is True and len(trained) == 2  # bounded: the search stops at max_points
    assert all(r["steps_to_target"] is None for r in core.read_records(path))
    proc = subprocess.run([sys.executable, SCRIPT, "--report_only", f"--results={path}",
                           f"--out={tmp_path}/r"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no trial reached --target=0.999 within its budget" in proc.stderr
    assert "Lower --target or raise --max_epochs/--max_steps" in proc.stderr


@pytest.mark.slow
def test_cli_sweep_continues_in_fresh_processes_and_reports(tmp_path):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--optimizers=adam", "--batch_sizes=64", "--seeds=1",
         "--lr_initial_points=1", "--lr_max_points=2", "--trials_per_process=1", "--threads=1",
         f"--out={tmp_path}/c"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Two processes of one trial each, the second continuing from the first one's record.
    assert proc.stdout.count("trial 1 (group 1/1) adam batch 64") == 2
    assert "1 already in" in proc.stdout and "sweep ran in 2 process(es)" in proc.stdout
    records = core.read_records(f"{tmp_path}/c.jsonl")
    assert sorted(r["lr_index"] for r in records) in ([0, 1], [-1, 0])
    assert {r["replicas"] for r in records} == {2} and {r["pid"] for r in records}.__len__() == 2
    assert "| 64 |" in open(f"{tmp_path}/c.md").read()
