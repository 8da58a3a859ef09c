"""XLA's persistent compilation cache for tfdp jobs: restarts load compiled programs.

Rule. TensorFlow keeps XLA's compiled programs in a directory when ``TF_XLA_FLAGS`` names one
(``--tf_xla_persistent_cache_directory``), and reads that variable once, when it first
initialises its devices. So tfdp decides *before* that moment, in the process's environment:
a user's ``TF_XLA_FLAGS`` that names a cache directory wins (tfdp then touches nothing);
else ``TFDP_COMPILE_CACHE`` says where: ``off``; a directory; or ``auto`` (``tfdp-run``'s
default for every worker), the per-user ``$XDG_CACHE_HOME/tfdp/xla`` until a
``BackupAndRestore(backup_dir)`` moves the process's cache beside its backups
(``<backup_dir>-xla-cache``, below); else a ``BackupAndRestore`` created before TensorFlow
initialised its devices puts the cache beside its backups. Before TensorFlow may read it,
tfdp makes the directory safe for TensorFlow's reader, which fails the step on any bad entry
(measured, TF 2.21: a truncated entry raises ``OutOfRangeError``, garbage ``DataLossError``,
another program's entry ``InvalidArgumentError``, an unwritable directory ``NotFoundError``):

* entries are named with a prefix that hashes the TensorFlow version, the XLA flags and the
  host's CPU features and GPU models, so a foreign entry (another TensorFlow, another CPU or
  GPU) is never read;
* every entry of that prefix is checked (its protobuf framing and its key against its file
  name); a bad one is removed (or, in a directory tfdp cannot write, the cache is off for the
  process), with one message: it costs a recompilation, never a crash;
* a directory tfdp cannot write is used read-only (``--tf_xla_persistent_cache_read_only``);
* entries beyond the size bound (``TFDP_COMPILE_CACHE_MAX_MB``, default 4096) are evicted oldest
  first, and temporary files a killed writer left are removed.

Several writers are safe: TensorFlow writes each entry to a temporary file in the directory
and renames it into place (measured with strace), so a reader sees a whole entry or none.

Beside the backups, after TensorFlow started (``auto``). A usual script creates its
``BackupAndRestore`` after TensorFlow read ``TF_XLA_FLAGS``, yet the backup directory is what
every restart and relaunch finds again (a shared volume, where a pod moved to another node
loses its home). So under ``auto`` the flag names a symbolic link this process owns, made at
``import tfdp`` to the per-user directory, which ``BackupAndRestore`` re-points (after the same
checks) at ``<backup_dir>-xla-cache``. TensorFlow keeps the directory's *name* and opens files
under it at each XLA compilation (measured, TF 2.21: re-pointed after devices were initialised,
the first compilation's entry went to the new target; re-pointed after a compilation, the next
one did; a second process linked there loaded it). Limits, measured too: the read-only flag is
read once, so only a writable cache moves, and only to a directory tfdp can write; a link to a
missing target fails every XLA step (``NotFoundError``), so the link never dangles and moves
atomically (a new link renamed over it). Hence no link for plain scripts: it would need a real
directory that every compilation writes to even in a job that never makes a ``BackupAndRestore``.

Each worker makes its own link (not tfdp-run): private by construction (a fresh ``mkdtemp`` per
process: never shared by workers on one host or by jobs), the same on hosts reached over ssh,
and the launcher stays policy. It goes inside the attempt's ``TFDP_CONTROL_DIR`` when there is
one, which tfdp-run removes with the job (a SIGKILLed worker's link too); a process removes its
own at exit. A child process inherits ``TF_XLA_FLAGS``, so it follows the link while it lives.

Pure Python (no TensorFlow): the decisions (``resolve``, ``beside_backups_target``,
``entry_problem``, ``to_evict``, ``first_step_verdict``) are pure functions; ``configure`` and
``configure_beside_backups`` apply them to an environment.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Mapping, MutableMapping, Optional

from tfdp.protocol import (COMPILE_CACHE_AUTO, COMPILE_CACHE_ENV, COMPILE_CACHE_MAX_MB_ENV,
                           CONTROL_DIR_ENV, default_compile_cache_dir)

__all__ = ["CacheSetting", "resolve", "configure", "configure_beside_backups", "active",
           "beside_backups_target",
           "cache_prefix", "entry_problem", "check_entries", "to_evict", "evict",
           "first_step_verdict", "FirstStep", "snapshot", "OFF_WORDS", "DEFAULT_MAX_MB",
           "XLA_FLAGS_ENV", "DIRECTORY_FLAG"]

log = logging.getLogger("tfdp")

XLA_FLAGS_ENV = "TF_XLA_FLAGS"
DIRECTORY_FLAG = "--tf_xla_persistent_cache_directory"
PREFIX_FLAG = "--tf_xla_persistent_cache_prefix"
READ_ONLY_FLAG = "--tf_xla_persistent_cache_read_only"
OFF_WORDS = ("off", "0", "false", "no", "none")
DEFAULT_MAX_MB = 4096
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old belongs to a writer that died
_SUFFIX = ".pb"


@dataclasses.dataclass(frozen=True)
class CacheSetting:
    """What ``resolve`` decided: ``source`` is ``"user"`` (TF_XLA_FLAGS names a cache),
    ``"off"``, ``"env"`` (TFDP_COMPILE_CACHE names a directory), ``"auto"``
    (``TFDP_COMPILE_CACHE=auto``: the per-user directory until a ``BackupAndRestore`` moves it),
    ``"backups"`` or ``"none"``; ``directory`` is where tfdp puts the cache (None unless
    env/auto/backups)."""
    source: str
    directory: Optional[str] = None


@dataclasses.dataclass
class _Active:
    directory: str  # where entries go now (a link's current target)
    prefix: str
    read_only: bool
    link: Optional[str] = None  # the link TF_XLA_FLAGS names (``auto``): it can be re-pointed
    source: str = "env"  # resolve's source when it was configured


_active: Optional[_Active] = None


def active() -> Optional[_Active]:
    """The cache tfdp configured in this process (directory, prefix, read_only, link), or None."""
    return _active


def resolve(environ: Mapping[str, str], beside_backups: Optional[str] = None) -> CacheSetting:
    """Where XLA's compiled programs go for this process; pure policy (see the module rule)."""
    if DIRECTORY_FLAG in environ.get(XLA_FLAGS_ENV, ""):
        return CacheSetting("user")
    value = environ.get(COMPILE_CACHE_ENV, "").strip()
    if value.lower() in OFF_WORDS:
        return CacheSetting("off")
    if value.lower() == COMPILE_CACHE_AUTO:
        return CacheSetting("auto", default_compile_cache_dir(environ))
    if value:
        return CacheSetting("env", os.path.abspath(os.path.expanduser(value)))
    beside = _beside(beside_backups)
    return CacheSetting("backups", beside) if beside else CacheSetting("none")


