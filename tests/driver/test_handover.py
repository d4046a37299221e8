"""On the CPU a step's new values of the parameters and optimizer state are written into memory the plan
keeps, which then becomes the parameters' memory in exchange for theirs (pydisc/driver/bind.py
`handovers`) instead of being copied: every tensor that views a parameter follows, and memory whose
address was handed out, or that the user passed in, is written in place as before."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc
from pydisc.config import CONFIG
from pydisc.driver import bind


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    eager = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    lazy = pydisc.lazy(copy.deepcopy(eager))
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    return eager, lazy, make(eager), make(lazy)


def _step(model, opt, x, y, lazy: bool) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if lazy:
        pydisc.mark_step()


def _address(p) -> int:
    """Where a lazy parameter's data is now, without handing its address out (`data_ptr` would)."""
    pydisc.synchronize()
    return p._storage.real.data_ptr()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def on_worker(request, monkeypatch):
    monkeypatch.setattr(CONFIG, "async_cpu", request.param)
    return request.param


def test_parameters_take_over_the_memory_their_new_values_were_written_into(on_worker):
    eager, lazy, eager_opt, lazy_opt = _pair()
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    weight = lazy[0].weight
    addresses = []
    for _ in range(6):
        _step(eager, eager_opt, x, y, False)
        _step(lazy, lazy_opt, x, y, True)
        addresses.append(_address(weight))
        for a, b in zip(eager.parameters(), lazy.parameters()):
            torch.testing.assert_close(b.cpu(), a)
    if bind._SWAP is not None:
        # from the plan's second run on, the weight's memory alternates between two blocks: no copy
        assert addresses[-1] == addresses[-3] != addresses[-2]
    else:   # (a torch without the exchange: copied into the same memory)
        assert len(set(addresses[1:])) == 1
    for a, b in zip(eager_opt.state.values(), lazy_opt.state.values()):
        torch.testing.assert_close(b["momentum_buffer"].cpu(), a["momentum_buffer"])


def test_views_and_plain_aliases_of_a_parameter_follow_its_memory(on_worker):
    """A lazy view made at an earlier step, and a plain alias of a parameter's data taken before
    `pydisc.lazy()` (`.data`: the same torch storage), see its new values after its memory moved, as
    eager's views of a parameter updated in place do."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = copy.deepcopy(eager)
    plain, eager_plain = model[0].bias.data, eager[0].bias.data
    lazy = pydisc.lazy(model)
    eager_opt, lazy_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, lazy))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    for _ in range(2):
        _step(eager, eager_opt, x, y, False)
        _step(lazy, lazy_opt, x, y, True)
    row, eager_row = lazy[2].weight[1], eager[2].weight[1]
    before = _address(lazy[2].weight)
    for _ in range(3):
        _step(eager, eager_opt, x, y, False)
        _step(lazy, lazy_opt, x, y, True)
    assert (_address(lazy[2].weight) != before) == (bind._SWAP is not None)     # (the memory moved)
    torch.testing.assert_close(row.cpu(), eager_row.detach())
    pydisc.synchronize()
    assert not pydisc.is_lazy(plain) and plain.data_ptr() == _address(lazy[0].bias)    # (it moved along)
    torch.testing.assert_close(plain, eager_plain)


@pytest.mark.parametrize("holder", ["numpy", "dlpack", "data_ptr"])
def test_memory_whose_address_was_handed_out_stays_the_parameters(on_worker, holder):
    """NumPy, DLPack and `data_ptr` hand out the address of a parameter's memory: eager's SGD writes that
    memory in place at every step, so the steps after write into it too."""
    eager, lazy, eager_opt, lazy_opt = _pair()
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    for _ in range(3):
        _step(eager, eager_opt, x, y, False)
        _step(lazy, lazy_opt, x, y, True)
    weight, eager_weight = lazy[0].weight, eager[0].weight
    if holder == "numpy":
        held, eager_held = weight.detach().numpy(), eager_weight.detach().numpy()
    elif holder == "dlpack":
        held, eager_held = torch.from_dlpack(weight.detach()), torch.from_dlpack(eager_weight.detach())
    else:
        held, eager_held = weight.data_ptr(), eager_weight.data_ptr()
    for _ in range(3):
        _step(eager, eager_opt, x, y, False)
        _step(lazy, lazy_opt, x, y, True)
    pydisc.synchronize()
    if holder == "data_ptr":
        assert weight.data_ptr() == held and eager_weight.data_ptr() == eager_held
        torch.testing.assert_close(weight.cpu(), eager_weight.detach())
    else:
        np.testing.assert_allclose(np.asarray(held), np.asarray(eager_held), rtol=1e-5, atol=1e-6)


class _DoublesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def test_an_input_the_step_writes_in_place_is_written_into_the_users_memory(monkeypatch):
    """A module input is the user's memory: its new value is copied into it, where NumPy (or anything
    else holding its address) sees it, as in eager."""
    monkeypatch.setattr(CONFIG, "async_cpu", False)     # (a step that writes its inputs runs at once anyway)
    torch.manual_seed(0)
    eager = _DoublesItsInput()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    for step in range(4):
        x = torch.randn(5, 8)
        x_eager = x.clone()
        held = x.numpy()
        with torch.no_grad():
            out = lazy(x)       # (kept: the compiled cluster has two results, the output and x's new value)
            want = eager(x_eager)
        pydisc.mark_step()
        np.testing.assert_allclose(held, x_eager.numpy(), rtol=0, atol=0)
        torch.testing.assert_close(out.cpu(), want)


def test_a_second_model_trained_by_the_same_plans_equals_eager(on_worker):
    """SGD's first step makes the momentum buffers, written into memory the plan's output pool keeps;
    the steps after hand that memory over and take other memory in exchange, so where the pool writes it
    again for the next model's first step, its memory has moved: the pool imported it by address once
    and wrote where it no longer was (a second model's momentum 0.1-0.26 off eager's)."""
    for _ in range(2):
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        lazy = pydisc.lazy(copy.deepcopy(eager))
        eager_opt, lazy_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, lazy))
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            for model, opt in ((eager, eager_opt), (lazy, lazy_opt)):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()     # (the gradients are dead at the mark: the pool takes their memory back)
            pydisc.mark_step()
            for a, b in zip(eager_opt.state.values(), lazy_opt.state.values()):
                torch.testing.assert_close(b["momentum_buffer"].cpu(), a["momentum_buffer"])
            for a, b in zip(eager.parameters(), lazy.parameters()):
                torch.testing.assert_close(b.cpu(), a)
