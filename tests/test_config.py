"""Settings: a value pydisc does not know is an error that names the setting and what it takes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pydisc.config import applies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,value,hint", [("PYDISC_MEASURE", "gpu", "the GPU is `cuda`"),
                                             ("PYDISC_STEP_CHOICE", "yes", "all, cuda, cpu, off"),
                                             ("PYDISC_GPU_MATMUL", "cublas", "torch, iree")])
def test_unknown_setting_is_refused_at_import(name, value, hint):
    """`PYDISC_MEASURE=gpu` silently meant off: no device is called gpu."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **{name: value})
    done = subprocess.run([sys.executable, "-c", "import pydisc"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    assert "ValueError: %s=%s is not a setting pydisc knows" % (name, value) in done.stderr
    assert hint in done.stderr


def test_settings_are_read_case_insensitively():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYDISC_MEASURE=" CPU ", PYDISC_VALUE_CHECKS="All")
    done = subprocess.run([sys.executable, "-c", "from pydisc.config import CONFIG; print(CONFIG.measure, "
                           "CONFIG.value_checks)"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["cpu", "all"], done.stderr


def test_scopes_cover_their_devices():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [applies(s, cpu) for s in ("all", "cuda", "cpu", "off")] == [True, False, True, False]
    assert [applies(s, cuda) for s in ("all", "cuda", "cpu", "off")] == [True, True, False, False]


@pytest.mark.parametrize("value,scope", [("", "all"), ("0", "off"), ("1", "all"), (" Cuda", "cuda"), ("cpu", "cpu"),
                                         ("off", "off")])
def test_fast_record_takes_a_scope_and_the_old_switch(value, scope):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYDISC_FAST_RECORD=value)
    done = subprocess.run([sys.executable, "-c", "import pydisc; from pydisc.frontend import fast; "
                           "print(pydisc.config.CONFIG.fast_record, fast.FAST.default)"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == [scope, scope], done.stderr
