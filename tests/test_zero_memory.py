"""ShardedOptimizer's and ZeRO-3's peak memory as a user sees it (issues 33 and 39), and the pure parts of
its exchanges: the round plan and where each replica sits in TensorFlow's collective groups.

The peak: each configuration in a fresh process (tools/zero_memory.py's peak child): a
23.1M-parameter MLP, Adam, two steps of ``fit`` on 8 logical CPU replicas (and on one, for
the guard); the growth of the process's peak resident memory (VmHWM) from just before the
model is built. No timings.
"""

import types

import pytest

import zero_memory as zm  # tools/ is on pytest's pythonpath
from tfdp.optimizers import exchange, packing
from tfdp.strategy import replica_ops

PEAK_REPLICAS = 8
PEAK_MODEL = "6x2048"  # 6 hidden layers of 2048 on 1024 inputs: 23.1M parameters
PEAK_LIMIT = 0.75  # issue 33: ZeRO-2's peak growth <= 0.75 of unsharded at N=8 (theory 0.59)


class _Peaks:
    """``peaks[(config, replicas)]``: each configuration measured once, when a test first
    needs it, those a test needs at once in parallel (VmHWM is per process, so only the wall
    time changes). Measured per test rather than all six in one fixture: no test's setup
    then waits for runs it does not read (the fixture took up to 104 s beside other tests)."""

    def __init__(self):
        self._measured = {}

    def need(self, *jobs):
        todo = [job for job in jobs if job not in self._measured]
        if todo:
            self._measured.update(zip(todo, zm.measure_peak_jobs(todo, PEAK_MODEL, steps=2,
                                                                 parallel=True)))
        return self

    def __getitem__(self, job):
        return self._measured[job]


@pytest.fixture(scope="module")
def peaks():
    return _Peaks()


def _ratio(peaks, replicas, config="zero2"):
    return peaks[(config, replicas)]["growth"] / peaks[("unsharded", replicas)]["growth"]


ZERO3_PEAK_LIMIT = 0.35  # issue 39: ZeRO-3's peak growth <= 0.35 of unsharded at N=8


@pytest.mark.slow
def test_zero3_peak_is_at_most_a_third_of_unsharded(peaks):
    peaks.need(("unsharded", PEAK_REPLICAS), ("zero3", PEAK_REPLICAS))
    ratio = _ratio(peaks, PEAK_REPLICAS, "zero3")
    assert peaks[("zero3", PEAK_REPLICAS)]["params"] == peaks[("unsharded", PEAK_REPLICAS)]["params"]
    assert ratio <= ZERO3_PEAK_LIMIT, (
        f"ZeRO-3's peak growth is {ratio:.2f} of unsharded's at N={PEAK_REPLICAS}")


# Issue 57: under XLA at most 1.3x ZeRO-3's own peak without XLA. Measured 1.18 (1004 / 854 MB)
# alone and 1.20 beside other jobs (VmHWM moves with the allocator's timing); the guard's
# whole-gathered step is 1.94x, so the bound still tells the two apart.
ZERO3_XLA_OVER_EAGER = 1.3


@pytest.mark.slow
def test_zero3_under_xla_peak_is_at_its_peak_without_xla_and_a_third_of_unsharded(peaks):
    """Issue 57: with jit_compile=True each unit is compiled on its own (its gathers between
    the programs), so ZeRO-3's peak stays near its peak without XLA, and at most 0.35 of
    unsharded tfdp's under XLA (measured: 1004 MB, 854 MB without XLA, 3862 MB unsharded)."""
    peaks.need(("unsharded_xla", PEAK_REPLICAS), ("zero3_xla", PEAK_REPLICAS),
               ("zero3", PEAK_REPLICAS))
    xla_growth = peaks[("zero3_xla", PEAK_REPLICAS)]["growth"]
    over_eager = xla_growth / peaks[("zero3", PEAK_REPLICAS)]["growth"]
    ratio = xla_growth / peaks[("unsharded_xla", PEAK_REPLICAS)]["growth"]
    print(f"ZeRO-3 under XLA: {xla_growth / 1e6:.0f} MB, {over_eager:.2f}x without XLA, "
          f"{ratio:.2f} of unsharded under XLA")
    assert ratio <= ZERO3_PEAK_LIMIT and over_eager <= ZERO3_XLA_OVER_EAGER, (ratio, over_eager)


@pytest.mark.slow
def test_guard_zero3_keeping_gathered_parameters_is_above_the_limits(peaks):
    """What the ZeRO-3 limits check: the same sharded model under XLA keeping every gathered
    parameter from its forward to its backward pass (reshard_after_forward=False: the
    compiled step takes every unit's gathered parameters at once, as every ZeRO-3 step under
    XLA did before issue 57) peaks above both (measured 1659 MB)."""
    peaks.need(("unsharded_xla", PEAK_REPLICAS), ("zero3_keep_xla", PEAK_REPLICAS),
               ("zero3", PEAK_REPLICAS))
    keep = peaks[("zero3_keep_xla", PEAK_REPLICAS)]["growth"]
    assert keep / peaks[("unsharded_xla", PEAK_REPLICAS)]["growth"] > ZERO3_PEAK_LIMIT
    assert keep / peaks[("zero3", PEAK_REPLICAS)]["growth"] > ZERO3_XLA_OVER_EAGER


