"""tools/bench_allreduce.py's multi-worker mode end to end with small messages: two worker
processes per implementation on 127.0.0.1, rank 0's timings per op and size, the table, the
CSV and the plot (issue 43, item 0)."""

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.multiworker
def test_multiworker_mode_measures_tfdp_and_mwms_between_two_processes(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_allreduce.py"), "--workers", "2",
         "--min_kib", "4", "--max_mib", "1", "--repeats", "1", "--out", str(out),
         "--job_timeout", "240"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(f"{out}_multiworker.csv")))
    got = {(r["impl"], r["op"]) for r in rows}
    assert got == {("tfdp", "all_reduce"), ("tfdp", "reduce_scatter"), ("tfdp", "all_gather"),
                   ("mwms", "all_reduce"), ("mwms", "all_gather")}, got
    sizes = sorted({int(r["bytes"]) for r in rows})
    assert sizes == [4096, 16384, 65536, 262144, 1048576], sizes
    for r in rows:
        assert r["workers"] == "2" and float(r["time_s"]) > 0 and float(r["busbw_GBps"]) > 0, r
        assert float(r["process_cpu_s"]) >= 0, r
    table = open(f"{out}_multiworker.md").read()
    assert "2 worker processes on 127.0.0.1" in table and "| all_reduce | 1,024 KiB |" in table
    # Where the time goes: rank 0's CPU per call beside its wall time, from 1 MiB up.
    assert "| tfdp | all_reduce | 1 MiB |" in table and "| mwms | all_gather | 1 MiB |" in table
    assert os.path.getsize(f"{out}_multiworker.png") > 0
