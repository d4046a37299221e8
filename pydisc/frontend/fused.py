"""The fast recorder's entry of a step: `FusedStep`, the recorded calls of one forward, replayed.

A segment (frontend/segment.py) records calls with their tensor arguments encoded as `FV` (a value the
segment made) or `XV` (one of its inputs). `FusedStep` runs those calls again on real, fake or traced
tensors, each under the grad mode and autocast state it was recorded with, and, for a forward that ended
in `backward()`, returns the parameters' gradients: computed by `torch.func.vjp` when the step is
planned (inside `torch.func.functionalize`) and by `torch.autograd.grad` when it runs eagerly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["FV", "XV", "Demote", "NoMeta", "FusedStep", "autograd_dispatched", "decode"]

_autocast = torch._C._is_any_autocast_enabled
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
# What torch excludes from the dispatch inside a `__torch_dispatch__` that autograd needs
_AUTOGRAD_KEYS = (torch._C.DispatchKey.ADInplaceOrView, torch._C.DispatchKey.AutogradFunctionality,
                  torch._C.DispatchKey.AutogradOther)
_functorch = torch._C._are_functorch_transforms_active
_Tensor = torch.Tensor


class FV:
    """A fast value in an entry's arguments."""
    __slots__ = ("fid",)

    def __init__(self, fid: int) -> None:
        self.fid = fid


class XV:
    """An input of the segment (a lazy tensor it did not make, or an eager tensor) in an entry's arguments."""
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_FVS: list[FV] = []
_XVS: list[XV] = []


def _fv(fid: int) -> FV:
    while len(_FVS) <= fid:
        _FVS.append(FV(len(_FVS)))
    return _FVS[fid]


def _xv(index: int) -> XV:
    while len(_XVS) <= index:
        _XVS.append(XV(len(_XVS)))
    return _XVS[index]


class Demote(Exception):
    """Raised inside recording: the segment must be demoted (the message is the reason)."""


class NoMeta(Demote):
    """No meta kernel says what the call gives: it reads data (`bool(t)`, `.item()`) or its shapes do."""


def _amp(device_type: str, others: bool = True):
    """The autocast dtype in force for `device_type`'s tensors, or None; Demote where another device's
    autocast is on too (it would cast the eager tensors of other devices a call takes), unless `others`
    is False (a replay, which sets the state each call was recorded under)."""
    if not _autocast():
        return None
    if others and any(torch.is_autocast_enabled(d) for d in _AMP_DEVICES if d != device_type):
        raise Demote("autocast on another device")
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


_AMP_DEVICES = ("cpu", "cuda")


def _slots(a):
    t = type(a)
    if t is FV or t is XV:
        yield a
    elif t is list or t is tuple:
        for x in a:
            yield from _slots(x)
    elif t is dict:
        for x in a.values():
            yield from _slots(x)


def decode(a, env, inputs):
    """An entry's argument with each fast value taken from `env` (by id) and each input from `inputs` (by
    index), inside lists and tuples too. (A function of the module, not a closure that calls itself: such a
    closure is a reference cycle, which would keep `env`, every value of the replay, until the next
    cyclic collection.)"""
    t = type(a)
    if t is FV:
        return env[a.fid]
    if t is XV:
        return inputs[a.index]
    if t is list or t is tuple:
        return t([decode(x, env, inputs) for x in a])
    return a


def _assign(env, out, out_fids, out_leaves) -> None:
    """Bind a replayed call's results to their fast value ids (values written in place and not returned
    keep theirs: the same tensor, now holding the new data)."""
    leaves = [out] if isinstance(out, _Tensor) else pytree.tree_leaves(out)
    for fid, j in zip(out_fids, out_leaves):
        env[fid] = leaves[j]


