import pytest
import torch

from pydisc.config import CONFIG
from pydisc.exec import target_for
from pydisc.exec.target import CPU_DRIVER


def test_cpu_target():
    t = target_for(torch.device("cpu"))
    assert t.name == "llvm-cpu"
    assert t.driver == CPU_DRIVER == "local-sync"
    assert "--iree-hal-local-target-device-backends=llvm-cpu" in t.flags
    assert "--iree-llvmcpu-target-cpu=host" in t.flags


def test_cuda_target_needs_no_gpu(monkeypatch):
    t = target_for(torch.device("cuda", 1))
    assert t.name == "cuda-direct" and t.driver == "cuda"   # kernels launched by pydisc (the default)
    assert "--iree-cuda-target=sm_80" in t.flags
    assert t == target_for("cuda:0")  # one target for every GPU ordinal: the compiled bytes are shared
    monkeypatch.setattr(CONFIG, "gpu_executor", "iree")
    runtime = target_for("cuda:0")
    assert runtime.name == "cuda" and set(runtime.flags) < set(t.flags)
    monkeypatch.setattr(CONFIG, "gpu_executor", "cudnn")
    with pytest.raises(ValueError, match="PYDISC_GPU_EXECUTOR"):
        target_for("cuda:0")


def test_unsupported_device():
    with pytest.raises(ValueError, match="eager"):
        target_for(torch.device("meta"))
