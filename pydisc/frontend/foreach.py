"""Recording torch's multi-tensor (`_foreach_*`) ops.

An optimizer step is a handful of foreach ops over every parameter: AdamW's is about ten, over 148
tensors for a BERT-base model. Recorded per element, that is some 1,500 entries per step, a third of
the step's recording. So a foreach op whose lists hold only lazy tensors is recorded as *one* entry:
its function is a `SplitForeach`, which runs the op one element at a time when the trace is replayed
(traced for the compiler, or eagerly). The compiled graph is the same either way; only recording is
cheaper.

Python floats that vary between steps (learning rates, Adam's per-step bias corrections, which arrive
as a `ScalarList`) are lifted into scalar inputs, exactly where the per-element rewrites of
`frontend/rewrites.py` lift them (`mul`/`div` scalars, `add`/`sub` alphas, `lerp` weights, `addcmul`/
`addcdiv` values), and replayed as those rewrites record them. A call that does not fit (an eager
tensor in a list, a float that cannot be lifted for every element, a symbolic size) is split while
recording, each element going to the recorder as an op of its own.
"""
from __future__ import annotations

from typing import Any

import torch

from .lazy_tensor import RECORDER, LazyTensor, LiftedScalar, liftable
from .meta_keys import symbolic_args
from .op_facts import opinfo

__all__ = ["SplitForeach", "record_foreach", "optimizers_take_their_foreach_path", "takes_foreach",
           "FOREACH_HOOKS"]

aten = torch.ops.aten
_LIFTING = {"mul", "div", "add", "sub", "lerp", "addcmul", "addcdiv"}


def _element_name(func) -> str:
    return func._schema.name.split("::")[1][len("_foreach_"):]


def _is_list(a) -> bool:
    return type(a) is list or type(a) is tuple


class SplitForeach:
    """The function of a foreach op's entry: the op, element by element, where a 0-d tensor stands for
    each lifted float (so a lifted `addcdiv` value is the `add(s, mul(div(a, b), v))` that the rewrite
    records for one element, in eager's order)."""

    def __init__(self, func) -> None:
        self.func = func
        self.name = _element_name(func)
        self.base = self.name.rstrip("_")
        self.packet = getattr(aten, self.name)
        self.returns = bool(func._schema.returns)
        self.overloads: dict[tuple, Any] = {}    # the element's argument kinds -> its OpOverload

    def __repr__(self) -> str:
        return "split(%s)" % self.func

    def __call__(self, *args, **kwargs):
        lists = [i for i, a in enumerate(args) if _is_list(a)]
        results = []
        for k in range(len(args[lists[0]])):
            results.append(self.element([a[k] if i in lists else a for i, a in enumerate(args)], kwargs))
        return results if self.returns else None

    def element(self, args: list, kwargs: dict):
        add = aten.add_.Tensor if self.name.endswith("_") else aten.add.Tensor
        if self.base in ("addcmul", "addcdiv"):
            value = args.pop() if len(args) > 3 else kwargs.get("value", 1)
            if isinstance(value, torch.Tensor):
                s, a, b = args
                if self.base == "addcmul":
                    return add(s, aten.mul.Tensor(aten.mul.Tensor(a, value), b))
                return add(s, aten.mul.Tensor(aten.div.Tensor(a, b), value))
            kwargs = dict(kwargs, value=value)
            return self.overload(args, kwargs)(*args, **kwargs)
        alpha = kwargs.get("alpha")
        if isinstance(alpha, torch.Tensor):
            return self.packet.Tensor(args[0], aten.mul.Tensor(args[1], alpha))
        return self.overload(args, kwargs)(*args, **kwargs)

    def overload(self, args: list, kwargs: dict):
        """The element op's overload for these arguments, as calling the packet would pick it. Resolved
        once per kind of arguments: the packet tries its overloads in turn at every call, and one that
        fails to bind raises inside (`lerp_` with a lifted, 0-d tensor weight tries `lerp_.Scalar`
        first: ~200 µs per element on the VM, 1.2 ms on the H200 host, where the op takes 7 µs)."""
        key = tuple(_kind(a) for a in args) + tuple((k, _kind(v)) for k, v in kwargs.items())
        op = self.overloads.get(key)
        if op is None:
            op = self.overloads[key] = _resolve(self.packet, args, kwargs)
        return op


