"""`pydisc.lazy(module)`: turn a module's parameters and buffers into lazy tensors, in place."""
from __future__ import annotations

import torch

from .frontend import inference
from .frontend.lazy_tensor import RECORDER, LazyTensor, to_lazy
from .frontend.symbolic import release_factory_mode

__all__ = ["lazy"]


def _default_device(module: torch.nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def _moved(x, device: torch.device):
    """`x` with its tensors on `device`: `x` itself where none had to move (the common case once steps
    run eagerly, where a pytree walk cost 75 us of a 370 us MLP step)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        items = [_moved(v, device) for v in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        items = {k: _moved(v, device) for k, v in x.items()}
        return x if all(items[k] is v for k, v in x.items()) else type(x)(items)
    return x


def _pre_hook(device: torch.device):
    tensor = torch.Tensor

    def hook(module, args, kwargs):
        if RECORDER.released:       # steps run eagerly from now on (pydisc/step_choice.py)
            if not kwargs:
                for a in args:
                    if type(a) is not tensor or a.device != device:
                        break
                else:
                    return None     # (the common case, at the cost of an empty hook: a few µs a step)
            moved = _moved(args, device), _moved(kwargs, device)
            return None if moved[0] is args and moved[1] is kwargs else moved
        inference.use_for_forward()     # F.linear and matmul recorded whole where no grad is recorded
        release_factory_mode()          # (no dispatch is under way here)
        return _lazy_input(args, device), _lazy_input(kwargs, device)
    return hook


def _lazy_input(x, device: torch.device):
    if isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
        dynamic = getattr(x, "_pydisc_dynamic", None)    # pydisc.mark_dynamic
        x = x.to(device)
        if x.storage_offset() != 0 or not x.is_contiguous() or \
                x.untyped_storage().nbytes() != x.numel() * x.element_size():
            # a slice of a larger tensor (a batch of a dataset): copy it, so the step's input is the
            # batch alone and its plan does not depend on where in the dataset the batch sits
            x = x.clone(memory_format=torch.contiguous_format)
        if dynamic is not None:
            x._pydisc_dynamic = dynamic
        return to_lazy(x, step_input=True)
    if isinstance(x, (list, tuple)):
        return type(x)(_lazy_input(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _lazy_input(v, device) for k, v in x.items()}
    return x


def lazy(module: torch.nn.Module, *, device: str | torch.device | None = None) -> torch.nn.Module:
    """Convert `module` in place and return it: its parameters and buffers become lazy tensors on
    `device` (default: where they are now), and tensors passed to its forward become lazy too.

    Build optimizers after this call: they must hold the lazy parameters.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError("pydisc.lazy expects a torch.nn.Module, got %s" % type(module).__name__)
    device = torch.device(device) if device is not None else _default_device(module)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("pydisc.lazy: device %s requested but CUDA is not available" % device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())   # as tensors' `.device` names it
    if RECORDER.released:
        # The step choice kept eager for the models before (pydisc/step_choice.py), and their tensors are
        # plain now: this model's steps are measured afresh rather than passed through for good.
        from . import step_choice
        step_choice.reset()
    converted: dict[int, torch.Tensor] = {}   # tied weights stay tied

    def convert(t: torch.Tensor | None, is_param: bool):
        if t is None or isinstance(t, LazyTensor):
            return t
        if id(t) in converted:
            return converted[id(t)]
        data = to_lazy(t.detach().to(device))
        if is_param:
            new = torch.nn.Parameter(data, requires_grad=t.requires_grad)
        else:
            new = data
        converted[id(t)] = new
        return new

    # Entries are replaced directly: module._apply and `param.data = ...` do not work for wrapper
    # subclasses (see the recording notes).
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            m._parameters[name] = convert(p, True)
        for name, b in list(m._buffers.items()):
            m._buffers[name] = convert(b, False)
    if not getattr(module, "_pydisc_hooked", False):
        module.register_forward_pre_hook(_pre_hook(device), with_kwargs=True)
        module._pydisc_hooked = True
    module._pydisc_device = device
    return module