def _beside(backup_dir: Optional[str]) -> Optional[str]:
    """``<backup_dir>-xla-cache`` for a local backup directory; None for none or a URL (the
    backups go through TensorFlow's file system there, the cache through ours)."""
    if not backup_dir or "://" in backup_dir:
        return None
    return os.path.abspath(backup_dir.rstrip("/\\")) + "-xla-cache"


def beside_backups_target(backup_dir: Optional[str], current: Optional[_Active]) -> Optional[str]:
    """Where ``BackupAndRestore(backup_dir)`` moves this process's cache now, or None (it
    stays); pure policy. Only a cache tfdp configured through its own link moves (``auto``, so
    never a directory the user chose nor a user's ``TF_XLA_FLAGS``), only a writable one
    (TensorFlow read the read-only flag once), only to a local directory, and only if it is not
    there already.

    Args:
        backup_dir: the callback's backup directory (a path or a URL).
        current: the process's cache (``active()``), or None.
    """
    if current is None or current.link is None or current.read_only:
        return None
    target = _beside(backup_dir)
    return None if target is None or target == current.directory else target


def _tensorflow_version() -> str:
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover
        return "unknown"
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly",
                 "tensorflow-intel", "tensorflow-macos"):
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _hardware() -> str:
    """The CPU's model and feature flags and the NVIDIA GPUs' models and driver, as text read
    from /proc (no TensorFlow, no subprocess): what an executable compiled here depends on."""
    parts = [platform.machine(), sys.platform]
    cpu = _read("/proc/cpuinfo").split("\n\n")[0]
    parts += [line for line in cpu.splitlines()
              if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    gpus = "/proc/driver/nvidia/gpus"
    if os.path.isdir(gpus):
        for name in sorted(os.listdir(gpus)):
            info = _read(os.path.join(gpus, name, "information"))
            parts += [line for line in info.splitlines() if line.startswith("Model")]
        parts.append(_read("/proc/driver/nvidia/version").split("\n")[0])
    return "\n".join(parts)


def cache_prefix(environ: Mapping[str, str], tf_version: Optional[str] = None,
                 hardware: Optional[str] = None) -> str:
    """The entry name prefix: ``tfdp-`` and a hash of what makes a compiled program valid
    here (TensorFlow version, XLA flags other than the cache's, CPU/GPU identity)."""
    other_flags = " ".join(flag for flag in environ.get(XLA_FLAGS_ENV, "").split()
                           if not flag.startswith("--tf_xla_persistent_cache"))
    text = "\n".join([tf_version or _tensorflow_version(), other_flags,
                      environ.get("XLA_FLAGS", ""),
                      _hardware() if hardware is None else hardware])
    return "tfdp-" + hashlib.sha256(text.encode()).hexdigest()[:16]


# --- entries ------------------------------------------------------------------------------

def _varint(read) -> int:
    value, shift = 0, 0
    while True:
        byte = read(1)
        if not byte:
            raise ValueError("ends inside a varint")
        value |= (byte[0] & 0x7F) << shift
        shift += 7
        if not byte[0] & 0x80:
            return value
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(stream, end: int, keep=(1,)):
    """Top-level protobuf fields of ``stream`` up to ``end``: {number: [value]}; the payload of
    a length-delimited field is read only for the numbers in ``keep`` (else skipped)."""
    fields: dict = {}
    while stream.tell() < end:
        key = _varint(stream.read)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value = _varint(stream.read)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value = stream.read(size)
            if len(value) != size:
                raise ValueError("ends inside a fixed-size field")
        elif wire == 2:
            size = _varint(stream.read)
            if stream.tell() + size > end:
                raise ValueError(f"field {number} runs {stream.tell() + size - end} bytes past the end")
            if number in keep:
                value = stream.read(size)
            else:
                stream.seek(size, os.SEEK_CUR)
                value = size
        else:
            raise ValueError(f"wire type {wire}")
        fields.setdefault(number, []).append(value)
    if stream.tell() != end:
        raise ValueError("runs past the end")
    return fields


def entry_problem(name: str, stream, size: int, prefix: str) -> Optional[str]:
    """What is wrong with the cache entry ``name`` (``stream``: its bytes, ``size`` long), or
    None. An entry is TensorFlow's ``XlaSerializedCacheEntry`` written as
    ``<prefix>__<signature>__<cluster>__<device>.pb``: a key (1: signature fingerprint,
    2: cluster fingerprint, 3: device type, 4: prefix), the HLO module (2) and the executable
    (3), each exactly once and filling the file. Pure: reads only ``stream``."""
    import io
    parts = name[:-len(_SUFFIX)].split("__") if name.endswith(_SUFFIX) else []
    if len(parts) != 4 or parts[0] != prefix or not (parts[1].isdigit() and parts[2].isdigit()):
        return "not a cache entry name"
    try:
        top = _fields(stream, size, keep=(1,))
        for number, what in ((1, "key"), (2, "HLO module"), (3, "executable")):
            if len(top.get(number, ())) != 1:
                return f"truncated or corrupted: {what} missing"
        raw_key = top[1][0]
        key = _fields(io.BytesIO(raw_key), len(raw_key), keep=(3, 4))
    except ValueError as e:
        return f"truncated or corrupted: {e}"
    want = {1: int(parts[1]), 2: int(parts[2]), 3: parts[3].encode(), 4: prefix.encode()}
    for number, value in want.items():
        if key.get(number, [None])[0] != value:
            return "its key does not match its name (another program's entry)"
    return None


def snapshot(directory: str, prefix: str) -> dict:
    """{entry name: (mtime_ns, inode, size)} of the entries of ``prefix`` in ``directory``."""
    found = {}
    try:
        with os.scandir(directory) as items:
            for item in items:
                if item.name.startswith(prefix + "__") and item.name.endswith(_SUFFIX):
                    try:
                        st = item.stat()
                    except OSError:
                        continue
                    found[item.name] = (st.st_mtime_ns, st.st_ino, st.st_size)
    except OSError:
        pass
    return found


def check_entries(directory: str, prefix: str, remove: bool) -> list:
    """[(name, problem)] of the bad entries of ``prefix``; removed when ``remove``."""
    bad = []
    for name in sorted(snapshot(directory, prefix)):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                problem = entry_problem(name, f, os.fstat(f.fileno()).st_size, prefix)
        except OSError as e:
            problem = f"unreadable: {e.strerror}"
        if problem:
            bad.append((name, problem))
            if remove:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass  # another worker removed it first
    return bad


def to_evict(entries, max_bytes: int, temporaries=(), now: float = 0.0,
             stale_seconds: float = STALE_TEMP_SECONDS) -> list:
    """Names to remove; pure policy. ``entries``: [(name, mtime, size)]: the oldest (by write
    time: TensorFlow does not touch an entry it reads) go first until the rest fit in
    ``max_bytes``. ``temporaries``: [(name, mtime)] of unfinished writes: those older than
    ``stale_seconds`` at ``now`` belong to a writer that died."""
    names = [name for name, mtime in temporaries if now - mtime > stale_seconds]
    total = sum(size for _, _, size in entries)
    for name, _, size in sorted(entries, key=lambda e: (e[1], e[0])):
        if total <= max_bytes:
            break
        names.append(name)
        total -= size
    return names


def evict(directory: str, max_bytes: int, now: Optional[float] = None) -> list:
    """Applies ``to_evict`` to every entry in ``directory`` (all prefixes: the bound is the
    directory's). Returns the names removed."""
    entries, temporaries = [], []
    try:
        with os.scandir(directory) as items:
            for item in items:
                try:
                    st = item.stat()
                except OSError:
                    continue
                if item.name.endswith(_SUFFIX):
                    entries.append((item.name, st.st_mtime, st.st_size))
                elif item.name.endswith(".tmp") and _SUFFIX in item.name:
                    temporaries.append((item.name, st.st_mtime))
    except OSError:
        return []
    removed = []
    for name in to_evict(entries, max_bytes, temporaries, time.time() if now is None else now):
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


# --- configuring a process ----------------------------------------------------------------

def _writable(directory: str) -> bool:
    probe = os.path.join(directory, f".tfdp-probe-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
        return True
    except OSError:
        return False


def _max_bytes(environ: Mapping[str, str]) -> int:
    text = environ.get(COMPILE_CACHE_MAX_MB_ENV, "").strip()
    try:
        return int(float(text) * 2**20) if text else DEFAULT_MAX_MB * 2**20
    except ValueError:
        log.warning("tfdp: %s=%r is not a number of MB; using %d", COMPILE_CACHE_MAX_MB_ENV,
                    text, DEFAULT_MAX_MB)
        return DEFAULT_MAX_MB * 2**20


def _say_off(directory: str, why: str) -> None:
    log.warning("tfdp: XLA compile cache %s: %s; programs are compiled again in this process.",
                directory, why)


def _prepare(directory: str, prefix: str, environ: Mapping[str, str]):
    """Makes ``directory`` safe for TensorFlow's reader: created, bad entries of ``prefix``
    removed (with a warning each), the size bound kept. Returns ``(read_only, None)``, or
    ``(None, why)`` where the directory cannot be used at all."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return None, f"cannot create it ({e.strerror})"
    read_only = not _writable(directory)
    bad = check_entries(directory, prefix, remove=not read_only)
    if bad and read_only:
        return None, f"entry {bad[0][0]} is {bad[0][1]} and the directory is read-only"
    for name, problem in bad:
        log.warning("tfdp: XLA compile cache: removed %s (%s); its program is compiled again.",
                    name, problem)
    if not read_only:
        evict(directory, _max_bytes(environ))
    return read_only, None


def _remove_link(private: str, owner: int) -> None:
    # A forked child inherits the exit handler, not the link: only its maker removes it.
    if os.getpid() == owner:
        shutil.rmtree(private, ignore_errors=True)  # removes the link, never its target


def _make_link(target: str, environ: Mapping[str, str]) -> Optional[str]:
    """A symbolic link to ``target`` in a fresh private directory (in ``TFDP_CONTROL_DIR``
    when there is one, else the system's temporary directory), removed at exit.

    Args:
        target: the directory the link first points at.
        environ: the process's environment (for ``TFDP_CONTROL_DIR``).

    Returns the link's path, or None (no symlinks, no writable temporary directory, a space
    TF_XLA_FLAGS cannot hold): the directory itself is named then, and never moves.
    """
    control = environ.get(CONTROL_DIR_ENV, "").strip()
    for parent in ([control] if control and os.path.isdir(control) else []) + [None]:
        try:
            private = tempfile.mkdtemp(prefix="tfdp-xla-", dir=parent)
        except OSError:
            continue
        link = os.path.join(private, "cache")
        try:
            if any(c.isspace() for c in link):
                raise OSError("a space in the path")
            os.symlink(target, link)
        except OSError:
            shutil.rmtree(private, ignore_errors=True)
            continue
        atexit.register(_remove_link, private, os.getpid())
        return link
    return None


def _point(link: str, target: str) -> None:
    """Re-points ``link`` at ``target`` atomically (a new link renamed over it): TensorFlow
    finds the old target or the new one, never no directory (which fails its step)."""
    fresh = f"{link}.{os.getpid()}.new"
    if os.path.lexists(fresh):
        os.remove(fresh)
    os.symlink(target, fresh)
    os.replace(fresh, link)


def configure(environ: Optional[MutableMapping[str, str]] = None,
              beside_backups: Optional[str] = None, tf_version: Optional[str] = None,
              hardware: Optional[str] = None) -> CacheSetting:
    """Decides (``resolve``) and, for a tfdp cache, prepares the directory and adds the cache
    flags to ``TF_XLA_FLAGS`` in ``environ``. Call it before TensorFlow initialises its devices
    (it reads the variable then, once). Idempotent: a process configures its cache once.

    Args:
        environ: the environment to read and change (default ``os.environ``).
        beside_backups: a backup directory to put the cache beside when nothing else decides.
        tf_version: the TensorFlow version for the entries' prefix (default: installed one).
        hardware: the hardware description for the prefix (default: read from /proc).
    """
    global _active
    environ = os.environ if environ is None else environ
    setting = resolve(environ, beside_backups)
    if setting.directory is None or _active is not None:
        return setting
    directory = setting.directory
    if any(c.isspace() for c in directory):
        _say_off(directory, "TF_XLA_FLAGS cannot hold a path with spaces")
        return CacheSetting("off")
    prefix = cache_prefix(environ, tf_version, hardware)
    read_only, why = _prepare(directory, prefix, environ)
    if why is not None:
        _say_off(directory, why)
        return CacheSetting("off")
    # Under ``auto`` TensorFlow gets a link it can be moved through later (module docstring);
    # a read-only cache is never moved, so it needs none.
    link = _make_link(directory, environ) if setting.source == "auto" and not read_only else None
    flags = [environ.get(XLA_FLAGS_ENV, "").strip(), f"{DIRECTORY_FLAG}={link or directory}",
             f"{PREFIX_FLAG}={prefix}"]
    if read_only:
        flags.append(f"{READ_ONLY_FLAG}=true")
        log.warning("tfdp: XLA compile cache %s is read-only here: programs are loaded from it, "
                    "new ones are not saved.", directory)
    environ[XLA_FLAGS_ENV] = " ".join(f for f in flags if f)
    _active = _Active(directory, prefix, read_only, link, setting.source)
    return setting


def _move(current: _Active, target: str, environ: Mapping[str, str]) -> CacheSetting:
    """Re-points ``current``'s link at ``target`` once ``target`` is safe and writable."""
    read_only, why = _prepare(target, current.prefix, environ)
    why = why or ("tfdp cannot write it" if read_only else None)
    if why is None:
        try:
            _point(current.link, target)
        except OSError as e:
            why = f"the link {current.link} cannot be re-pointed ({e.strerror})"
    if why is not None:
        log.warning("tfdp: XLA compile cache stays at %s, not beside the backups at %s: %s.",
                    current.directory, target, why)
        return CacheSetting("auto", current.directory)
    log.info("tfdp: XLA compile cache now beside the backups: %s (was %s); restarts and "
             "relaunches with this backup directory load their programs from there.",
             target, current.directory)
    current.directory = target
    return CacheSetting("backups", target)


def configure_beside_backups(backup_dir: str, tensorflow_started: bool,
                             environ: Optional[MutableMapping[str, str]] = None) -> CacheSetting:
    """``BackupAndRestore(backup_dir)``'s part: the cache beside the backups.

    Under ``TFDP_COMPILE_CACHE=auto`` (tfdp-run's default) the process's link is re-pointed
    there (``beside_backups_target``), whether or not TensorFlow started. Otherwise, with
    nothing else deciding, the cache goes there if TensorFlow has not read its XLA flags yet;
    if it has, nothing can change for this process, which is said once at INFO.

    Args:
        backup_dir: the callback's backup directory.
        tensorflow_started: whether TensorFlow initialised its devices (read its flags).
        environ: the environment to read and change (default ``os.environ``).
    """
    environ, current = os.environ if environ is None else environ, _active
    target = beside_backups_target(backup_dir, current)
    if target is not None:
        return _move(current, target, environ)
    if current is not None:
        beside = _beside(backup_dir)
        stays = beside not in (None, current.directory)
        if current.source == "auto" and not current.link and stays:
            why = ("it was read-only when TensorFlow read its flags, which it reads once"
                   if current.read_only else "no link to it could be made at import")
            log.info("tfdp: XLA compile cache stays at %s, not beside the backups at %s: %s.",
                     current.directory, beside, why)
        return CacheSetting(current.source, current.directory)
    setting = resolve(environ, backup_dir)
    if setting.source != "backups":
        return setting
    if tensorflow_started:
        log.info("tfdp: XLA compile cache not on: TensorFlow read TF_XLA_FLAGS before "
                 "BackupAndRestore(%r) was created. Set %s=%s (or %s, or launch with tfdp-run) "
                 "to keep compiled programs across restarts.", backup_dir, COMPILE_CACHE_ENV,
                 setting.directory, COMPILE_CACHE_AUTO)
        return CacheSetting("none")
    return configure(environ, backup_dir)


# --- what the first step says --------------------------------------------------------------

def first_step_verdict(before: Mapping, after: Mapping, read_only: bool) -> Optional[str]:
    """Whether the first step's programs came from the cache; pure. ``"compiled"``: an entry
    was written (or rewritten) during the step, which TensorFlow does after compiling;
    ``"cache"``: entries existed and none was written; ``"unknown"``: a read-only cache (no
    writes either way); None: no entry at all (nothing compiled with XLA)."""
    if read_only:
        return "unknown" if before else None
    written = [name for name, stat in after.items() if before.get(name) != stat]
    if written:
        return "compiled"
    return "cache" if after else None


class FirstStep:
    """Times a worker's first step and says where its XLA programs came from (one INFO line)."""

    def __init__(self):
        self._cache = _active
        self._before = None
        self._start = None

    def begin(self):
        self._start = time.perf_counter()
        if self._cache is not None:
            self._before = snapshot(self._cache.directory, self._cache.prefix)

    def end(self) -> Optional[str]:
        """The line (also logged), or None when there is nothing to say."""
        if self._start is None or self._cache is None:
            return None
        seconds = time.perf_counter() - self._start
        self._start = None
        after = snapshot(self._cache.directory, self._cache.prefix)
        verdict = first_step_verdict(self._before, after, self._cache.read_only)
        if verdict is None:
            return None
        said = {"compiled": "compiled (cache miss; saved for restarts)",
                "cache": "loaded from the cache (hit)",
                "unknown": "read-only cache (hit or miss not observable)"}[verdict]
        line = (f"tfdp: first step {seconds:.2f} s (trace, XLA compile or load, run); XLA "
                f"program(s) {said}; cache {self._cache.directory}")
        log.info("%s", line)
        return line
