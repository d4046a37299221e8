"""Every file pydisc writes outside its compile cache goes through here: IR dumps (PYDISC_DUMP_DIR), the
dumps of clusters that failed to compile, the shape log (PYDISC_SHAPE_LOG).

- A folder pydisc writes into must belong to the user and be writable by nobody else (like the cache's,
  exec/disk_cache.py); it is created with mode 0700. A folder that fails the check is not written to.
- Failure dumps without PYDISC_DUMP_DIR go to `pydisc-<uid>` under the temp folder, checked the same
  way; if another user planted that name, to a fresh private folder (`tempfile.mkdtemp`) instead.
- Files are opened without following a symbolic link (O_NOFOLLOW) and created 0600. A name that exists
  is replaced only when it is a regular file of this user; anything else there (a link, another user's
  file) is left alone and the dump gets a name of its own.
"""
from __future__ import annotations

import os
import stat
import tempfile

from .config import CONFIG

__all__ = ["UnsafeFolderError", "check_private_folder", "dump_folder", "write_file", "append_line"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_failure_folder: str | None = None


class UnsafeFolderError(OSError):
    """A folder pydisc would write into belongs to someone else or others can write it."""


def check_private_folder(folder: str) -> str:
    """Create `folder` (0700) if needed; raise UnsafeFolderError unless it is a folder of this user that
    nobody else can write. Returns the folder."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError("%s is not a folder (a link or a file)" % folder)
    if hasattr(os, "getuid"):
        if st.st_uid != os.getuid():
            raise UnsafeFolderError("%s belongs to uid %d, not to you (uid %d)" % (folder, st.st_uid, os.getuid()))
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeFolderError("%s is writable by group or others (mode %o); `chmod 700 %s` if it is "
                                    "yours" % (folder, stat.S_IMODE(st.st_mode), folder))
    return folder


def dump_folder(failure: bool) -> str | None:
    """Where dumps go: PYDISC_DUMP_DIR; for a failure without it, a private folder under the temp folder.
    None when there is nowhere safe to write (warned by the caller)."""
    if CONFIG.dump_dir:
        return check_private_folder(CONFIG.dump_dir)
    if not failure:
        return None
    global _failure_folder
    if _failure_folder is None:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        try:
            _failure_folder = check_private_folder(os.path.join(tempfile.gettempdir(), "pydisc-%d" % uid))
        except OSError:     # planted by another user, or not creatable: a folder of our own instead
            _failure_folder = tempfile.mkdtemp(prefix="pydisc-failures-")
    return _failure_folder


def write_file(folder: str, name: str, text: str) -> str:
    """Write `text` to `folder/name`, or to `folder/name` with a number added when that name holds
    something that is not a regular file of this user. Returns the path written."""
    base, dot, suffix = name.partition(".")
    for attempt in range(100):
        candidate = name if attempt == 0 else "%s-%d%s%s" % (base, attempt, dot, suffix)
        path = os.path.join(folder, candidate)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except FileExistsError:
            if not _own_regular_file(path):
                continue
            try:
                os.unlink(path)     # an earlier dump of ours: replaced
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            except OSError:
                continue
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    raise FileExistsError("no free name for %s in %s" % (name, folder))


def append_line(path: str, line: str) -> None:
    """Append one line to `path` (created 0600), not through a symbolic link and only to a regular file
    of this user. One write per line in append mode: lines of several processes do not interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise UnsafeFolderError("%s is not a regular file of yours: not appended to" % path)
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _own_regular_file(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())
