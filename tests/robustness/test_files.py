"""What pydisc writes outside its cache (IR dumps, failure dumps, the shape log) goes into folders of the
user's own, without following a symbolic link planted at a file's name."""
from __future__ import annotations

import os

import pytest

import pydisc.diagnostics as diagnostics
from pydisc import files
from pydisc.driver import plan, shape_log
from pydisc.config import CONFIG


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees its own once-only warnings."""
    monkeypatch.setattr(diagnostics, "_WARNED", set())


def test_a_symbolic_link_at_a_dump_name_is_not_written_through(tmp_path, monkeypatch):
    folder = tmp_path / "dumps"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (folder / "step1_graph.txt").symlink_to(victim)
    monkeypatch.setattr(CONFIG, "dump_dir", str(folder))
    path = plan._dump("step1_graph.txt", "graph text")
    assert victim.read_text() == "keep me"
    assert path is not None and os.path.basename(path) != "step1_graph.txt"
    assert open(path).read() == "graph text" and oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_an_earlier_dump_of_ours_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(CONFIG, "dump_dir", str(tmp_path / "d"))
    first = plan._dump("a.txt", "one")
    assert plan._dump("a.txt", "two") == first and open(first).read() == "two"
    assert oct(os.stat(tmp_path / "d").st_mode & 0o777) == "0o700"


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_dump_folder_others_can_write_is_refused_with_a_warning(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    monkeypatch.setattr(CONFIG, "dump_dir", str(folder))
    with pytest.warns(Warning, match="writable by group or others"):
        assert plan._dump("x.txt", "text", failure=True) is None
    assert list(folder.iterdir()) == []


def test_failure_dumps_without_a_dump_dir_go_to_a_private_folder(monkeypatch):
    monkeypatch.setattr(CONFIG, "dump_dir", "")
    assert plan._dump("ok.txt", "text") is None              # nothing asked for, nothing written
    path = plan._dump("x.failed.txt", "text", failure=True)
    folder = os.path.dirname(path)
    assert open(path).read() == "text"
    assert os.stat(folder).st_uid == os.getuid() and os.stat(folder).st_mode & 0o077 == 0


def test_the_shape_log_is_not_appended_through_a_symbolic_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    log = tmp_path / "shapes.jsonl"
    log.symlink_to(victim)
    monkeypatch.setattr(CONFIG, "shape_log", str(log))
    import torch
    # texts no other test logs: a process appends each text once
    first, second = "module {} // %s 1" % tmp_path, "module {} // %s 2" % tmp_path
    with pytest.warns(Warning, match="shape log"):
        shape_log.record_cluster(first, torch.device("cpu"))
    assert victim.read_text() == "keep me\n"
    monkeypatch.setattr(CONFIG, "shape_log", str(tmp_path / "real.jsonl"))
    shape_log.record_cluster(second, torch.device("cpu"))
    assert [e["mlir"] for e in shape_log.read_log(str(tmp_path / "real.jsonl"))] == [second]
    assert files.check_private_folder(str(tmp_path)) == str(tmp_path)
