"""The shape log: every cluster a run compiled, so another process can compile them ahead of time.

`PYDISC_SHAPE_LOG=path` appends one JSON line per newly compiled cluster (its device kind, MLIR text
and, for a region of the torch-mlir route, `"input_type": "torch"`); `python -m pydisc.precompile path`
compiles them all into the persistent cache (docs/cache.md), so a job restarted on a fresh machine or with
an empty cache starts hot.
"""
from __future__ import annotations

import hashlib
import json

import torch

from .. import files
from ..config import CONFIG
from ..diagnostics import warn_once

__all__ = ["record_cluster", "read_log"]

_LOGGED: set[str] = set()


def record_cluster(text: str, device: torch.device, input_type: str = "stablehlo") -> None:
    if not CONFIG.shape_log:
        return
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest in _LOGGED:
        return
    _LOGGED.add(digest)
    entry = {"device": device.type, "sha256": digest, "mlir": text}
    if input_type != "stablehlo":
        entry["input_type"] = input_type
    line = json.dumps(entry)
    # one write per line in append mode (lines from several processes do not interleave), never through
    # a symbolic link nor into another user's file
    try:
        files.append_line(CONFIG.shape_log, line)
    except OSError as exc:
        warn_once("shape-log", "pydisc: the shape log %s is not written (%s)" % (CONFIG.shape_log, exc))


def read_log(path: str) -> list[dict]:
    entries, seen = [], set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError("%s:%d is not a pydisc shape log line (a truncated write?); remove it "
                                 "and run again" % (path, number)) from None
            if hashlib.sha256(entry["mlir"].encode()).hexdigest() != entry["sha256"]:
                raise ValueError("%s:%d: the MLIR text does not match its hash; the log is corrupted"
                                 % (path, number))
            if entry["sha256"] not in seen:
                seen.add(entry["sha256"])
                entries.append(entry)
    return entries