class FusedStep:
    """A segment as one entry of the step's trace: called on the segment's inputs, returns the gradients
    of its parameters (`leaves`, input slots) and the values still alive at its end (`outputs`), and
    writes the inputs its calls write in place (`written`, input slots: a BatchNorm's running
    statistics), as an in-place op of the trace writes its argument."""

    def __init__(self, entries: tuple, n_inputs: int, leaves: tuple, loss: int | None, outputs: tuple,
                 device_type: str, written: tuple = ()) -> None:
        self.entries = entries
        self.device_type = device_type
        self.n_inputs = n_inputs
        self.leaves = leaves
        self.loss = loss
        self.outputs = outputs
        self.written = written
        self.draws = 0      # calls that draw random numbers (when the step runs: frontend/random_state.py)
        # fid -> its value, computed by torch for a read before the forward's end (`Segment.evaluate`), and
        # how many calls were recorded at the last such read
        self.evaluated: dict[int, torch.Tensor] = {}
        self.read_upto = 0

    def __repr__(self) -> str:
        return "pydisc.fused_step"

    def forward(self, inputs: list, on_call: Callable[[int], None] | None = None, given: dict | None = None,
                given_before: int = 0) -> dict:
        """Run the calls on `inputs`: {fast value id: its tensor}. `on_call(k)` before the k-th call;
        `given`: values to take as they are, {fid: tensor}, in place of the calls among the first
        `given_before` that make only such values."""
        env: dict[int, torch.Tensor] = {}
        device_type = self.device_type
        with contextlib.ExitStack() as stack:
            amp_now = _amp(device_type, others=False)
            for k, (func, args, kwargs, out_fids, (grad, amp), out_leaves) in enumerate(self.entries):
                if on_call is not None:
                    on_call(k)
                if k < given_before and out_fids and all(f in given for f in out_fids):
                    env.update((f, given[f]) for f in out_fids)
                    continue
                if amp != amp_now:
                    # the autocast state the call was recorded under (consecutive calls share one region,
                    # so its cast of a weight is made once there, as in eager)
                    stack.close()
                    stack.enter_context(torch.autocast(device_type, dtype=amp, enabled=amp is not None))
                    amp_now = amp
                with torch.set_grad_enabled(grad):
                    out = func(*[decode(a, env, inputs) for a in args],
                               **{k: decode(v, env, inputs) for k, v in kwargs.items()})
                _assign(env, out, out_fids, out_leaves)
        return env

    def __call__(self, *inputs: torch.Tensor) -> list:
        if self.loss is None:
            env = self.forward(list(inputs))
            return [env[f] for f in self.outputs]
        leaves, written = self.leaves, self.written
        if _functorch():
            # planned: inside torch.func.functionalize, where autograd does not record, so functorch's
            # own autograd transform. The inputs the calls write are written on copies made inside it
            # and copied into the inputs after it: functionalize turns that into returned values.
            def fwd(*params):
                values = list(inputs)
                for i, p in zip(leaves, params):
                    values[i] = p
                for i in written:
                    values[i] = inputs[i].clone()
                env = self.forward(values)
                return env[self.loss], ([env[f] for f in self.outputs], [values[i] for i in written])

            with torch.enable_grad():
                loss, vjp, (values, new) = torch.func.vjp(fwd, *[inputs[i] for i in leaves], has_aux=True)
                grads = vjp(torch.ones_like(loss))
            for i, t in zip(written, new):
                inputs[i].copy_(t)
            # (the segment declares the gradients contiguous, Segment.close)
            return _distinct([*[g.contiguous() for g in grads], *values])
        # replayed eagerly: autograd itself, as eager's backward (torch.func.vjp fails on a few programs
        # autograd runs: HF T5's attention under bf16 autocast on the CPU)
        with torch.enable_grad(), autograd_dispatched():
            values = list(inputs)
            params = []
            for i in leaves:
                p = values[i] = inputs[i].detach().requires_grad_(True)
                params.append(p)
            env = self.forward(values)
            grads = torch.autograd.grad(env[self.loss], params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.contiguous() for g, p in zip(grads, params)]
        return _distinct([*grads, *[env[f].detach() for f in self.outputs]])


def _distinct(outputs: list) -> list:
    """Each output its own tensor: a backward formula may give one tensor as the gradient of two
    parameters (an LSTM's two biases), and each is a value of its own in the step's trace, which a later
    op may write in place (SGD's Nesterov step adds into `.grad`); eager's autograd, too, gives two
    leaves two tensors."""
    seen = set()
    for i, t in enumerate(outputs):
        if id(t) in seen:
            outputs[i] = t = t.clone()
        seen.add(id(t))
    return outputs


@contextlib.contextmanager
def autograd_dispatched():
    """Autograd in the dispatch again where torch excluded it: a value read before mark_step runs the
    pending step from inside the read op's `__torch_dispatch__`, and there no op records a graph."""
    excluded = [k for k in _AUTOGRAD_KEYS if _excluded(k)]
    for k in excluded:
        _set_excluded(k, False)
    try:
        yield
    finally:
        for k in excluded:
            _set_excluded(k, True)
