"""MLIR text -> IREE `.vmfb` -> CompiledModule, cached in memory and on disk.

The text is StableHLO (the clusters) or torch-mlir's `torch` dialect (the regions of the torch-mlir
route, `input_type="torch"`); the input type is part of every cache key.
Lookup order: loaded modules keyed by (sha256 of the text, input type, target flags, device), so a
repeated call returns the very same CompiledModule; compiled bytes keyed by (text hash, input type,
flags), so a second device of
the same kind (cuda:1 after cuda:0) compiles nothing; the on-disk cache (disk_cache.py), shared by
processes; and only then the compiler, whose result is written to disk once it has loaded.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import iree.compiler as ireec
import torch

from .. import files
from ..config import CONFIG
from ..metrics import METRICS, METRICS_LOCK
from .disk_cache import DiskCache, cache_key, configured_disk_cache
from .errors import CompileError
from .compiled import CompiledModule
from .session import DeviceSession, session_for
from .direct.launcher import compile_bundle, load_bundle
from .target import CUDA_DIRECT_TARGET, Target, target_for

__all__ = ["compile_module", "precompile", "clear_cache", "forget_module", "text_hash"]

_MAX_DIAGNOSTIC_LINES = 40
_MAX_DIAGNOSTIC_CHARS = 4000

_LOCK = threading.RLock()   # held across a compile; `_compiled` takes it again inside
_VMFB_CACHE: dict[tuple[str, str, tuple[str, ...]], bytes] = {}
_MODULE_CACHE: dict[tuple[str, str, tuple[str, ...], torch.device], CompiledModule] = {}
INPUT_TYPES = ("stablehlo", "torch")
# torch-mlir texts IREE rejected: each region of that route is tried once per process, not at every plan
_FAILED: dict[tuple[str, str, tuple[str, ...]], CompileError] = {}
# results of `precompile` not yet taken by `compile_module`: the .vmfb bytes, or the CompileError
_PREFETCHED: dict[tuple, bytes | CompileError] = {}
# the on-disk key of each compiled text (`forget_module` removes the entry of a module that failed)
_DISK_KEYS: dict[tuple[str, str, str, tuple[str, ...]], str] = {}


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def clear_cache() -> None:
    """Forget every compiled module held in memory (tests; or to free memory held by loaded modules).
    The on-disk cache is left alone: `python -m pydisc.cache clear` empties it."""
    with _LOCK:
        _VMFB_CACHE.clear()
        _MODULE_CACHE.clear()
        _FAILED.clear()
        _PREFETCHED.clear()
        _DISK_KEYS.clear()


def forget_module(module) -> None:
    """Forget a module that failed to run: in memory and on disk, so that neither this process nor the
    next loads the same bytes again (a later `compile_module` of its text compiles it afresh)."""
    cache = configured_disk_cache()
    with _LOCK:
        keys = [k for k, m in _MODULE_CACHE.items() if m is module]
        for k in keys:
            del _MODULE_CACHE[k]
            text_key = k[:-1]
            _VMFB_CACHE.pop(text_key, None)
            disk_key = _DISK_KEYS.pop(text_key, None)
            if cache is not None and disk_key is not None:
                cache.discard(disk_key)


def precompile(texts: list[str], device: torch.device | str, jobs: int | None = None,
               announce=None) -> int:
    """Compile the StableHLO `texts` that no cache holds yet, `jobs` iree-compile processes at a time
    (CONFIG.compile_jobs), ahead of the `compile_module` calls that will ask for them: a new step graph
    of a 12-layer model has tens of distinct clusters, each a second or more to compile. Nothing is
    loaded or counted as a hit here; errors are kept and raised by `compile_module`. Returns the number
    of texts compiled. `announce(n, jobs)` is called before a parallel compile of n texts starts."""
    jobs = CONFIG.compile_jobs if jobs is None else jobs
    target = target_for(device)
    cache = configured_disk_cache()
    todo: dict[tuple, tuple[str, str]] = {}
    for text in texts:
        digest = text_hash(text)
        key = (digest, "stablehlo", target.name, target.flags)
        with _LOCK:
            known = key in todo or key in _VMFB_CACHE or key in _PREFETCHED or key in _FAILED
        if known or (cache is not None and cache.contains(cache_key(digest, target, "stablehlo"))):
            continue
        todo[key] = (text, digest)
    if jobs <= 1 or len(todo) < 2:
        return 0   # one text: compile_module compiles it as it always does
    jobs = min(jobs, len(todo))
    if announce is not None:
        announce(len(todo), jobs)

    def one(item: tuple[str, str]) -> bytes | CompileError:
        try:
            return _compile(item[0], item[1], "stablehlo", target)
        except CompileError as error:
            return error

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="pydisc-compile") as pool:
        results = list(pool.map(one, todo.values()))
    with _LOCK:
        _PREFETCHED.update(zip(todo, results))
    return len(todo)


def _compiled(text: str, digest: str, input_type: str, target: Target) -> bytes:
    """The .vmfb of `text`: compiled ahead by `precompile`, or now."""
    with _LOCK:
        done = _PREFETCHED.pop((digest, input_type, target.name, target.flags), None)
    if isinstance(done, CompileError):
        raise done
    return done if done is not None else _compile(text, digest, input_type, target)


def compile_module(text: str, device: torch.device | str, input_type: str = "stablehlo") -> CompiledModule:
    """Compile MLIR text of `input_type` (StableHLO, or torch-mlir's `torch` dialect) for `device`, or
    reuse the cached result, and load it there."""
    if input_type not in INPUT_TYPES:
        raise ValueError(f"input_type must be one of {INPUT_TYPES}, not {input_type!r}")
    target = target_for(device)
    session = session_for(device)
    digest = text_hash(text)
    key = (digest, input_type, target.name, target.flags)
    with _LOCK:
        module = _MODULE_CACHE.get((*key, session.device))
        if module is not None:
            _count_hit()
            return module
        name = f"module_{digest[:16]}"
        vmfb = _VMFB_CACHE.get(key)
        if key in _FAILED:
            raise _FAILED[key]
        if vmfb is None:
            try:
                module = _load_from_disk_or_compile(text, digest, input_type, target, session, name)
            except CompileError as error:
                if input_type == "torch":
                    _FAILED[key] = error
                raise
            _VMFB_CACHE[key] = module.vmfb
        else:
            _count_hit()
            module = _module(vmfb, target, session, name)
        _MODULE_CACHE[(*key, session.device)] = module
        return module


def _load_from_disk_or_compile(
    text: str, digest: str, input_type: str, target: Target, session: DeviceSession, name: str
) -> CompiledModule:
    cache: DiskCache | None = configured_disk_cache()
    if cache is None:
        return _module(_compiled(text, digest, input_type, target), target, session, name)
    disk_key = cache_key(digest, target, input_type)
    _DISK_KEYS[(digest, input_type, target.name, target.flags)] = disk_key
    module = _load_from_disk(cache, disk_key, target, session, name)
    if module is not None:
        return module
    with cache.compiling(disk_key):
        # another process (a rank of the same job) may have compiled it while this one waited
        module = _load_from_disk(cache, disk_key, target, session, name)
        if module is not None:
            return module
        vmfb = _compiled(text, digest, input_type, target)
        module = _module(vmfb, target, session, name)
        cache.put(disk_key, vmfb)  # only modules that load are worth keeping
    return module


def _module(vmfb: bytes, target: Target, session: DeviceSession, name: str):
    """The loaded module: `CompiledModule` (IREE's runtime) or, for CUDA_DIRECT_TARGET, a `DirectModule`
    launching the kernels itself (IREE's runtime when the launcher cannot read this module)."""
    if target is CUDA_DIRECT_TARGET:
        return load_bundle(vmfb, session, name, CompiledModule)
    return CompiledModule(vmfb, session, name=name)


def _load_from_disk(
    cache: DiskCache, disk_key: str, target: Target, session: DeviceSession, name: str
) -> CompiledModule | None:
    vmfb = cache.get(disk_key)  # CacheDirError for an unsafe folder: the user must fix it
    if vmfb is None:
        return None
    try:
        module = _module(vmfb, target, session, name)
    except Exception:  # noqa: BLE001 - an intact entry this runtime cannot load: compile afresh
        cache.discard(disk_key)
        return None
    _count_hit(disk=True)
    return module


def _count_hit(disk: bool = False) -> None:
    with METRICS_LOCK:
        METRICS.cache_hits += 1
        if disk:
            METRICS.disk_cache_hits += 1


def _compile(text: str, digest: str, input_type: str, target: Target) -> bytes:
    dump_path = _dump(text, digest)
    start = time.perf_counter()
    try:
        if target is CUDA_DIRECT_TARGET:  # the same .vmfb, plus the launch schedule read from its host code
            vmfb = compile_bundle(ireec.compile_str, text, input_type, target.flags)
        else:
            vmfb = ireec.compile_str(text, input_type=input_type, extra_args=list(target.flags))
    except Exception as e:  # CompilerToolError; anything else from the compiler is handled the same
        if input_type == "stablehlo":
            # A torch-mlir region that IREE rejects is an expected outcome of that route, counted by
            # the planner (`torch_mlir_failures`), not a failure of a cluster pydisc emitted.
            with METRICS_LOCK:
                METRICS.compile_failures[f"iree-compile ({target.name})"] += 1
        raise _compile_error(e, digest, target, dump_path, input_type) from e
    finally:
        with METRICS_LOCK:
            METRICS.compile_seconds += time.perf_counter() - start
    with METRICS_LOCK:
        METRICS.compiles += 1
    return vmfb


def _dump(text: str, digest: str) -> str | None:
    if not CONFIG.dump_dir:
        return None
    try:
        return files.write_file(files.check_private_folder(CONFIG.dump_dir), f"{digest[:16]}.mlir", text)
    except OSError:
        return None     # (plan.py warns of a dump folder it cannot write into)


def _diagnostics(error: Exception) -> str:
    """The compiler's own diagnostics, without the tool's invocation boilerplate, trimmed."""
    message = str(error)
    if "Diagnostics:" in message:
        message = message.split("Diagnostics:", 1)[1]
        message = message.split("\nInvoked with:", 1)[0]
    lines = message.strip().splitlines()
    if len(lines) > _MAX_DIAGNOSTIC_LINES:
        lines = lines[:_MAX_DIAGNOSTIC_LINES] + [f"... ({len(lines) - _MAX_DIAGNOSTIC_LINES} more lines)"]
    text = "\n".join(lines)
    if len(text) > _MAX_DIAGNOSTIC_CHARS:
        text = text[:_MAX_DIAGNOSTIC_CHARS] + " ..."
    return text


def _compile_error(error: Exception, digest: str, target: Target, dump_path: str | None,
                   input_type: str = "stablehlo") -> CompileError:
    diagnostics = _diagnostics(error)
    if dump_path is not None:
        files.write_file(os.path.dirname(dump_path), os.path.basename(dump_path)[: -len(".mlir")] + ".error.txt",
                         str(error))
        where = f"The MLIR is in {dump_path}, the full compiler output next to it (.error.txt)."
    else:
        where = "Set PYDISC_DUMP_DIR=/some/dir to keep the MLIR and the full compiler output."
    return CompileError(
        f"IREE could not compile module_{digest[:16]} for {target.name} "
        f"(flags: {' '.join(target.flags)}):\n{diagnostics}\n"
        f"{where} The cluster can run eagerly instead; " + (
            "if the MLIR is valid StableHLO, the op that fails is a lowering IREE does not support and "
            "belongs on the partitioner's unsupported list." if input_type == "stablehlo" else
            "IREE's torch input conversion has no lowering for an op of this torch-mlir region."),
        diagnostics=diagnostics,
        dump_path=dump_path,
    )
