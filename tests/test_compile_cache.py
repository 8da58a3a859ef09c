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
    auto = {COMPILE_CACHE_ENV: "Auto", "XDG_CACHE_HOME": "/xdg"}
    assert cc.resolve(auto, "/b") == cc.CacheSetting("auto", "/xdg/tfdp/xla")


def _current(directory="/home/u/.cache/tfdp/xla", link="/tmp/tfdp-xla-1/cache", read_only=False):
    return cc._Active(directory, PREFIX, read_only, link, "auto" if link else "env")


def test_only_a_linked_writable_cache_moves_beside_local_backups():
    """The decision BackupAndRestore applies (no processes, no files)."""
    assert cc.beside_backups_target("/jobs/r1/backup/", _current()) == "/jobs/r1/backup-xla-cache"
    assert cc.beside_backups_target("/b", None) is None  # no cache in this process
    # a directory the user chose (TFDP_COMPILE_CACHE=DIR, --compile-cache DIR, TF_XLA_FLAGS)
    # is configured without a link: it stays
    assert cc.beside_backups_target("/b", _current(link=None)) is None
    # TensorFlow read the read-only flag once: a read-only cache would stay read-only there
    assert cc.beside_backups_target("/b", _current(read_only=True)) is None
    assert cc.beside_backups_target("gs://bucket/backup", _current()) is None
    assert cc.beside_backups_target("/b", _current(directory="/b-xla-cache")) is None  # there
    assert cc.beside_backups_target("", _current()) is None


def test_tfdp_run_sets_the_switch_for_its_workers(tmp_path):
    policy = Policy(num_workers=1)
    env = {"HOME": str(tmp_path)}
    assert Launcher(["true"], policy, env=env).env[COMPILE_CACHE_ENV] == "auto"
    assert cc.resolve({COMPILE_CACHE_ENV: "auto", **env}).directory == \
        default_compile_cache_dir(env) == str(tmp_path / ".cache" / "tfdp" / "xla")
    assert Launcher(["true"], policy, env=env, compile_cache="/d").env[COMPILE_CACHE_ENV] == "/d"
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