def _kind(a) -> Any:
    return torch.Tensor if isinstance(a, torch.Tensor) else type(a)


# what each kind of Python argument binds to in a schema (`torch._C` type kinds): never a tensor to a
# number; a Python number to a Tensor (as a wrapped number) only for the ops torch allows it for
_BINDS = {torch.Tensor: {"TensorType"}, float: {"NumberType", "FloatType"},
          int: {"NumberType", "IntType", "FloatType", "SymIntType"}, bool: {"NumberType", "BoolType"},
          str: {"StringType"}, type(None): {"NoneType"}}
_NUMBERS_AS_TENSORS = getattr(torch._C, "_should_allow_numbers_as_tensors", None)


def _binds(value, t, numbers_as_tensors: bool) -> bool:
    kind = t.kind()
    if kind == "OptionalType":
        return value is None or _binds(value, t.getElementType(), numbers_as_tensors)
    return kind in _BINDS.get(_kind(value), ()) or (
        numbers_as_tensors and kind == "TensorType" and type(value) in (float, int, bool))


def _resolve(packet, args: list, kwargs: dict):
    """The overload of `packet` that calling it with these arguments runs: the first, in the packet's
    order, whose schema takes them, as torch's own resolution picks it. That
    (`torch._C._jit_resolve_packet`) is only the fallback, where no schema fits by the rules here: it
    formats the value of each argument an overload rejects into an error message, which for a 0-d CUDA
    tensor is a device read (some 80 ms on the H200 host, the first time)."""
    name = packet._qualified_op_name
    if _NUMBERS_AS_TENSORS is not None:
        numbers_as_tensors = _NUMBERS_AS_TENSORS(name.split("::")[1])
        for overload in packet.overloads():
            arguments = getattr(packet, overload)._schema.arguments
            positional = [a.name for a in arguments if not a.kwarg_only]
            if len(args) > len(positional) or not set(kwargs) <= {a.name for a in arguments}:
                continue
            given = dict(zip(positional, args), **kwargs)
            if all(_binds(given[a.name], a.type, numbers_as_tensors) if a.name in given else a.has_default_value()
                   for a in arguments):
                return getattr(packet, overload)
    return getattr(packet, torch._C._jit_resolve_packet(name, *args, **kwargs))


_SPLITS: dict[int, SplitForeach] = {}     # id(foreach OpOverload) -> its entries' function


def _all_liftable(selves: list, values: list) -> bool:
    """`liftable(self_k, value_k)` for every element; float32 lists (the common case) at C speed."""
    if set(map(type, values)) == {float} and set(map(type, selves)) == {LazyTensor} and \
            {s.dtype for s in selves} == {torch.float32}:
        return True
    return all(liftable(s, v) for s, v in zip(selves, values))


def _lift_one(selves: list, value) -> Any:
    """`value` (a float, or one float per element) lifted, if `liftable` holds for every element; the
    value itself if nothing is a float; None if only some elements could lift it."""
    if _is_list(value):
        if not any(type(v) is float for v in value):
            return value
        if _all_liftable(selves, value):
            return [LiftedScalar(v) for v in value]
        return None
    if type(value) is not float:
        return value
    if _all_liftable(selves, [value] * len(selves)):
        return LiftedScalar(value)
    return None


def _lifted(base: str, args: list, kwargs: dict) -> tuple[list, dict] | None:
    """The arguments with the floats lifted that the per-element rewrites lift; None where they would
    lift them for some elements only (then the op is split while recording)."""
    selves = args[0]
    if base in ("mul", "div"):
        if len(args) == 2 and "alpha" not in kwargs:
            args[1] = _lift_one(selves, args[1])
    elif base in ("add", "sub"):
        alpha = kwargs.get("alpha", 1)
        if type(alpha) is float and alpha != 1 and len(args) == 2 and _is_list(args[1]):
            same = all(isinstance(o, torch.Tensor) and o.dtype == s.dtype and o.device == s.device
                       for s, o in zip(selves, args[1]))
            kwargs["alpha"] = _lift_one(selves, alpha) if same else alpha
            if kwargs["alpha"] is None:
                return None
    elif base == "lerp":
        if len(args) == 3:
            args[2] = _lift_one(selves, args[2])
    elif base in ("addcmul", "addcdiv"):
        if len(args) > 3 and isinstance(args[3], torch.Tensor):
            return None                     # one value per element, in a tensor
        if len(args) > 3:
            same = all(a.shape == b.shape for a, b in zip(args[1], args[2]))
            args[3] = _lift_one(selves, args[3]) if same else args[3]
        elif "value" in kwargs:
            return None
    if any(a is None for a in args):
        return None
    return args, kwargs


