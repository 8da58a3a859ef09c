"""XLA's persistent compilation cache for tfdp jobs (issue 59; tfdp.resilience.compile_cache).

The policy (where the cache goes, which entries are bad, which are evicted, what the first
step says) is tested as pure functions. Real processes prove the rest: a 2-worker job with
jit_compile=True, one worker SIGKILLed and restarted by tfdp-run, loads its programs from the
cache and ends with an uninterrupted run's weights; a corrupted entry and a read-only
directory cost a recompilation and one message, never the job.
"""

import io
import logging
import os
import re
import shutil
import subprocess

import pytest

from launching import run_job
from resume_job import TIMEOUT, WORKER, assert_same_weights, environment, launcher, weights
from tfdp.launcher.arguments import parse_args
from tfdp.launcher.cli import Launcher
from tfdp.launcher.policy import Policy
from tfdp.protocol import COMPILE_CACHE_ENV, default_compile_cache_dir
from tfdp.resilience import compile_cache as cc

PREFIX = "tfdp-0123456789abcdef"


def _varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number, payload):
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _entry(sig=11, cluster=22, device="XLA_CPU_JIT", prefix=PREFIX):
    """(file name, bytes) of an entry laid out as TensorFlow 2.21 writes one."""
    key = _field(1, sig) + _field(2, cluster) + _field(3, device.encode()) + _field(4, prefix.encode())
    data = _field(1, key) + _field(2, b"h" * 300) + _field(3, b"x" * 900)
    return f"{prefix}__{sig}__{cluster}__{device}.pb", data


def _problem(name, data, prefix=PREFIX):
    return cc.entry_problem(name, io.BytesIO(data), len(data), prefix)


@pytest.fixture
def fresh(monkeypatch):
    """No cache configured in this process yet, and the changes undone after."""
    monkeypatch.setattr(cc, "_active", None)


# --- where --------------------------------------------------------------------------------

def test_resolve_user_flags_win_then_the_switch_then_beside_backups():
    user = {"TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory=/mine", COMPILE_CACHE_ENV: "/x"}
    assert cc.resolve(user, "/b").source == "user"
    assert cc.resolve({COMPILE_CACHE_ENV: "off"}, "/b").source == "off"
    assert cc.resolve({COMPILE_CACHE_ENV: "/x"}, "/b") == cc.CacheSetting("env", "/x")
    assert cc.resolve({}, "/jobs/run1/backup/") == cc.CacheSetting(
        "backups", "/jobs/run1/backup-xla-cache")
    assert cc.resolve({}, "gs://bucket/backup").source == "none"  # TF's writer, not ours
    assert cc.resolve({}).source == "none"


def test_tfdp_run_sets_the_switch_for_its_workers(tmp_path):
    policy = Policy(num_workers=1)
    env = {"HOME": str(tmp_path)}
    assert Launcher(["true"], policy, env=env).env[COMPILE_CACHE_ENV] == \
        default_compile_cache_dir(env) == str(tmp_path / ".cache" / "tfdp" / "xla")
    assert Launcher(["true"], policy, env=env, compile_cache="off").env[COMPILE_CACHE_ENV] == "off"
    kept = dict(env, **{COMPILE_CACHE_ENV: "/shared/xla"})
    assert Launcher(["true"], policy, env=kept).env[COMPILE_CACHE_ENV] == "/shared/xla"
    assert parse_args(["--workers", "2", "--compile-cache", "off", "--", "x"]).compile_cache == "off"


