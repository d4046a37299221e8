"""`pydisc.lazy(module)`: turn a module's parameters and buffers into lazy tensors, in place."""
from __future__ import annotations

import copy
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .diagnostics import warn_once
from .driver import step_choice
from .driver.engine import ENGINE
from .frontend import fast, inference
from .frontend.lazy_tensor import RECORDER, LazyTensor, to_lazy
from .frontend.trace import LazyStorage
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
    return _mapped(x, _moved, device)


def _mapped(x, fn, device: torch.device):
    """A list, tuple or dict `x` with `fn(item, device)` for its items: `x` itself where no item changed,
    else a container of the same type (a namedtuple, an OrderedDict, an HF `ModelOutput`, which `generate`
    passes as `encoder_outputs`: rebuilt as a plain dict, T5's forward failed on `encoder_outputs[0]`)."""
    if isinstance(x, (list, tuple)):
        items = [fn(v, device) for v in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else items if type(x) is list else type(x)(items)
    if isinstance(x, dict):
        items = {k: fn(v, device) for k, v in x.items()}
        if all(items[k] is v for k, v in x.items()):
            return x
        if type(x) is dict:
            return items
        out = copy.copy(x)      # its type and state (a defaultdict's factory, a ModelOutput's fields)
        for k, v in items.items():
            out[k] = v
        return out
    return x


def _pre_hook(device: torch.device):
    tensor = torch.Tensor

    def hook(module, args, kwargs):
        ENGINE.note_thread()            # (before the check: step_choice.py may release under the recorder's lock)
        if RECORDER.released:       # steps run eagerly from now on (pydisc/driver/step_choice.py)
            if not kwargs:
                for a in args:
                    if type(a) is not tensor or a.device != device:
                        break
                else:
                    return None     # (the common case, at the cost of an empty hook: a few µs a step)
            moved = _moved(args, device), _moved(kwargs, device)
            return None if moved[0] is args and moved[1] is kwargs else moved
        ENGINE.enter_scope(module)      # the step is this model's, unless another's forward began it
        inference.use_for_forward()     # F.linear and matmul recorded whole where no grad is recorded
        fast.arm(module._pydisc_fast_record, device, module)  # a forward with grad recorded at __torch_function__
        release_factory_mode()          # (no dispatch is under way here)
        if not kwargs and all(type(a) is tensor for a in args):
            if len(args) == 1:
                return (_lazy_input(args[0], device),), kwargs      # (the common case, in short)
            wrap = _LazyInputs()
            return tuple([wrap(a, device) for a in args]), kwargs
        wrap = _LazyInputs()
        return wrap(args, device), wrap(kwargs, device)
    return hook


class _LazyInputs:
    """Makes one forward call's tensor arguments lazy (`_lazy_input`): the same tensor passed twice
    (`labels=input_ids`) is one lazy tensor, as it is one tensor in eager, so that a forward that
    writes one in place changes the other (each had a storage of its own: `forward(a, b)` with
    `a.mul_(2)` called as `m(x, x)` computed `2x + x`). Distinct tensors over one memory (a tensor and
    its view, two slices of one dataset tensor) stay inputs of their own: a slice is copied, so that
    the step's plan does not depend on where in its tensor the slice sits (docs/robustness.md)."""

    def __init__(self) -> None:
        self.made: dict[int, LazyTensor] = {}         # id(eager tensor) -> its lazy tensor

    def __call__(self, x, device: torch.device):
        if isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
            made = self.made.get(id(x))
            if made is None:
                made = self.made[id(x)] = _lazy_input(x, device)
            return made
        return _mapped(x, self, device)


def _lazy_input(x: torch.Tensor, device: torch.device) -> LazyTensor:
    """An eager tensor argument of a lazy module's forward as a step input (`_LazyInputs` walks the
    containers)."""
    marked = getattr(x, "_pydisc_dynamic", None)    # pydisc.mark_dynamic
    if x.device != device:
        x = x.to(device)
    if x.storage_offset() != 0 or not x.is_contiguous() or \
            x.untyped_storage().nbytes() != x.numel() * x.element_size():
        # a slice of a larger tensor (a batch of a dataset): copy it, so the step's input is the
        # batch alone and its plan does not depend on where in the dataset the batch sits
        x = x.clone(memory_format=torch.contiguous_format)
    if marked is not None:
        x._pydisc_dynamic = marked
    return to_lazy(x, step_input=True)


def lazy(module: torch.nn.Module, *, device: str | torch.device | None = None,
         fast_record: bool | None = None) -> torch.nn.Module:
    """Convert `module` in place and return it: its parameters and buffers become lazy tensors on
    `device` (default: where they are now), and tensors passed to its forward become lazy too.

    The Parameter and buffer objects stay the same objects (`torch.utils.swap_tensors`), so optimizers,
    hooks and references made before this call keep working. `fast_record`: record this module's
    training forwards at `__torch_function__` (docs/fast_recording.md), or every ATen op through the
    dispatcher (False); None follows `PYDISC_FAST_RECORD`.
    """
    if fast_record is not None and not isinstance(fast_record, bool):
        raise TypeError("pydisc.lazy: fast_record must be True, False or None, got %r" % (fast_record,))
    if not isinstance(module, torch.nn.Module):
        raise TypeError("pydisc.lazy expects a torch.nn.Module, got %s" % type(module).__name__)
    device = torch.device(device) if device is not None else _default_device(module)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("pydisc.lazy: device %s requested but CUDA is not available" % device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())   # as tensors' `.device` names it
    if RECORDER.released:
        # The step choice kept eager for the models before (pydisc/driver/step_choice.py), and their tensors are
        # plain now: this model's steps are measured afresh rather than passed through for good.
        step_choice.reset()
    converted: dict[int, torch.Tensor] = {}   # tied weights stay tied

    def convert(t: torch.Tensor | None, is_param: bool):
        if t is None or isinstance(t, LazyTensor):
            return t
        if id(t) in converted:
            return converted[id(t)]
        real = t.detach().to(device)
        data = to_lazy(real, storage=_lazy_storage_over(real))
        _note_memory(real, data._storage)
        new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
        converted[id(t)] = kept = _keep_object(t, new)
        return kept

    # `module._apply` and `param.data = ...` do not work for wrapper subclasses: each tensor object is
    # turned lazy where it is (`_keep_object`) and its entry set to it.
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            m._parameters[name] = convert(p, True)
        for name, b in list(m._buffers.items()):
            m._buffers[name] = convert(b, False)
    if not getattr(module, "_pydisc_hooked", False):
        module.register_forward_pre_hook(_pre_hook(device), with_kwargs=True)
        module._pydisc_hooked = True
    module._pydisc_fast_record = fast_record
    module._pydisc_device = device
    return module


# Parameters and buffers that are other objects over the same memory (`nn.Parameter(t)` twice, `b.data =
# a.data`, a buffer that views a parameter) share one lazy storage, so that a step that writes one (an
# optimizer) is seen by the other, as in eager; also where separate `lazy()` calls convert them (two
# submodules made lazy one by one). The lazy storages `lazy()` made, by the torch storage of their memory
# (its `_cdata`): id -> weak reference to the lazy storage.
_BY_MEMORY: dict[int, weakref.ref] = {}


def _lazy_storage_over(real: torch.Tensor) -> LazyStorage | None:
    """The lazy storage `lazy()` made of the memory `real` views, if it still has that memory (an address
    of a torch storage freed since may have been given to another)."""
    memory = real.untyped_storage()._cdata
    ref = _BY_MEMORY.get(memory)
    storage = ref() if ref is not None else None
    if storage is None or storage.real is None or storage.real.untyped_storage()._cdata != memory:
        return None
    return storage


def _note_memory(real: torch.Tensor, storage: LazyStorage) -> None:
    memory = real.untyped_storage()._cdata

    def forget(ref: weakref.ref) -> None:
        if _BY_MEMORY.get(memory) is ref:
            del _BY_MEMORY[memory]

    if _lazy_storage_over(real) is not storage:
        _BY_MEMORY[memory] = weakref.ref(storage, forget)


# Tensors `lazy()` could not turn lazy in place (weak references to them, or other references to their
# storage, make `swap_tensors` refuse): id -> weak reference to the replaced original. An optimizer that
# still steps one of them is stopped at its first step (`_check_optimizer`).
_REPLACED: dict[int, weakref.ref] = {}
_CHECKED_OPTIMIZERS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOK: list = []


def _keep_object(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`old` itself, now holding `new`'s lazy tensor; its hooks and attributes kept. Where torch refuses
    the swap, `new` (and `old` is remembered: an optimizer stepping it raises)."""
    hooks, accumulate_hooks = old._backward_hooks, old._post_accumulate_grad_hooks
    grad = old.grad if old.grad_fn is None else None
    try:
        old.grad = None            # (held by the C++ tensor, which the swap replaces)
        torch.utils.swap_tensors(old, new)
    except RuntimeError as exc:
        old.grad = grad
        warn_once("lazy:swap", "pydisc.lazy could not convert a parameter or buffer in place (%s): it is "
                  "replaced by a new object, and optimizers or hooks built before pydisc.lazy() do not see "
                  "it; build them after pydisc.lazy(model)" % exc)
        _remember_replaced(old)
        return new
    # `new` now holds what `old` held (its impl, class and attributes): bring the user's attributes over,
    # and hand the hook dicts (which the user's handles remove from) to the new impl through their setters
    for name, value in new.__dict__.items():
        old.__dict__.setdefault(name, value)
    old._backward_hooks = hooks
    old._post_accumulate_grad_hooks = accumulate_hooks
    if grad is not None:
        old.grad = to_lazy(grad.to(old.device))
    return old


def _remember_replaced(old: torch.Tensor) -> None:
    try:
        _REPLACED[id(old)] = weakref.ref(old, lambda _, key=id(old): _REPLACED.pop(key, None))
    except TypeError:
        return
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer, args, kwargs) -> None:
    """At an optimizer's first step: refuse one that holds parameters `lazy()` replaced (it would step
    the old objects and the model would not train)."""
    if optimizer in _CHECKED_OPTIMIZERS:
        return
    _CHECKED_OPTIMIZERS.add(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _REPLACED.get(id(p))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    "this optimizer holds a parameter that pydisc.lazy() replaced (it could not be converted "
                    "in place, see the warning before): it would step the old tensor and the model would not "
                    "train. Build the optimizer after pydisc.lazy(model).")