_ELEMENT_TYPES = {LazyTensor, float, int}     # what a list of an op recorded as one entry may hold


def _whole(func, args, kwargs):
    """Record `func` as one entry, or NotImplemented."""
    lists = [a for a in args if _is_list(a)]
    if not lists or not all(set(map(type, a)) <= _ELEMENT_TYPES for a in lists):
        return NotImplemented
    for a in args:
        # a tensor beside the lists must be one value for every element (`_foreach_mul_.Tensor`)
        if isinstance(a, torch.Tensor) and (type(a) is not LazyTensor or a.dim() != 0):
            return NotImplemented
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return NotImplemented
    if RECORDER.symbolic is not None and symbolic_args(args, kwargs):
        return NotImplemented
    base = _element_name(func).rstrip("_")
    enc_args, enc_kwargs = list(args), dict(kwargs)
    if base in _LIFTING:
        lifted = _lifted(base, enc_args, enc_kwargs)
        if lifted is None:
            return NotImplemented
        enc_args, enc_kwargs = lifted
    info = opinfo(func)
    try:
        # the op's own meta kernel, on the floats themselves (a ScalarList takes no tensors)
        recipe = RECORDER.recipe(func, enc_args, enc_kwargs, info, args, kwargs)
    except Exception:
        return NotImplemented
    split = _SPLITS.get(id(func))
    if split is None:
        split = _SPLITS[id(func)] = SplitForeach(func)
    return RECORDER._record(split, tuple(enc_args), enc_kwargs, info, recipe, None)


def _split(func, args, kwargs):
    """`_foreach_op(list, ...)` -> one `op` per element (per-element scalars of ScalarList overloads)."""
    name = _element_name(func)
    packet = getattr(aten, name)      # (record_foreach checked that it exists)
    lists = [i for i, a in enumerate(args) if _is_list(a)]
    n = len(args[lists[0]])
    results = []
    for k in range(n):
        elem_args = [a[k] if i in lists else a for i, a in enumerate(args)]
        elem_kwargs = kwargs
        if name.startswith("addc") and len(elem_args) > 3:   # foreach passes `value` positionally
            elem_kwargs = dict(kwargs, value=elem_args.pop())
        if not any(type(a) is LazyTensor for a in elem_args):
            results.append(packet(*elem_args, **elem_kwargs))    # no lazy tensor: torch runs it
            continue
        # the element's overload (add(t, 0.5) is add.Tensor with a float), resolved once per argument
        # types as torch's dispatcher would (`_resolve`: torch's own resolution would format a rejected
        # lazy argument, i.e. run what it needs); the element then goes to the recorder directly,
        # without torch's dispatch into the subclass (about half the cost of recording an op)
        key = (func, tuple(type(a) for a in elem_args), tuple(elem_kwargs))
        op = _ELEMENT_OPS.get(key)
        if op is None:
            op = _ELEMENT_OPS[key] = _resolve(packet, elem_args, elem_kwargs)
        results.append(RECORDER.dispatch(op, tuple(elem_args), elem_kwargs))
    if not func._schema.returns:
        return None
    return results


# (foreach op, element argument types, keyword names) -> the element's OpOverload
_ELEMENT_OPS: dict[tuple, object] = {}


def record_foreach(func, args, kwargs):
    """The foreach rewrite: one entry where it can, one op per element where it cannot."""
    if getattr(aten, _element_name(func), None) is None:
        return NotImplemented
    result = _whole(func, args, kwargs)
    if result is NotImplemented:
        return _split(func, args, kwargs)
    return result