@pytest.mark.slow
def test_zero2_peak_is_at_most_three_quarters_of_unsharded(peaks):
    peaks.need(("unsharded", PEAK_REPLICAS), ("zero2", PEAK_REPLICAS))
    zero2, unsharded = peaks[("zero2", PEAK_REPLICAS)], peaks[("unsharded", PEAK_REPLICAS)]
    assert zero2["params"] == unsharded["params"] > 20_000_000
    ratio = _ratio(peaks, PEAK_REPLICAS)
    assert ratio <= PEAK_LIMIT, (
        f"ShardedOptimizer's peak growth {zero2['growth'] / 1e6:.0f} MB is {ratio:.2f} of "
        f"unsharded's {unsharded['growth'] / 1e6:.0f} MB at N={PEAK_REPLICAS}")


@pytest.mark.slow
def test_guard_the_peak_measurement_fails_for_what_does_not_shard(peaks):
    """The check above is not vacuous. The same optimizer, measured the same way, on one
    replica, where there is nothing to shard, is far above the limit; and the unsharded peak
    at N=8 holds more than the weights and Adam's two slots on every replica."""
    peaks.need(("unsharded", 1), ("zero2", 1), ("unsharded", PEAK_REPLICAS))
    assert _ratio(peaks, 1) > PEAK_LIMIT
    unsharded = peaks[("unsharded", PEAK_REPLICAS)]
    assert unsharded["growth"] > 3 * 4 * PEAK_REPLICAS * unsharded["params"]


def test_rounds_cover_every_stream_between_rows():
    sizes = {0: 10, 1: 3, 2: 8, 3: 0, 4: 1}
    rows = {0: 2, 2: 4}
    owners = [0, 1, 1, 0, 2]
    streams = packing.owner_streams(sizes, owners, 3, rows)
    assert streams == [[(0, 10, 2)], [(2, 8, 4), (1, 3, 1)], [(4, 1, 1)]]  # highest index first
    rounds = packing.plan_rounds(streams, 5)
    covered = {}
    for plan in rounds:
        assert plan.width == max(sum(s.size for s in row) for row in plan.rows)
        for replica, row in enumerate(plan.rows):
            assert sum(s.size for s in row) <= max(5, max(rows.values()))
            assert plan.padding(replica) == plan.width - sum(s.size for s in row)
            for s in row:
                assert owners[s.index] == replica
                assert s.start % rows.get(s.index, 1) == 0 and s.stop % rows.get(s.index, 1) == 0
                covered.setdefault(s.index, []).append((s.start, s.stop))
    for index, n in sizes.items():  # every element once, in order; empty tensors not at all
        spans = covered.get(index, [])
        if not spans:
            assert n == 0
            continue
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]]
        assert spans[-1][1] == n
    # One round when everything fits; a row larger than the round is a round of its own.
    assert len(packing.plan_rounds(streams, 100)) == 1
    assert [r.width for r in packing.plan_rounds([[(0, 12, 6)]], 4)] == [6, 6]
    assert packing.plan_rounds([[], []], 4) == []


def test_round_size():
    mib = 1024 * 1024
    # 23.1M float32 parameters at N=8: an eighth of the exchange (11.5 MB) under 32 MiB.
    assert exchange.round_elements(32 * mib, 8, 4, [23_101_450]) == 23_101_450 * 4 // 8 // 32
    # A small model: at least 4 MiB, so one round.
    assert exchange.round_elements(32 * mib, 4, 4, [700_000]) == 4 * mib // 16
    # Never above bucket_bytes; 0 (one collective per tensor): rows of the largest tensor.
    assert exchange.round_elements(1024, 4, 4, [10 ** 8]) == 64
    assert exchange.round_elements(0, 4, 4, [5, 70, 3]) == 70


def _fake_strategy(workers, devices, chief=False):
    spec = {"worker": tuple(f"h:{i}" for i in range(workers - chief))}
    if chief:
        spec["chief"] = ("h:c",)
    cluster = types.SimpleNamespace(num_workers=workers, cluster_spec=spec)
    return types.SimpleNamespace(
        cluster=cluster, extended=types.SimpleNamespace(worker_devices=devices))


def test_group_rank_order_follows_tensorflow():
    """Measured with 12 workers (one replica each): TensorFlow's all-gather and all-to-all
    ranks are tasks 0, 1, 10, 11, 2, ..., 9 (task names in string order); within a worker
    devices go by index."""
    cpus = [f"/job:worker/replica:0/task:0/device:CPU:{i}" for i in range(2)]
    assert replica_ops.group_rank_order(_fake_strategy(1, cpus)) == [0, 1]
    assert replica_ops.group_rank_order(_fake_strategy(4, cpus)) == list(range(8))
    twelve = replica_ops.group_rank_order(_fake_strategy(12, cpus[:1]))
    assert twelve == [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    # A chief is rank 0 and "/job:chief" sorts before "/job:worker".
    assert replica_ops.group_rank_order(_fake_strategy(12, cpus[:1], chief=True))[:4] == [0, 1, 2, 11]
    # Local devices listed out of index order.
    swapped = [cpus[1], cpus[0]]
    assert replica_ops.group_rank_order(_fake_strategy(2, swapped)) == [1, 0, 3, 2]
    assert replica_ops.all_to_all_is_exact(_fake_strategy(1, cpus * 5))
    assert not replica_ops.all_to_all_is_exact(_fake_strategy(1, cpus * 6))


def test_zero3_theory_is_sixteen_bytes_over_n_plus_the_two_largest_units():
    # 1,000 parameters on 4 replicas: 4,000 bytes of sharded state each, plus the two
    # largest units (300 and 200 parameters) gathered whole in float32.
    assert zm.zero3_theory_bytes(1000, [100, 300, 200, 50], 4) == 4000 + 4 * 500
    # More replicas shrink only the sharded part; the gathered units stay.
    assert zm.zero3_theory_bytes(1000, [300, 200], 8) == 2000 + 4 * 500