def test_the_prefix_changes_with_tensorflow_flags_and_hardware():
    base = cc.cache_prefix({}, "tf==2.21.0", "cpu A")
    assert base == cc.cache_prefix(
        {"TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory=/a"}, "tf==2.21.0", "cpu A")
    assert len({base, cc.cache_prefix({}, "tf==2.20.0", "cpu A"),
                cc.cache_prefix({}, "tf==2.21.0", "cpu B"),
                cc.cache_prefix({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"},
                                "tf==2.21.0", "cpu A")}) == 4
    assert "__" not in base  # TensorFlow separates the name's parts with "__"


# --- which entries ------------------------------------------------------------------------

def test_a_whole_entry_passes_and_every_truncation_fails():
    name, data = _entry()
    assert _problem(name, data) is None
    for size in range(len(data)):
        assert _problem(name, data[:size]) is not None, size


def test_garbage_and_foreign_entries_fail():
    name, data = _entry()
    assert "truncated or corrupted" in _problem(name, bytes(range(256)) * 4)
    _, other = _entry(sig=12)
    assert "another program" in _problem(name, other)
    assert _problem(name, data, prefix="tfdp-other") == "not a cache entry name"


def test_eviction_removes_the_oldest_until_under_the_bound_and_stale_temporaries():
    entries = [("c", 30.0, 100), ("a", 10.0, 100), ("b", 20.0, 100)]
    assert cc.to_evict(entries, 300) == []
    assert cc.to_evict(entries, 250) == ["a"]
    assert cc.to_evict(entries, 100) == ["a", "b"]
    temps = [("old.pbhost-1-2.tmp", 0.0), ("new.pbhost-3-4.tmp", 9000.0)]
    assert cc.to_evict([], 0, temps, now=9100.0) == ["old.pbhost-1-2.tmp"]


def test_first_step_verdict():
    before = {"e1": (1, 1, 5)}
    assert cc.first_step_verdict({}, {}, False) is None
    assert cc.first_step_verdict({}, {"e1": (1, 1, 5)}, False) == "compiled"
    assert cc.first_step_verdict(before, {"e1": (2, 7, 5)}, False) == "compiled"  # rewritten
    assert cc.first_step_verdict(before, dict(before), False) == "cache"
    assert cc.first_step_verdict(before, dict(before), True) == "unknown"


# --- a process's configuration ------------------------------------------------------------

def test_configure_removes_a_bad_entry_evicts_and_sets_the_flags(tmp_path, fresh, caplog):
    env = {COMPILE_CACHE_ENV: str(tmp_path), "TF_XLA_FLAGS": "--tf_xla_auto_jit=-1",
           "TFDP_COMPILE_CACHE_MAX_MB": "0.002"}  # 2 kB: room for one entry
    prefix = cc.cache_prefix(env, "tf", "hw")
    (tmp_path / "old.pb").write_bytes(b"o" * 1500)  # another prefix's, written long ago
    os.utime(tmp_path / "old.pb", (1, 1))
    good_name, good = _entry(prefix=prefix)
    bad_name, bad = _entry(sig=99, prefix=prefix)
    (tmp_path / good_name).write_bytes(good)
    (tmp_path / bad_name).write_bytes(bad[:-10])
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        assert cc.configure(env, tf_version="tf", hardware="hw").source == "env"
    assert sorted(os.listdir(tmp_path)) == [good_name]
    assert [r.getMessage() for r in caplog.records if bad_name in r.getMessage()]
    assert env["TF_XLA_FLAGS"] == (f"--tf_xla_auto_jit=-1 --tf_xla_persistent_cache_directory="
                                   f"{tmp_path} --tf_xla_persistent_cache_prefix={prefix}")
    assert cc.active().directory == str(tmp_path) and not cc.active().read_only


def _make_read_only(path):
    """chmod for a user, the immutable attribute for root (who writes through modes)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("no way to make a directory read-only for root here (chattr +i)")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_directory_is_read_only_and_a_bad_entry_there_turns_it_off(
        tmp_path, fresh, caplog):
    prefix = cc.cache_prefix({}, "tf", "hw")
    name, data = _entry(prefix=prefix)
    (tmp_path / name).write_bytes(data)
    undo = _make_read_only(tmp_path)
    try:
        env = {COMPILE_CACHE_ENV: str(tmp_path)}
        cc.configure(env, tf_version="tf", hardware="hw")
        assert env["TF_XLA_FLAGS"].endswith("--tf_xla_persistent_cache_read_only=true")
        assert cc.active().read_only
        undo()
        (tmp_path / name).write_bytes(data[:50])
        undo = _make_read_only(tmp_path)
        cc._active = None
        env = {COMPILE_CACHE_ENV: str(tmp_path)}
        with caplog.at_level(logging.WARNING, logger="tfdp"):
            assert cc.configure(env, tf_version="tf", hardware="hw").source == "off"
        assert "TF_XLA_FLAGS" not in env and cc.active() is None
        assert any("read-only" in r.getMessage() for r in caplog.records)
    finally:
        undo()


# --- real jobs ----------------------------------------------------------------------------

def _first_step_lines(log):
    return re.findall(r"\[w(\d)\] tfdp: first step .*XLA program\(s\) ([a-z]+)", log)


@pytest.mark.slow
@pytest.mark.multiworker
def test_a_sigkilled_worker_restarts_from_the_cache_and_ends_like_an_uninterrupted_run(tmp_path):
    knobs = dict(TFDP_TEST_JIT=1, TFDP_TEST_EPOCHS=2)
    ref = tmp_path / "ref"
    ref.mkdir()
    code, log = run_job(launcher(cpu_replicas=1, extra=("--compile-cache", "off")),
                        environment(ref, ref / "backup", **knobs), TIMEOUT)
    assert code == 0, log
    assert not _first_step_lines(log), log  # the cache is off: nothing to say
    out, cache = tmp_path / "job", tmp_path / "cache"
    out.mkdir()
    code, log = run_job(
        launcher(cpu_replicas=1, extra=("--max-restarts", "1", "--output", "all",
                                        "--compile-cache", cache)),
        environment(out, out / "backup", TFDP_TEST_FAIL="1:9:kill", **knobs), TIMEOUT)
    assert code == 0, log
    before, sep, after = log.partition("restart 1/1: worker 1 exited with 137 (SIGKILL)")
    assert sep, log
    assert sorted(_first_step_lines(before)) == [("0", "compiled"), ("1", "compiled")], log
    assert sorted(_first_step_lines(after)) == [("0", "loaded"), ("1", "loaded")], log
    assert [n for n in os.listdir(cache) if n.endswith(".pb")], os.listdir(cache)
    assert_same_weights(weights(out), weights(ref), tol=1e-6)


SCRIPT = WORKER  # alone, one process, one replica: Keras compiles its whole step with XLA


def _alone(tmp_path, cache, tag):
    out = tmp_path / tag
    out.mkdir()
    env = environment(out, out / "backup", TFDP_TEST_JIT=1, TFDP_TEST_EPOCHS=1,
                      **{COMPILE_CACHE_ENV: cache})
    proc = subprocess.run([os.sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    return log


@pytest.mark.slow
def test_a_corrupted_entry_and_a_read_only_directory_cost_a_recompilation_not_the_job(tmp_path):
    cache = tmp_path / "cache"
    assert "XLA program(s) compiled" in _alone(tmp_path, cache, "cold")
    entries = [n for n in os.listdir(cache) if n.endswith(".pb")]
    assert entries
    for name in entries:  # a copy cut short, as a full disk or a bad sync leaves it
        with open(cache / name, "r+b") as f:
            f.truncate(os.path.getsize(cache / name) // 2)
    log = _alone(tmp_path, cache, "corrupted")
    assert f"XLA compile cache: removed {entries[0]} (truncated or corrupted" in log, log
    assert "XLA program(s) compiled" in log, log
    undo = _make_read_only(cache)
    try:
        log = _alone(tmp_path, cache, "read_only")
    finally:
        undo()
    assert "is read-only here" in log and "read-only cache" in log, log
