"""The on-disk compile cache: shared by processes, safe under concurrent writers, self-checking, bounded,
refusing unsafe folders. Every test uses its own folder under tmp_path, never the user's cache."""
from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import threading

import pytest
import torch

from pydisc.config import CONFIG
from pydisc.exec import CacheDirError, DiskCache, clear_cache, compile_module
from pydisc.exec import disk_cache as disk_cache_module
from pydisc.exec.compiler import forget_module, text_hash
from pydisc.exec.disk_cache import (
    ENTRY_SUFFIX, _unpack, cache_command, cache_key, configured_disk_cache, resolve_cache_dir,
)
from pydisc.exec.target import CPU_TARGET, CUDA_TARGET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ADD = """func.func @main(%a: tensor<4xf32>, %b: tensor<4xf32>, %o: tensor<4xf32> {{iree.abi.output = 0 : index}}) -> tensor<4xf32> {{
  %r = stablehlo.add %a, %b : tensor<4xf32>
  return %r : tensor<4xf32>
}}
// {tag}
"""

# Compiles ADD in a fresh process, checks the result and prints pydisc.metrics() as JSON.
CHILD = """
import json, sys, torch, pydisc
from pydisc.exec import compile_module
module = compile_module(sys.argv[1], "cpu")
out = torch.empty(4)
module.run([torch.ones(4), torch.full((4,), 2.0)], [out])
assert out.tolist() == [3.0] * 4, out
print(json.dumps(pydisc.metrics()))
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    """A fresh cache folder for this test (for this process and the subprocesses it starts)."""
    directory = str(tmp_path / "cache")
    monkeypatch.setattr(CONFIG, "cache_dir", directory)
    monkeypatch.setenv("PYDISC_CACHE_DIR", directory)
    clear_cache()  # the in-memory cache would answer before the disk is asked
    yield directory
    clear_cache()


def entry_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(ENTRY_SUFFIX))


def run_add(text: str) -> list[float]:
    out = torch.empty(4)
    compile_module(text, "cpu").run([torch.ones(4), torch.full((4,), 2.0)], [out])
    return out.tolist()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_second_process_loads_what_the_first_compiled(cache_dir):
    text = ADD.format(tag="two processes")
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD, text], env=child_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert (first["compiles"], first["disk_cache_hits"]) == (1, 0)
    assert second["compiles"] == 0 and second["cache_hits"] >= 1 and second["disk_cache_hits"] == 1
    assert len(entry_files(cache_dir)) == 1


def test_disk_hit_in_process(cache_dir, metrics):
    text = ADD.format(tag="in process")
    assert run_add(text) == [3.0] * 4
    clear_cache()
    assert run_add(text) == [3.0] * 4
    assert (metrics.compiles, metrics.cache_hits, metrics.disk_cache_hits) == (1, 1, 1)
    run_add(text)  # now from memory: a hit, not a disk hit
    assert (metrics.compiles, metrics.cache_hits, metrics.disk_cache_hits) == (1, 2, 1)


def test_new_folder_is_private(tmp_path, monkeypatch, metrics):
    directory = tmp_path / "a" / "b" / "pydisc"
    monkeypatch.setattr(CONFIG, "cache_dir", str(directory))
    clear_cache()
    run_add(ADD.format(tag="private folder"))
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    (entry,) = entry_files(str(directory))
    assert stat.S_IMODE(os.stat(entry).st_mode) == 0o600
    clear_cache()


def _write_many(directory: str, worker: int, rounds: int) -> None:
    cache = DiskCache(directory, max_bytes=1 << 40)
    shared = "a" * 64
    for i in range(rounds):
        cache.put(shared, bytes([worker]) * (200_000 + worker))  # one key, different bytes per writer
        cache.put(f"{worker:02x}{i:062x}", bytes([i % 256]) * 50_000)  # keys of their own
        got = cache.get(shared)
        assert got is not None and len(set(got)) == 1 and len(got) == 200_000 + got[0]  # whole, never mixed


@pytest.mark.skipif(sys.platform == "win32", reason="uses fork")
def test_concurrent_writers_leave_only_valid_entries(tmp_path):
    directory = str(tmp_path / "cache")
    workers, rounds = 6, 15
    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=_write_many, args=(directory, w, rounds)) for w in range(workers)]
    threads = [threading.Thread(target=_write_many, args=(directory, workers + w, rounds)) for w in range(3)]
    for p in processes:
        p.start()
    for t in threads:
        t.start()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    for t in threads:
        t.join(timeout=120)
    names = os.listdir(directory)
    assert not [n for n in names if not n.endswith(ENTRY_SUFFIX)]  # no temp files left behind
    assert len(names) == 1 + (workers + 3) * rounds
    for path in entry_files(directory):
        with open(path, "rb") as f:
            assert not isinstance(_unpack(f.read()), str), path
    last = DiskCache(directory, max_bytes=1 << 40).get("a" * 64)
    assert last is not None and len(last) == 200_000 + last[0]


def _flip_payload_byte(blob: bytes) -> bytes:
    i = len(blob) // 2
    return blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1:]


DAMAGES = {
    "flipped byte": _flip_payload_byte,
    "truncated": lambda blob: blob[: len(blob) - 100],
    "header only": lambda blob: blob[:30],
    "empty": lambda blob: b"",
    "not an entry": lambda blob: b"\x7fELF" + blob[4:],
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_entry_is_detected_and_removed(tmp_path, damage):
    cache = DiskCache(str(tmp_path / "cache"), max_bytes=1 << 30)
    key = "d" * 64
    cache.put(key, os.urandom(5000))
    with open(cache.path(key), "rb") as f:
        good = f.read()
    with open(cache.path(key), "wb") as f:
        f.write(DAMAGES[damage](good))
    assert cache.get(key) is None  # never returned
    assert not os.path.exists(cache.path(key))  # and removed


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_entry_is_recompiled(cache_dir, metrics, damage):
    text = ADD.format(tag="damaged " + damage)
    run_add(text)
    (path,) = entry_files(cache_dir)
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(DAMAGES[damage](good))
    clear_cache()
    assert run_add(text) == [3.0] * 4
    assert (metrics.compiles, metrics.disk_cache_hits) == (2, 0)
    with open(path, "rb") as f:
        assert not isinstance(_unpack(f.read()), str)  # rewritten whole


def test_intact_entry_that_does_not_load_is_replaced(cache_dir, metrics):
    text = ADD.format(tag="unloadable")
    key = cache_key(text_hash(text), CPU_TARGET)
    configured_disk_cache().put(key, b"not a vmfb")  # a valid entry (hash matches) whose bytes IREE rejects
    assert run_add(text) == [3.0] * 4
    assert (metrics.compiles, metrics.disk_cache_hits) == (1, 0)
    assert configured_disk_cache().get(key) != b"not a vmfb"


SUB = ADD.replace("stablehlo.add", "stablehlo.subtract")


def test_entry_filed_under_another_key_is_discarded(cache_dir, metrics):
    """A valid entry copied over another's (same signature, other op) is never run: each entry carries
    the key it was made for."""
    add, sub = ADD.format(tag="moved"), SUB.format(tag="moved")
    assert run_add(add) == [3.0] * 4
    assert run_add(sub) == [-1.0] * 4
    cache = configured_disk_cache()
    add_key, sub_key = (cache_key(text_hash(t), CPU_TARGET) for t in (add, sub))
    with open(cache.path(add_key), "rb") as f:
        moved = f.read()
    with open(cache.path(sub_key), "wb") as f:
        f.write(moved)                              # add's entry, filed under sub's key
    clear_cache()
    with pytest.warns(disk_cache_module.CacheWarning, match="another key"):
        assert run_add(sub) == [-1.0] * 4           # compiled again, not add's code
    assert (metrics.compiles, metrics.disk_cache_hits) == (3, 0)
    assert metrics.disk_cache_discarded == {"filed under another key than the one it was made for": 1}
    assert run_add(add) == [3.0] * 4 and metrics.disk_cache_hits == 1   # its own entry still loads


def test_entry_of_another_toolchain_or_format_is_discarded(cache_dir, metrics, monkeypatch):
    text = ADD.format(tag="toolchain")
    cache = configured_disk_cache()
    key = cache_key(text_hash(text), CPU_TARGET)
    run_add(text)
    with open(cache.path(key), "rb") as f:
        good = f.read()
    with monkeypatch.context() as m:                # an entry made by an older IREE, filed under today's key
        m.setattr(disk_cache_module, "_toolchain", lambda: ("iree-compiler 2.0", "pydisc 0.0.1"))
        cache.put(key, _unpack(good).payload)
    assert cache.get(key) is None and not os.path.exists(cache.path(key))
    with open(cache.path(key), "wb") as f:          # the first entry format (before keys were kept)
        f.write(b"PYDISC\x00\x01" + bytes(40) + good)
    assert cache.get(key) is None and not os.path.exists(cache.path(key))
    assert dict(metrics.disk_cache_discarded) == {
        "made by another toolchain (iree-compiler 2.0, pydisc 0.0.1)": 1, "an entry of an older pydisc's format": 1}
    clear_cache()
    assert run_add(text) == [3.0] * 4 and metrics.compiles == 2


def test_module_that_fails_to_run_is_forgotten_on_disk(cache_dir, metrics):
    text = ADD.format(tag="fails to run")
    module = compile_module(text, "cpu")
    (path,) = entry_files(cache_dir)
    forget_module(module)                           # what a compiled cluster does when its run raises
    assert entry_files(cache_dir) == []
    assert compile_module(text, "cpu") is not module and metrics.compiles == 2
    assert len(entry_files(cache_dir)) == 1


def test_cli_info_on_a_file_is_an_error(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cache"
    path.write_text("a file, not a folder")
    monkeypatch.setattr(CONFIG, "cache_dir", str(path))
    for command in ("info", "clear"):
        assert cache_command([command]) == 1
        assert "not a folder" in capsys.readouterr().out
    assert path.read_text() == "a file, not a folder"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_folder_writable_by_others_is_refused(cache_dir, metrics, mode):
    os.makedirs(cache_dir)
    os.chmod(cache_dir, mode)
    with pytest.raises(CacheDirError) as info:
        compile_module(ADD.format(tag="refused"), "cpu")
    message = str(info.value)
    assert "writable by group or others" in message.splitlines()[0]
    assert f"chmod 700 {cache_dir}" in message and "PYDISC_CACHE_DIR" in message
    assert metrics.compiles == 0  # refused before anything is compiled or loaded
    os.chmod(cache_dir, 0o700)
    assert run_add(ADD.format(tag="refused")) == [3.0] * 4


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners")
def test_folder_of_another_user_is_refused(cache_dir, monkeypatch):
    os.makedirs(cache_dir, mode=0o700)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(CacheDirError, match=r"owned by uid .*chmod 700"):
        compile_module(ADD.format(tag="other owner"), "cpu")


def test_eviction_keeps_folder_under_limit(tmp_path):
    directory = str(tmp_path / "cache")
    cache = DiskCache(directory, max_bytes=1 << 40)
    keys = [f"{i:064x}" for i in range(8)]
    for i, key in enumerate(keys):
        cache.put(key, bytes([i]) * 10_000)
        os.utime(cache.path(key), (1_000_000 + i, 1_000_000 + i))  # oldest first
    assert cache.get(keys[0]) is not None  # a hit makes the oldest the most recently used
    entry_size = os.path.getsize(cache.path(keys[1]))

    cache.max_bytes = 4 * entry_size
    cache.put("f" * 64, b"\xff" * 10_000)
    remaining = {os.path.basename(p)[: -len(ENTRY_SUFFIX)] for p in entry_files(directory)}
    assert remaining == {keys[0], keys[6], keys[7], "f" * 64}
    assert cache.info().total_bytes <= cache.max_bytes

    cache.max_bytes = 0
    cache.evict()
    assert entry_files(directory) == []


def test_limit_from_config(cache_dir, monkeypatch):
    monkeypatch.setattr(CONFIG, "cache_max_mb", 0.5)
    assert configured_disk_cache().max_bytes == 512 * 1024


def test_off_disables(tmp_path, monkeypatch, metrics):
    monkeypatch.setattr(CONFIG, "cache_dir", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    clear_cache()
    assert configured_disk_cache() is None
    text = ADD.format(tag="off")
    run_add(text)
    clear_cache()
    run_add(text)
    assert (metrics.compiles, metrics.disk_cache_hits) == (2, 0)
    assert not os.listdir(tmp_path)
    clear_cache()


def test_cache_dir_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir("") == str(tmp_path / "xdg" / "pydisc")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir("") == str(tmp_path / "home" / ".cache" / "pydisc")
    assert resolve_cache_dir("~/elsewhere") == str(tmp_path / "home" / "elsewhere")
    assert resolve_cache_dir("OFF") is None and resolve_cache_dir("off") is None


def test_key_covers_target_and_versions(monkeypatch):
    digest = text_hash(ADD.format(tag="key"))
    assert cache_key(digest, CPU_TARGET) == cache_key(digest, CPU_TARGET)
    assert cache_key(digest, CPU_TARGET) != cache_key(digest, CUDA_TARGET)
    assert cache_key(digest, CPU_TARGET) != cache_key(text_hash("other"), CPU_TARGET)
    before = cache_key(digest, CPU_TARGET)
    monkeypatch.setattr(disk_cache_module, "_toolchain", lambda: ("iree-compiler 99", "pydisc 9.9"))
    assert cache_key(digest, CPU_TARGET) != before


def test_cli_info_and_clear(tmp_path, monkeypatch, capsys):
    directory = str(tmp_path / "cache")
    monkeypatch.setattr(CONFIG, "cache_dir", directory)
    monkeypatch.setattr(CONFIG, "cache_max_mb", 64)
    cache = DiskCache(directory, max_bytes=1 << 30)
    cache.put("1" * 64, b"x" * 1000)
    cache.put("2" * 64, b"y" * 1000)
    with open(os.path.join(directory, "speed_choices.json"), "w") as f:   # measured choices (exec/choices.py)
        f.write("{}")

    assert cache_command(["info"]) == 0
    out = capsys.readouterr().out
    assert f"folder   {directory}" in out and "entries  2" in out
    assert "limit    64 MB" in out and "bytes)" in out

    assert cache_command(["clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert entry_files(directory) == [] and os.listdir(directory) == []

    os.chmod(directory, 0o777)
    assert cache_command(["info"]) == 1
    assert "chmod 700" in capsys.readouterr().out
    os.chmod(directory, 0o700)

    monkeypatch.setattr(CONFIG, "cache_dir", "off")
    assert cache_command(["info"]) == 0
    assert "disabled" in capsys.readouterr().out


def test_cli_entry_point(tmp_path):
    directory = str(tmp_path / "cache")
    DiskCache(directory, max_bytes=1 << 30).put("3" * 64, b"z" * 1000)
    env = child_env(PYDISC_CACHE_DIR=directory, PYDISC_CACHE_MAX_MB="64")
    done = subprocess.run([sys.executable, "-m", "pydisc.cache", "info"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"folder   {directory}" in done.stdout and "entries  1" in done.stdout and "64 MB" in done.stdout
