"""Measured speed choices (`clusters.CompiledCluster.measure`), kept next to the compiled executables in
the disk cache (`speed_choices.json`): a later process running the same cluster text at the same sizes,
on the same kind of device with the same toolchain, takes the choice without timing it again.

A choice is keyed by the executable's disk-cache key (text, target, flags, IREE and pydisc versions),
the device's name, torch's version and the input sizes and dtypes of the measured call. The file is
small (a line of JSON per measured cluster); it is read once per process and rewritten, merged with
what other processes wrote meanwhile, after each new measurement.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import threading

import torch

from .disk_cache import CHOICES_FILE, DiskCache, cache_key, configured_disk_cache
from .errors import CacheDirError
from .target import target_for

__all__ = ["choice_key", "lookup", "store", "FILE_NAME"]

FILE_NAME = CHOICES_FILE
_LOCK = threading.Lock()
_KNOWN: dict[str, dict] = {}
_LOADED_FROM: set[str] = set()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu %s %d" % (platform.processor() or platform.machine(), os.cpu_count() or 1)


def choice_key(text_digest: str, device: torch.device, inputs) -> tuple[str, str] | None:
    """(cache folder, key) for a cluster measured with `inputs`; None without a disk cache."""
    cache = configured_disk_cache()
    if cache is None:
        return None
    sizes = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs]
    parts = [cache_key(text_digest, target_for(device)), _device_name(device), torch.__version__, repr(sizes)]
    return cache.directory, hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _checked(directory: str) -> None:
    """The cache folder's own check (mode 0700, this user's): the choices file is read and written only
    there. Raises CacheDirError or OSError."""
    DiskCache(directory, 0).check_folder()


def _read(directory: str) -> dict:
    try:
        _checked(directory)
        with open(os.path.join(directory, FILE_NAME)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, CacheDirError):
        return {}            # none yet, unreadable or in a folder others can write: measure again


def lookup(key: tuple[str, str] | None) -> dict | None:
    """The stored choice ({"choice": "eager" or "IREE", "iree_us", "eager_us"}), or None."""
    if key is None:
        return None
    directory, digest = key
    with _LOCK:
        if directory not in _LOADED_FROM:
            _KNOWN.update(_read(directory))
            _LOADED_FROM.add(directory)
        return _KNOWN.get(digest)


def store(key: tuple[str, str] | None, choice: dict) -> None:
    """Keep `choice` under `key`, in memory and in the cache folder (merged with the file's entries,
    written atomically); a folder that cannot be written keeps it in memory only."""
    if key is None:
        return
    directory, digest = key
    with _LOCK:
        _KNOWN[digest] = choice
        merged = _read(directory)
        merged[digest] = choice
        temp = None
        try:
            _checked(directory)
            fd, temp = tempfile.mkstemp(prefix=".tmp-choices-", dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=0, sort_keys=True)
            os.replace(temp, os.path.join(directory, FILE_NAME))
            temp = None
        except (OSError, CacheDirError):
            pass
        finally:
            if temp is not None:
                try:
                    os.unlink(temp)
                except OSError:
                    pass


def forget() -> None:
    """Drop what this process read (tests; `python -m pydisc.cache clear` removes the file)."""
    with _LOCK:
        _KNOWN.clear()
        _LOADED_FROM.clear()
