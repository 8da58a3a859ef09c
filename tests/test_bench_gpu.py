"""tools/bench_gpu.py runs end to end with tiny sizes on CPU (it is meant for a GPU host):
one process per configuration, a markdown table and a CSV with every configuration."""

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_gpu_smoke_run_with_tiny_sizes(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_gpu.py"), "--tiny",
         "--models", "transformer", "--precisions", "fp32,bf16", "--configs", "none,tfdp",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "bench.md").read_text()
    assert table.startswith("Command: `python tools/bench_gpu.py --tiny")
    assert "Device: CPU" in table and "tokens/s" in table and "failed" not in table, table
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [(r["config"], r["precision"]) for r in rows] == [
        ("none", "fp32"), ("tfdp", "fp32"), ("none", "bf16"), ("tfdp", "bf16")]
    for r in rows:
        assert float(r["ms_per_step"]) > 0 and float(r["per_second"]) > 0, r
        assert r["jit_compile"] == "False", r  # "auto" on CPU: no XLA, with or without tfdp


def test_gpu_report_from_the_committed_h100_run(tmp_path):
    # tools/gpu_report.py over the raw output of tools/gpu_checks.sh kept in docs/benchmarks:
    # the tier's outcome per run, every measured row, the ratios and the notes.
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gpu_report.py"), "--results",
         os.path.join(ROOT, "docs", "benchmarks", "gpu_2026-11-26"), "--date", "2026-11-26",
         "--out_dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "gpu_2026-11-26.md").read_text()
    assert "NVIDIA H100 80GB HBM3 (81559 MiB), driver 580.159.04, CUDA 13.0" in report
    assert ("| test_xla_on_two_logical_gpus_trains_like_one_device | FAILED | PASSED |"
            in report)
    assert "| resnet50 | bf16 | 256 | 4,125 | 5.33 | 1.24 |" in report, report
    assert "## The targets of issue 45" in report
    assert (tmp_path / "gpu_2026-11-26.png").stat().st_size > 0
    assert open(os.path.join(ROOT, "docs", "benchmarks", "gpu_2026-11-26.md")).read() == report