def test_auto_links_the_default_and_backup_and_restore_moves_the_link(tmp_path, fresh, caplog):
    """Under ``auto`` TF_XLA_FLAGS names a link in a private directory (inside the attempt's
    control directory), which ``configure_beside_backups`` re-points at <backup_dir>-xla-cache
    after checking that directory (a bad entry there is removed); a second BackupAndRestore of
    the same directory changes nothing, and the link is removed at exit, not its target.
    Guard: with the re-point disabled (``_point`` a no-op, run once) this failed at the
    readlink assertion after configure_beside_backups."""
    control = tmp_path / "control"
    control.mkdir()
    env = {COMPILE_CACHE_ENV: "auto", "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "TFDP_CONTROL_DIR": str(control)}
    default = tmp_path / "xdg" / "tfdp" / "xla"
    assert cc.configure(env, tf_version="tf", hardware="hw") == \
        cc.CacheSetting("auto", str(default))
    active = cc.active()
    link = active.link
    assert os.path.dirname(os.path.dirname(link)) == str(control)
    assert f"--tf_xla_persistent_cache_directory={link} " in env["TF_XLA_FLAGS"]
    assert os.readlink(link) == str(default) and active.directory == str(default)
    beside = tmp_path / "job" / "backup-xla-cache"
    beside.mkdir(parents=True)
    bad_name, bad = _entry(prefix=active.prefix)
    (beside / bad_name).write_bytes(bad[:20])
    with caplog.at_level(logging.INFO, logger="tfdp"):
        moved = cc.configure_beside_backups(str(tmp_path / "job" / "backup"), True, env)
    assert moved == cc.CacheSetting("backups", str(beside))
    assert os.readlink(link) == str(beside) and active.directory == str(beside)
    assert os.listdir(beside) == []  # the bad entry went before TensorFlow could read it
    assert any("now beside the backups" in r.getMessage() for r in caplog.records)
    flags = env["TF_XLA_FLAGS"]
    assert cc.configure_beside_backups(str(tmp_path / "job" / "backup"), True, env).directory == \
        str(beside)
    assert env["TF_XLA_FLAGS"] == flags  # the flags were read once; only the link moves
    cc._remove_link(os.path.dirname(link), os.getpid())
    assert not os.path.lexists(link) and beside.is_dir() and default.is_dir()


def test_a_directory_the_user_chose_does_not_move(tmp_path, fresh):
    env = {COMPILE_CACHE_ENV: str(tmp_path / "mine")}
    cc.configure(env, tf_version="tf", hardware="hw")
    assert cc.active().link is None
    assert cc.configure_beside_backups(str(tmp_path / "backup"), True, env) == \
        cc.CacheSetting("env", str(tmp_path / "mine"))
    assert not (tmp_path / "backup-xla-cache").exists()
    assert f"directory={tmp_path / 'mine'} " in env["TF_XLA_FLAGS"]


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


def test_an_unwritable_backups_directory_keeps_the_link_where_it_was(tmp_path, fresh, caplog):
    env = {COMPILE_CACHE_ENV: "auto", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cc.configure(env, tf_version="tf", hardware="hw")
    link, default = cc.active().link, cc.active().directory
    beside = tmp_path / "backup-xla-cache"
    beside.mkdir()
    undo = _make_read_only(beside)
    try:
        with caplog.at_level(logging.WARNING, logger="tfdp"):
            kept = cc.configure_beside_backups(str(tmp_path / "backup"), True, env)
        assert os.readlink(link) == default
    finally:
        undo()
        cc._remove_link(os.path.dirname(link), os.getpid())
    assert kept == cc.CacheSetting("auto", default) and cc.active().directory == default
    assert any("stays at" in r.getMessage() and "cannot write" in r.getMessage()
               for r in caplog.records)


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
    assert not (out / "backup-xla-cache").exists()  # --compile-cache DIR: the user's choice
    assert_same_weights(weights(out), weights(ref), tol=1e-6)


def _entries(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("tfdp-") and n.endswith(".pb")) \
        if os.path.isdir(directory) else []


@pytest.mark.slow
@pytest.mark.multiworker
def test_by_default_a_tfdp_run_job_keeps_its_programs_beside_its_backups(tmp_path):
    """tfdp-run without --compile-cache (``auto``): the script creates its BackupAndRestore
    after TensorFlow started, and the workers' programs still land in <backup>-xla-cache, none
    in the per-user default; after worker 1 is SIGKILLed both restarted workers load them.
    Guard: with the re-point disabled (``_point`` made a no-op, run once) this test failed at
    the first assertion on <backup>-xla-cache, the entries having gone to XDG_CACHE_HOME."""
    out, xdg = tmp_path / "job", tmp_path / "xdg"
    out.mkdir()
    env = environment(out, out / "backup", TFDP_TEST_FAIL="1:9:kill", TFDP_TEST_JIT=1,
                      TFDP_TEST_EPOCHS=2, XDG_CACHE_HOME=xdg)
    env.pop(COMPILE_CACHE_ENV)  # tests/launching.py turns it off for every other job
    code, log = run_job(launcher(cpu_replicas=1, extra=("--max-restarts", "1", "--output", "all")),
                        env, TIMEOUT)
    assert code == 0, log
    beside = out / "backup-xla-cache"
    assert _entries(beside), (os.listdir(out), _entries(xdg / "tfdp" / "xla"), log)
    assert _entries(xdg / "tfdp" / "xla") == [], log
    assert sorted(re.findall(r"\[w(\d)\] tfdp: XLA compile cache now beside the backups: (\S+)",
                             log)) == sorted([("0", str(beside)), ("1", str(beside))] * 2), log
    before, sep, after = log.partition("restart 1/1: worker 1 exited with 137 (SIGKILL)")
    assert sep, log
    assert sorted(_first_step_lines(before)) == [("0", "compiled"), ("1", "compiled")], log
    assert sorted(_first_step_lines(after)) == [("0", "loaded"), ("1", "loaded")], log


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
