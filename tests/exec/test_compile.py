import os

import pytest
import torch

from pydisc.config import CONFIG
from pydisc.exec import CompileError, compile_module
from pydisc.exec.compiler import text_hash

ADD = """func.func @main(%a: tensor<4xf32>, %b: tensor<4xf32>, %o: tensor<4xf32> {{iree.abi.output = 0 : index}}) -> tensor<4xf32> {{
  %r = stablehlo.{op} %a, %b : tensor<4xf32>
  return %r : tensor<4xf32>
}}"""

BAD = """func.func @main(%a: tensor<4xf32>, %o: tensor<4xf32> {iree.abi.output = 0 : index}) -> tensor<4xf32> {
  %r = stablehlo.add %a, %undefined : tensor<4xf32>
  return %r : tensor<4xf32>
}"""


def test_second_compile_hits_cache(metrics):
    text = ADD.format(op="subtract") + "\n// cache test\n"
    first = compile_module(text, torch.device("cpu"))
    assert (metrics.compiles, metrics.cache_hits) == (1, 0)
    assert metrics.compile_seconds > 0
    second = compile_module(text, "cpu")
    assert second is first
    assert (metrics.compiles, metrics.cache_hits) == (1, 1)


def test_different_text_compiles_again(metrics):
    compile_module(ADD.format(op="multiply"), "cpu")
    compile_module(ADD.format(op="maximum"), "cpu")
    assert metrics.compiles == 2


def test_compile_error_has_diagnostics(metrics, monkeypatch):
    monkeypatch.setattr(CONFIG, "dump_dir", "")
    with pytest.raises(CompileError) as info:
        compile_module(BAD, "cpu")
    message = str(info.value)
    assert "undeclared SSA value" in message
    assert "Invoked with" not in message  # tool boilerplate is trimmed
    assert "PYDISC_DUMP_DIR" in message and "eagerly" in message
    assert info.value.dump_path is None
    assert metrics.compiles == 0 and sum(metrics.compile_failures.values()) == 1


def test_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(CONFIG, "dump_dir", str(tmp_path))
    text = BAD + "\n// dump test\n"
    with pytest.raises(CompileError) as info:
        compile_module(text, "cpu")
    mlir = tmp_path / f"{text_hash(text)[:16]}.mlir"
    assert mlir.read_text() == text
    assert str(mlir) in str(info.value)
    assert "undeclared SSA value" in (tmp_path / f"{text_hash(text)[:16]}.error.txt").read_text()

    good = ADD.format(op="add") + "\n// dump test\n"
    compile_module(good, "cpu")
    assert os.path.exists(tmp_path / f"{text_hash(good)[:16]}.mlir")


def test_missing_main():
    text = ADD.format(op="add").replace("@main", "@other")
    with pytest.raises(CompileError, match="@main"):
        compile_module(text, "cpu")


def test_extra_iree_flags(metrics, monkeypatch):
    """PYDISC_IREE_FLAGS reach iree-compile and are part of the cache key: the same text compiles again,
    and runs to the same values."""
    from pydisc.exec import target_for
    text = ADD.format(op="add") + "\n// flags test\n"
    a, b = torch.arange(4.0), torch.full((4,), 2.5)
    out = torch.empty(4)
    compile_module(text, "cpu").run([a, b], [out])
    assert torch.equal(out, a + b)
    monkeypatch.setattr(CONFIG, "iree_flags", "--iree-opt-level=O1")
    assert target_for("cpu").flags[-1] == "--iree-opt-level=O1"
    out2 = torch.empty(4)
    compile_module(text, "cpu").run([a, b], [out2])
    assert metrics.compiles == 2
    assert torch.equal(out2, a + b)

    monkeypatch.setattr(CONFIG, "iree_flags", "--iree-no-such-flag=1")
    with pytest.raises(CompileError, match="no-such-flag"):
        compile_module(text, "cpu")
    monkeypatch.setattr(CONFIG, "iree_flags", "O3")
    with pytest.raises(ValueError, match="each starts with --"):
        target_for("cpu")
