"""Issue 43: the gradient exchange overlaps the backward pass, read from a real profile.

Two workers on 127.0.0.1 (tfdp-run), each pinned to one core with two inter-op threads
(TensorFlow gives a one-core process one, and then a ready collective waits in the pool until
backprop ends: collectives.py, "Backward pacing"), train the 20-layer MLP a few steps under
the TensorFlow profiler (tools/profile_step.py, which launches the job, reads the
chief's trace and prints each step as JSON). In every profiled step the first gradient
collective to run is bucket 0, the last layers' gradients, and it starts before the backward
pass has finished. The guard: the same job with the launch order of tfdp before issue 43
(``collectives.LAUNCH_ORDER = "first_layers_first"`` in the workers) fails that check, its
first collective being the first layers' bucket, which waits for the whole backward pass.
Every wait is bounded (the tool's job timeout, and run_job's).
"""

import json
import os
import sys

import pytest

from launching import ROOT, run_job, worker_env

pytestmark = [pytest.mark.multiworker, pytest.mark.slow]

TOOL = os.path.join(ROOT, "tools", "profile_step.py")


def profiled_steps(tmp_path, order):
    """The chief's profiled steps of a 2-worker job launching its buckets in ``order``."""
    cmd = [sys.executable, TOOL, "--model=mlp20m", "--batch=16", "--warmup=2", "--steps=2",
           "--pin", "--interop=2", "--json", "--timeout=240", f"--launch_order={order}",
           f"--logdir={tmp_path / order}"]
    code, out = run_job(cmd, worker_env(), timeout=300)
    assert code == 0, out[-4000:]
    [line] = [s for s in out.splitlines() if s.startswith("JSON ")]
    steps = json.loads(line[len("JSON "):])["steps"]
    assert len(steps) == 2, out[-2000:]
    return steps


def overlaps(step) -> bool:
    """The check: the first gradient collective is bucket 0 (the last layers') and it
    starts before backward ends."""
    buckets = [c for c in step["collectives"] if c["bucket"] is not None]
    first = min(buckets, key=lambda c: c["start"])
    return first["bucket"] == 0 and first["start"] < step["backward_end"]


def test_first_bucket_reduces_while_backward_runs_and_the_old_order_does_not(tmp_path):
    steps = profiled_steps(tmp_path, "last_layers_first")
    for step in steps:
        buckets = [c for c in step["collectives"] if c["bucket"] is not None]
        assert len(buckets) >= 2, step  # 82 MB of gradients: several buckets
        # Launched last layers first: bucket k starts after bucket k-1 (the ordering token).
        assert [c["bucket"] for c in sorted(buckets, key=lambda c: c["start"])] == sorted(
            c["bucket"] for c in buckets), step
        assert overlaps(step), step
        assert step["hidden"] > 0, step
    # The guard: tfdp's order before issue 43, in the same job, fails the same check.
    old = profiled_steps(tmp_path, "first_layers_first")
    for step in old:
        assert not overlaps(step), step
        first = min((c for c in step["collectives"] if c["bucket"] is not None),
                    key=lambda c: c["start"])
        assert first["bucket"] == max(c["bucket"] for c in step["collectives"]
                                      if c["bucket"] is not None), step
        assert first["start"] >= step["backward_end"], step
