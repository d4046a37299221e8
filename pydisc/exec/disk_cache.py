"""The on-disk compile cache: `.vmfb` bytes keyed by everything that determines them, shared by processes.

Entries are executable code, so:
- the folder must belong to the user and be writable by nobody else (checked on every access, refused
  with `CacheDirError` otherwise; created with mode 0700);
- every entry carries the key it was made for, the versions of the toolchain that made it and a sha256
  of all that and its bytes; an entry that is damaged, of an older format, filed under another key or
  made by another toolchain is never loaded: it is removed, counted (`disk_cache_discarded`), warned of
  once and compiled again. An entry that loads but fails to run is removed by its caller (`discard`);
- writes go to a temporary file in the same folder and are renamed into place (`os.replace`), so a
  reader sees a whole entry or none, and concurrent writers of one key simply replace each other;
- a process about to compile an entry holds a lock on it (`compiling`), so processes sharing the folder
  (the ranks of a distributed job on one host) compile it once: the others wait, then read it.

Size is bounded least-recently-used: a hit touches the entry's mtime, and a write evicts the oldest
entries while the folder is over its limit. Anything else that goes wrong on disk (a read-only home, a
full disk) warns once and leaves compiling as it was. See docs/cache.md.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass

from .._version import __version__
from ..config import CONFIG
from ..metrics import METRICS, METRICS_LOCK
from .errors import CacheDirError, CacheWarning
from .target import Target

try:
    import fcntl
except ImportError:   # not POSIX: no compile locks
    fcntl = None

__all__ = [
    "DiskCache", "CacheInfo", "configured_disk_cache", "resolve_cache_dir", "cache_key", "cache_command",
    "ENTRY_SUFFIX",
]

ENTRY_SUFFIX = ".vmfb"
# Entry layout: magic, sha256 of the body, body length (8 bytes, little endian), body. The body: the
# length of a JSON header (4 bytes, little endian), the header ({"key", "toolchain"}), the .vmfb bytes.
_MAGIC = b"PYDISC\x00\x02"
_OLDER_MAGICS = (b"PYDISC\x00\x01",)
_HEADER_SIZE = len(_MAGIC) + 32 + 8
CHOICES_FILE = "speed_choices.json"     # the measured speed choices kept next to the entries (choices.py)
_TEMP_PREFIX = ".tmp-"
_LOCK_PREFIX = ".lock-"
_STALE_TEMP_SECONDS = 3600  # a temp file (or lock file) this old was left by a process that died mid-write
_KEY_FORMAT = "pydisc-vmfb-cache-1"
_MB = 1024 * 1024

_WARNED: set[str] = set()


@dataclass(frozen=True, slots=True)
class CacheInfo:
    directory: str
    entries: int
    total_bytes: int
    max_bytes: int
    exists: bool


class DiskCache:
    """One cache folder. Keys are 64 hex digits (`cache_key`); values are `.vmfb` bytes."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"DiskCache({self.directory!r}, max_bytes={self.max_bytes})"

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + ENTRY_SUFFIX)

    # -- lookups and writes ------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, verified; None on a miss. An entry that is damaged, of an older format, filed
        under another key or made by another toolchain is removed, counted and warned of; a miss."""
        if not self._usable():
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                opened = os.fstat(f.fileno())
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            _warn_once("read", f"pydisc could not read the compile cache entry {path} ({e}); compiling instead")
            return None
        entry = _unpack(blob)
        problem = entry if isinstance(entry, str) else _mismatch(entry, key)
        if problem is not None:
            _remove_if_unchanged(path, opened)
            with METRICS_LOCK:
                METRICS.disk_cache_discarded[problem] += 1
            _warn_once("discard:" + problem, f"pydisc discarded the compile cache entry {path}: {problem}; "
                                             "compiling it again (counted in metrics()['disk_cache_discarded'])")
            return None
        try:
            os.utime(path)  # least-recently-used order is mtime order
        except OSError:
            pass
        return entry.payload

    def contains(self, key: str) -> bool:
        """Whether an entry exists (unverified: `get` checks it)."""
        return self._usable() and os.path.exists(self.path(key))

    def put(self, key: str, vmfb: bytes) -> None:
        """Store `vmfb` under `key` atomically, then evict while the folder is over its limit."""
        if not self._usable():
            return
        temp = None
        try:
            fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=ENTRY_SUFFIX, dir=self.directory)  # 0600
            with os.fdopen(fd, "wb") as f:
                f.write(_pack(key, vmfb))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path(key))
            temp = None
        except OSError as e:
            _warn_once("write", f"pydisc could not write to the compile cache {self.directory} ({e}); "
                                "compiled modules are kept in memory only. Free space, or set PYDISC_CACHE_DIR")
        finally:
            if temp is not None:
                _remove_quietly(temp)
        self.evict()

    @contextlib.contextmanager
    def compiling(self, key: str):
        """Hold the lock of `key` while it is compiled and stored: another process sharing the folder
        that wants the same entry waits here, and then finds it with `get`. Without file locks (not
        POSIX) or a usable folder, nothing waits and everyone compiles, which is safe too."""
        fd = None
        if fcntl is not None and self._usable():
            try:
                fd = os.open(os.path.join(self.directory, _LOCK_PREFIX + key), os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)   # released by close, or by the kernel if this process dies
            except OSError:
                if fd is not None:
                    os.close(fd)
                fd = None
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def discard(self, key: str) -> None:
        """Remove the entry of `key` (one that failed to load or to run): the next process compiles it."""
        _remove_quietly(self.path(key))

    # -- size and housekeeping ---------------------------------------------------------------------

    def evict(self) -> None:
        """Remove least-recently-used entries until the folder holds at most `max_bytes`."""
        entries = self._entries(remove_stale_temps=True)
        total = sum(size for _, size, _ in entries)
        for path, size, _ in sorted(entries, key=lambda e: (e[2], e[0])):
            if total <= self.max_bytes:
                break
            _remove_quietly(path)  # another process may evict the same entry; that is fine
            total -= size

    def info(self) -> CacheInfo:
        exists = os.path.isdir(self.directory)
        entries = self._entries() if exists else []
        return CacheInfo(self.directory, len(entries), sum(size for _, size, _ in entries), self.max_bytes, exists)

    def clear(self) -> tuple[int, int]:
        """Remove every entry (and leftover temp files); returns (entries removed, bytes freed)."""
        if not os.path.isdir(self.directory):
            return 0, 0
        entries = self._entries()
        for path, _, _ in entries:
            _remove_quietly(path)
        for name in os.listdir(self.directory):
            if name.startswith((_TEMP_PREFIX, _LOCK_PREFIX)) or name == CHOICES_FILE:
                _remove_quietly(os.path.join(self.directory, name))
        return len(entries), sum(size for _, size, _ in entries)

    def check_folder(self) -> None:
        """Create the folder (mode 0700) if needed; raise CacheDirError unless only this user can write it.

        Raises OSError when the folder cannot be created or read.
        """
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.stat(self.directory)
        where = self.directory
        fix = (f"Fix: `chmod 700 {where}` (if it is yours), or set PYDISC_CACHE_DIR to a folder only you can "
               "write (PYDISC_CACHE_DIR=off disables the disk cache).")
        if not stat.S_ISDIR(st.st_mode):
            raise CacheDirError(f"pydisc compile cache {where} is not a folder. Set PYDISC_CACHE_DIR to a "
                                "folder only you can write, or PYDISC_CACHE_DIR=off.", directory=where)
        if not hasattr(os, "getuid"):  # Windows: no POSIX owner and mode bits to check
            return
        if st.st_uid != os.getuid():
            raise CacheDirError(
                f"pydisc refuses the compile cache {where}: it is owned by uid {st.st_uid}, not by you "
                f"(uid {os.getuid()}), and cached entries are executable code. {fix}", directory=where)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheDirError(
                f"pydisc refuses the compile cache {where}: it is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}), and cached entries are executable code. {fix}",
                directory=where)

    def _usable(self) -> bool:
        """check_folder, with an unusable (not an unsafe) folder turned into a warning and a miss."""
        try:
            self.check_folder()  # CacheDirError (an unsafe folder) propagates
        except OSError as e:
            _warn_once("folder:" + self.directory,
                       f"pydisc cannot use the compile cache folder {self.directory} ({e}); compiling without "
                       "it. Set PYDISC_CACHE_DIR to a writable folder, or PYDISC_CACHE_DIR=off")
            return False
        return True

    def _entries(self, remove_stale_temps: bool = False) -> list[tuple[str, int, float]]:
        """(path, size, mtime) of every entry; entries removed meanwhile by other processes are skipped."""
        out = []
        now = time.time()
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            return out
        for entry in scan:
            try:
                if entry.name.endswith(ENTRY_SUFFIX) and _is_key(entry.name[: -len(ENTRY_SUFFIX)]):
                    st = entry.stat()
                    out.append((entry.path, st.st_size, st.st_mtime))
                elif remove_stale_temps and entry.name.startswith((_TEMP_PREFIX, _LOCK_PREFIX)):
                    if now - entry.stat().st_mtime > _STALE_TEMP_SECONDS:
                        _remove_quietly(entry.path)
            except FileNotFoundError:
                continue
        return out


# -- the command line (python -m pydisc.cache) ----------------------------------------------------------


def cache_command(argv: list[str] | None = None) -> int:
    """`info`: the folder, its entries, size and limit (exit 1 if the folder is refused); `clear`: empty it."""
    parser = argparse.ArgumentParser(prog="python -m pydisc.cache",
                                     description="pydisc's on-disk compile cache (docs/cache.md)")
    parser.add_argument("command", choices=["info", "clear"])
    args = parser.parse_args(argv)
    cache = configured_disk_cache()
    if cache is None:
        print("pydisc compile cache: disabled (PYDISC_CACHE_DIR=off)")
        return 0
    if os.path.lexists(cache.directory) and not os.path.isdir(cache.directory):
        print(f"refused  {cache.directory} is not a folder. Set PYDISC_CACHE_DIR to a folder only you can "
              "write, or PYDISC_CACHE_DIR=off.")
        return 1
    if args.command == "clear":
        removed, freed = cache.clear()
        print(f"removed {removed} entries ({freed / _MB:.2f} MB) from {cache.directory}")
        return 0
    info = cache.info()
    print(f"folder   {info.directory}{'' if info.exists else ' (not created yet)'}")
    print(f"entries  {info.entries}")
    print(f"size     {info.total_bytes / _MB:.2f} MB ({info.total_bytes} bytes)")
    print(f"limit    {info.max_bytes / _MB:.0f} MB (PYDISC_CACHE_MAX_MB)")
    if info.exists:
        try:
            cache.check_folder()
        except (CacheDirError, OSError) as e:
            print(f"refused  {e}")
            return 1
    return 0


# -- which folder ------------------------------------------------------------------------------------


def resolve_cache_dir(setting: str) -> str | None:
    """The folder PYDISC_CACHE_DIR names: '' means $XDG_CACHE_HOME/pydisc or ~/.cache/pydisc; 'off' None."""
    setting = setting.strip()
    if setting.lower() == "off":
        return None
    if setting:
        return os.path.abspath(os.path.expanduser(setting))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is invalid and ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pydisc")


def configured_disk_cache() -> DiskCache | None:
    """The cache that CONFIG names (PYDISC_CACHE_DIR, PYDISC_CACHE_MAX_MB); None when disabled."""
    directory = resolve_cache_dir(CONFIG.cache_dir)
    if directory is None:
        return None
    return DiskCache(directory, max(0, int(CONFIG.cache_max_mb * _MB)))


# -- keys ---------------------------------------------------------------------------------------------


def cache_key(text_digest: str, target: Target, input_type: str = "stablehlo") -> str:
    """sha256 over the MLIR text's hash, its input type (stablehlo, torch), the target and its flags, the
    IREE and pydisc versions, and, for flags that compile for the host CPU, that CPU (a shared home folder
    may serve different machines)."""
    parts = [_KEY_FORMAT, text_digest, input_type, target.name, *target.flags, *_toolchain()]
    if any(flag.endswith("=host") for flag in target.flags):
        parts.append(_host_cpu())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.cache
def _toolchain() -> tuple[str, ...]:
    return (
        "iree-compiler " + _iree_version("iree.compiler", "iree-base-compiler"),
        "iree-runtime " + _iree_version("iree.runtime", "iree-base-runtime"),
        "pydisc " + _pydisc_version(),
    )


def _iree_version(package: str, distribution: str) -> str:
    try:
        version = __import__(package + ".version", fromlist=["VERSION"])
        return f"{version.VERSION} {sorted(getattr(version, 'REVISIONS', {}).items())}"
    except (ImportError, AttributeError):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


def _pydisc_version() -> str:
    return __version__


@functools.cache
def _host_cpu() -> str:
    """What `--iree-llvmcpu-target-cpu=host` compiles for: the machine and its CPU model and features."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                if line.startswith(("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part")):
                    parts.append(" ".join(line.split()))
    except OSError:
        pass
    return "host-cpu " + hashlib.sha256("\n".join(parts).encode()).hexdigest()


