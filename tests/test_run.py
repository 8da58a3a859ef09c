"""tfdp-run's pure-Python parts (no workers started here)."""

import json
import subprocess
import sys

import pytest

from tfdp import run
from tfdp.cluster import ClusterConfig


def test_free_ports_are_distinct():
    ports = run.free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


def test_tf_configs_parse_back():
    configs = run.tf_configs(3, [1001, 1002, 1003])
    parsed = [ClusterConfig.from_json(c) for c in configs]
    assert [p.rank for p in parsed] == [0, 1, 2]
    assert parsed[0].workers == ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"]
    assert json.loads(configs[1])["task"] == {"type": "worker", "index": 1}


def test_parse_args():
    args = run.parse_args(["--workers", "2", "--cpu-replicas", "4", "--", "python", "t.py", "--x"])
    assert (args.workers, args.cpu_replicas, args.command) == (2, 4, ["python", "t.py", "--x"])
    for bad in (["--workers", "0", "--", "x"], ["--workers", "2"], ["--workers", "2", "--cpu-replicas", "0", "--", "x"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


def test_launcher_does_not_import_tensorflow():
    code = "import sys, tfdp.run, tfdp.cluster; print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr


def test_exit_codes_and_rank_prefix(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import os, sys; r = int(os.environ['TFDP_RANK']); print('hello', r);"
                      "open(os.environ['TFDP_READY_FILE'], 'w').close(); sys.exit(7 if r == 1 else 0)")
    proc = subprocess.run([sys.executable, "-m", "tfdp.run", "--workers", "2", "--", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7
    assert "[w1] hello 1" in proc.stdout and "[w0] hello 0" in proc.stdout
    ok = tmp_path / "ok.py"
    ok.write_text("import os; print(os.environ['TF_CONFIG'])")
    proc = subprocess.run([sys.executable, "-m", "tfdp.run", "--workers", "3", "--", sys.executable,
                           str(ok)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.count('"worker": ["127.0.0.1:') == 3


def test_job_timeout(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text("import time\nwhile True: time.sleep(0.1)")
    proc = subprocess.run([sys.executable, "-m", "tfdp.run", "--workers", "2", "--timeout", "2",
                           "--start-timeout", "0", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == run.EXIT_TIMEOUT
    assert "exceeded --timeout 2 s" in proc.stdout
