"""A shape log written by one run lets `python -m pydisc.precompile` warm an empty cache for the next."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP = """
import json, torch, pydisc
x = pydisc.to_lazy(torch.arange(12.0).reshape(3, 4))
y = (x.sin() * 3 + x.t().sum()).relu()
pydisc.mark_step()
assert torch.allclose(y.cpu(), (torch.arange(12.0).reshape(3, 4).sin() * 3 + 66.0).relu())
print(json.dumps(pydisc.metrics()))
"""


def _run(args, env):
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_precompile_warms_an_empty_cache(tmp_path):
    log = tmp_path / "shapes.jsonl"
    first_cache, second_cache = tmp_path / "c1", tmp_path / "c2"
    env = dict(os.environ, PYTHONPATH=ROOT, PYDISC_SHAPE_LOG=str(log), PYDISC_CACHE_DIR=str(first_cache))
    first = json.loads(_run([sys.executable, "-c", STEP], env).splitlines()[-1])
    assert first["compiles"] >= 1
    assert len(log.read_text().splitlines()) == first["compiles"]

    env = dict(os.environ, PYTHONPATH=ROOT, PYDISC_CACHE_DIR=str(second_cache))
    report = _run([sys.executable, "-m", "pydisc.precompile", str(log)], env)
    assert "compiled" in report and "0 failed" in report
    second = json.loads(_run([sys.executable, "-c", STEP], env).splitlines()[-1])
    assert second["compiles"] == 0 and second["cache_hits"] >= 1


def test_corrupted_log_line_is_refused(tmp_path):
    from pydisc.driver.shape_log import read_log
    log = tmp_path / "shapes.jsonl"
    log.write_text(json.dumps({"device": "cpu", "sha256": "0" * 64, "mlir": "module {}"}) + "\n")
    import pytest
    with pytest.raises(ValueError, match="corrupted"):
        read_log(str(log))