def optimizers_take_their_foreach_path() -> None:
    """torch's optimizers pick their multi-tensor (foreach) implementation, the default on CUDA, only for
    plain tensors (`torch.optim.optimizer._foreach_supported_types`); a lazy parameter took the
    per-parameter loop. Listed there, it takes the path eager takes on CUDA, which records at a fraction
    of the cost: one entry per foreach op instead of one per parameter and op.

    On the CPU eager's default is the per-parameter loop; for a group of lazy parameters whose `foreach`
    is left to torch (None), the step runs the foreach implementation instead (set for the step by an
    optimizer step pre-hook, put back by the post-hook, so `state_dict()` is unchanged). Both compute
    the same formulas op for op: SGD, Adam(W), RMSprop, Adagrad, Adamax, Adadelta and Rprop give
    bit-equal parameters, NAdam, RAdam and ASGD differ by an ulp. Except where the foreach implementation
    writes what the loop leaves alone (`_writes_grads`): those groups keep eager's loop."""
    import torch.optim.optimizer as optimizer_module   # torch.optim deletes its `optimizer` attribute

    types = getattr(optimizer_module, "_foreach_supported_types", None)
    if isinstance(types, list) and LazyTensor not in types:
        types.append(LazyTensor)
    global _HOOKS
    if _HOOKS is None:
        _HOOKS = (optimizer_module.register_optimizer_step_pre_hook(_foreach_for_lazy_groups),
                  optimizer_module.register_optimizer_step_post_hook(_foreach_put_back))


_HOOKS = None       # the step hooks, registered once per process
_FLIPPED = "_pydisc_foreach_groups"     # the optimizer's attribute: the groups set to foreach for a step


def takes_foreach(optimizer, group: dict) -> bool:
    """Whether the group's step takes torch's foreach implementation: set by the user, or left to torch
    (None) for lazy parameters that `_foreach_for_lazy_groups` sets to it for the step."""
    foreach = group.get("foreach")
    return foreach is True or (foreach is None and _flipped_for_the_step(optimizer, group))


def _flipped_for_the_step(optimizer, group: dict) -> bool:
    params = group.get("params")
    return ("foreach" in group and group["foreach"] is None and not group.get("fused")
            and not group.get("differentiable") and bool(params)
            and all(type(p) is LazyTensor for p in params) and not _writes_grads(optimizer, group)
            and not _tensor_hyperparameters(group))


def _foreach_for_lazy_groups(optimizer, args, kwargs) -> None:
    _foreach_put_back(optimizer, args, kwargs)     # a step that raised did not put them back
    flipped = []
    for group in optimizer.param_groups:
        if _flipped_for_the_step(optimizer, group):
            group["foreach"] = True
            flipped.append(group)
    if flipped:
        setattr(optimizer, _FLIPPED, flipped)
        if not optimizer.__dict__.get(_REPORTS):
            optimizer.register_state_dict_post_hook(_as_left_to_torch)
            setattr(optimizer, _REPORTS, True)


def _tensor_hyperparameters(group: dict) -> bool:
    """A tensor learning rate or betas: Adam's foreach implementation refuses them unless `capturable`
    (eager's loop on the CPU takes them)."""
    return isinstance(group.get("lr"), torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group.get("betas", ()))


def _writes_grads(optimizer, group: dict) -> bool:
    """Whether the group's foreach step writes its parameters' `.grad` in place where eager's per-parameter
    loop on the CPU does not: SGD with Nesterov momentum adds the momentum into the gradients themselves
    (unless `maximize` or a weight decay made them a copy first), so `.grad` read after `step()` would
    differ from eager's. (On CUDA eager takes the foreach path and writes them too, and so does a lazy CUDA
    group left unflipped: torch's default there is foreach.)"""
    return isinstance(optimizer, torch.optim.SGD) and bool(group.get("nesterov")) and \
        group.get("momentum", 0) != 0 and not group.get("maximize") and group.get("weight_decay", 0) == 0


def _foreach_put_back(optimizer, args, kwargs) -> None:
    for group in optimizer.__dict__.pop(_FLIPPED, ()):
        group["foreach"] = None


FOREACH_HOOKS = (_foreach_for_lazy_groups, _foreach_put_back)


_REPORTS = "_pydisc_foreach_reported"   # the optimizer's attribute: `_as_left_to_torch` is registered


def _as_left_to_torch(optimizer, state_dict: dict) -> dict:
    """`state_dict()` between a step that raised (its post-hook did not run) and the next step: the
    groups still set to foreach for that step are saved as the user left them."""
    flipped = optimizer.__dict__.get(_FLIPPED)
    if flipped:
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
            if any(group is g for g in flipped):
                saved["foreach"] = None
    return state_dict