# -- entry format and small helpers --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    key: str
    toolchain: tuple[str, ...]
    payload: bytes


def _pack(key: str, vmfb: bytes) -> bytes:
    header = json.dumps({"key": key, "toolchain": list(_toolchain())}).encode()
    body = len(header).to_bytes(4, "little") + header + vmfb
    return _MAGIC + hashlib.sha256(body).digest() + len(body).to_bytes(8, "little") + body


def _unpack(blob: bytes) -> _Entry | str:
    """The entry if it is whole and its hash matches, else why not."""
    if blob.startswith(_OLDER_MAGICS):
        return "an entry of an older pydisc's format"
    if len(blob) < _HEADER_SIZE or not blob.startswith(_MAGIC):
        return "not a pydisc cache entry"
    digest = blob[len(_MAGIC): len(_MAGIC) + 32]
    length = int.from_bytes(blob[len(_MAGIC) + 32: _HEADER_SIZE], "little")
    body = blob[_HEADER_SIZE:]
    if len(body) != length or hashlib.sha256(body).digest() != digest:
        return "damaged (truncated, or its bytes do not match their hash)"
    size = int.from_bytes(body[:4], "little")
    try:
        header = json.loads(body[4: 4 + size])
        return _Entry(str(header["key"]), tuple(header["toolchain"]), body[4 + size:])
    except (ValueError, KeyError, TypeError):
        return "damaged (its header does not parse)"


def _mismatch(entry: _Entry, key: str) -> str | None:
    """Why an intact entry found under `key` must not be loaded, or None."""
    if entry.key != key:
        return "filed under another key than the one it was made for"
    if entry.toolchain != _toolchain():
        return "made by another toolchain (%s)" % ", ".join(entry.toolchain)
    return None


def _is_key(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _remove_if_unchanged(path: str, opened: os.stat_result) -> None:
    # Remove the damaged file we read, not a good entry another process renamed into place meanwhile
    # (what remains is a tiny window in which a good entry may be removed: it is then compiled again).
    try:
        current = os.stat(path)
        if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            os.remove(path)
    except OSError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, CacheWarning, stacklevel=4)
