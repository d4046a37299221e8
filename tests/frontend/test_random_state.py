"""Random draws of a step and torch's generator state read or set before the step runs
(frontend/random_state.py): dropout masks equal eager's when code reseeds or rewinds the generator
mid-step, and gradient checkpointing with dropout (which rewinds it to recompute a forward) trains like
eager on both recording paths."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import pydisc
from pydisc.config import CONFIG
from pydisc.driver import dynamic
from pydisc.frontend import fast
from pydisc.frontend.random_state import get_rng_state


@pytest.fixture(autouse=True)
def _fresh() -> None:
    dynamic.clear()     # no sizes of another test's steps: the first step records as a first step does
    pydisc.reset_metrics()


def _between(kind: str) -> None:
    """What code does with torch's generator between two dropouts of one step; the state it reads first
    (what code that saves the state mid-step gets) is kept in `_SEEN`."""
    _SEEN[:] = [torch.get_rng_state()]
    if kind == "reseed":
        torch.manual_seed(99)
    elif kind == "rewind":
        torch.set_rng_state(_SAVED[0])      # back to where the first dropout drew
    elif kind == "fork":
        with torch.random.fork_rng():
            torch.manual_seed(3)
            torch.rand(4)


_SAVED: list = []
_SEEN: list = []


def _two_dropouts(model: nn.Module, kind: str, lazy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(7)
    x = torch.ones(4, 6)
    _SAVED[:] = [torch.get_rng_state()]
    first = F.dropout(model(x), 0.5, True)
    _between(kind)
    second = F.dropout(model(x), 0.5, True)
    out = torch.stack([first, second])
    if lazy:
        pydisc.mark_step()
    return out.detach(), _SEEN[0]


@pytest.mark.parametrize("fast_record", [True, False], ids=["fast", "dispatch"])
@pytest.mark.parametrize("kind", ["reseed", "rewind", "fork"])
def test_the_generator_reseeded_or_rewound_mid_step_gives_eagers_numbers(kind: str, fast_record: bool) -> None:
    """Without the guard the masks were drawn at mark_step from the state set last: a reseed or a rewind
    between the two dropouts gave other masks than eager's, silently; and the state read between them
    (what `fork_rng` or a checkpoint saves) was the one before the first dropout's draw."""
    torch.manual_seed(0)
    ref = nn.Linear(6, 6)
    model = pydisc.lazy(copy.deepcopy(ref), fast_record=fast_record)
    try:
        for _ in range(2):      # the first step runs eagerly (a first sighting), the second compiled
            expected, expected_seen = _two_dropouts(ref, kind, lazy=False)
            got, seen = _two_dropouts(model, kind, lazy=True)
            assert torch.equal(got != 0, expected != 0)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(seen, expected_seen)     # the state read mid-step: after the first dropout
            # and the generator is where eager leaves it
            torch.testing.assert_close(get_rng_state(), _after(ref, kind), rtol=0, atol=0)
        m = pydisc.metrics()
        assert m["random_state_runs"] >= 2
        if fast_record:
            assert m["fast_demotions"] == {"the random generator's state read or set": 2}
    finally:
        fast.uninstall()
        fast.set_default(CONFIG.fast_record)


def _after(ref: nn.Module, kind: str) -> torch.Tensor:
    _two_dropouts(ref, kind, lazy=False)
    return get_rng_state()


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, h, cos):
        return h + F.dropout(torch.tanh(self.a(h) * cos), 0.3, self.training)


class _Checkpointed(nn.Module):
    """An embedding, two checkpointed layers with dropout, a head; a buffer-made tensor passed along (as
    rotary embeddings are)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.head = nn.Linear(8, 10)
        self.register_buffer("freq", torch.linspace(0.5, 1.5, 8))

    def forward(self, ids):
        h = self.emb(ids)
        cos = torch.cos(self.freq * torch.arange(ids.shape[1], device=ids.device).float()[:, None])
        for layer in self.layers:
            h = checkpoint(layer, h, cos, use_reentrant=self.reentrant)
        return self.head(h)


def _train(model: nn.Module, lazy: bool, device: str, steps: int = 4) -> tuple[list, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 10, (3, 5), generator=g).to(device)
        torch.manual_seed(100 + step)       # (the CUDA generators too)
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if lazy:
            pydisc.mark_step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fast_record", [True, False], ids=["fast", "dispatch"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_with_dropout_trains_like_eager(reentrant: bool, fast_record: bool,
                                                               device: str) -> None:
    """The checkpoint's recomputation in the backward must draw the forward's masks: it puts back the
    generator's state saved before the forward. Recorded by the dispatcher (and by the fast recorder once a
    reentrant checkpoint demotes it), the draws were made at mark_step, the recomputation's after the
    forward's, and the gradients were those of other masks (parameters 2e-2 off after 4 steps)."""
    torch.manual_seed(0)
    ref = _Checkpointed(reentrant).to(device)
    model = pydisc.lazy(copy.deepcopy(ref), fast_record=fast_record)
    try:
        eager_losses, eager_params = _train(ref, lazy=False, device=device)
        losses, params = _train(model, lazy=True, device=device)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
        for got, expected in zip(params, eager_params):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        m = pydisc.metrics()
        assert m["random_state_runs"] > 0
        if fast_record:
            # the checkpoint reads the state as it starts, after the first layer's dropout: the forward is
            # re-recorded by the dispatcher there (or before, at the `autograd.Function` of a reentrant
            # checkpoint, or of torch 2.11's non-reentrant one), and then the checkpoint's recomputation
            # counts the tensors autograd saved for the values the demoted forward made
            assert m["fast_demotions"] and all(
                r == "the random generator's state read or set" or r.startswith("autograd.Function (")
                for r in m["fast_demotions"]), m["fast_demotions"]
    finally:
        fast.uninstall()
        fast.set_default(CONFIG.fast_record)


def _noise_and_timesteps(latents: torch.Tensor, lazy: bool, eager_first: bool) -> tuple:
    """A diffusion training step's draws: noise like the latents (a lazy random op where they are lazy)
    and timesteps drawn into an eager tensor."""
    torch.manual_seed(5)
    if eager_first:
        timesteps = torch.randint(0, 1000, (4,))
    noise = torch.randn_like(latents)
    if not eager_first:
        timesteps = torch.randint(0, 1000, (4,))
    noisy = latents + noise * timesteps[:, None]
    if lazy:
        pydisc.mark_step()
    return noisy.detach().cpu(), timesteps


def test_random_numbers_drawn_eagerly_while_a_steps_draws_wait_are_warned_of() -> None:
    """`torch.randn_like(lazy)` draws when the step runs; `torch.randint` of an eager tensor draws at once:
    in the step the timesteps come first, in eager the noise, so both differ from eager's. That cannot be
    put right when the step runs, so it is said (warned once, counted), not silent; drawn in the other
    order, the step equals eager and nothing is said."""
    latents = torch.ones(4, 3)
    expected = _noise_and_timesteps(latents, lazy=False, eager_first=False)
    with pytest.warns(pydisc.PydiscWarning, match="another order than in eager"):
        got = _noise_and_timesteps(pydisc.to_lazy(latents.clone()), lazy=True, eager_first=False)
    assert not torch.equal(got[1], expected[1])      # (what the warning is about)
    assert pydisc.metrics()["random_order_changes"] == 1

    expected = _noise_and_timesteps(latents, lazy=False, eager_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydisc.PydiscWarning)
        got = _noise_and_timesteps(pydisc.to_lazy(latents.clone()), lazy=True, eager_first=True)
    torch.testing.assert_close(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert pydisc.metrics()["random_order_changes"] == 1
