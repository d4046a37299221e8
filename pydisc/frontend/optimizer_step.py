"""`optimizer.step()` recorded without running torch's step: the entries its step recorded once, again.

An SGD, Adam or AdamW step over lazy parameters runs torch's Python (`_init_group`, the foreach
implementation, the step hooks) and records its foreach ops through the dispatcher, a third of a small
step's recording. Its ops depend on the optimizer's flags and the tensors' layouts alone; only the
Python floats it lifts into scalar inputs (the learning rate, the momentum, Adam's bias corrections)
change from step to step. So, in a step whose forward the fast recorder recorded (frontend/fast.py):

- a `step()` is recorded as before, and the entries it appended to the trace become the optimizer's
  `Template`: each tensor argument named by its role (a parameter, its gradient, a state tensor of it, a
  value an earlier op of the step made), the lifted scalars by their order;
- the template is kept only where `_scalars` (this module's copy of torch's formulas for those floats)
  gives the very floats torch's step lifted, Adam's step counters moved by one, and nothing else happened
  (no read ran the trace, no op ran eagerly on a lazy tensor);
- later `step()`s (`FastStep`, set as the optimizer's `step` attribute, which an LR scheduler's wrapper
  calls through) run pydisc's step hooks, move Adam's step counters as torch does, and append the
  template's entries for the tensors and floats of this step: the trace torch's step would have recorded.
  Plans, the plan cache and dynamic-shape templates see no difference.

A step whose `_config` (the flags, which hyperparameters are zero, the layouts, which parameters have a
gradient) is not the template's runs torch's step, which is captured again. Never taken: a closure, step
hooks that are not pydisc's, `fused`, `capturable`, `differentiable`, a tensor learning rate or betas,
parameters or gradients that are not lazy tensors, optimizer state that is not lazy, a step
recorded with symbolic sizes, a step whose forward was recorded by the dispatcher.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim import optimizer as _optimizer_module

from .. import metrics as _metrics
from ..diagnostics import warn_once
from .foreach import FOREACH_HOOKS, takes_foreach
from .lazy_tensor import RECORDER, LazyTensor
from .source import user_source
from .trace import VALUE_REFS, VALUE_SIGS, Entry, LazyStorage, ScalarRef, ValueRef, out_kind

__all__ = ["install", "FastStep"]

METRICS = _metrics.METRICS
_GRAD = torch.Tensor.grad.__get__
_CAPTURE = "_pydisc_step_capture"       # the optimizer's attribute: a capture under way (begun by the pre-hook)
_TEMPLATES = "_pydisc_step_templates"   # the optimizer's attribute: {config key: its Template, or None (refused)}
_MAX_TEMPLATES = 8      # per optimizer (steps alternating between configs: a parameter with no gradient every other step)
_PRE, _POST = _optimizer_module._global_optimizer_pre_hooks, _optimizer_module._global_optimizer_post_hooks
_installed = False

# the optimizers whose steps are stamped, and which formulas of `_scalars` they take
_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}


def install() -> None:
    """Register the capture's step hooks (after pydisc's foreach hooks: a group's `foreach` is set by then)."""
    global _installed
    if not _installed:
        _optimizer_module.register_optimizer_step_pre_hook(_capture_begin)
        _optimizer_module.register_optimizer_step_post_hook(_capture_end)
        _installed = True


# ---- what a step depends on ---------------------------------------------------------------------------

def _config(opt) -> tuple | None:
    """(key, role tensors, per group (its dict, its parameters with a gradient, Adam's step counters)) of a
    step `opt` would take now, or None where its step is not one this module records. The key holds what
    the recorded ops depend on: flags, which hyperparameters are zero, layouts, who has a gradient."""
    kind = _KINDS.get(type(opt))
    if kind is None:
        return None
    state = opt.state
    key: list = [kind]
    roles: list = []
    groups = []
    for group in opt.param_groups:
        if group.get("fused") or group.get("differentiable") or group.get("capturable") or \
                type(group["lr"]) is not float or not takes_foreach(opt, group):
            return None
        # (dtypes and devices are in the layouts: torch's step groups its tensors by them, and a template
        # is only kept where the floats it lifted were in the order `_scalars` gives)
        params = []
        grads = []
        for p in group["params"]:
            g = _GRAD(p)
            if g is not None:
                if type(p) is not LazyTensor or type(g) is not LazyTensor:
                    return None
                params.append(p)
                grads.append(g)
        has = len(params) if len(params) == len(group["params"]) else tuple(_GRAD(p) is not None
                                                                           for p in group["params"])
        steps = None
        decoupled = False
        if kind == "sgd":
            momentum, dampening, decay = group["momentum"], group["dampening"], group["weight_decay"]
            if any(v != 0 and type(v) is not float for v in (momentum, dampening, decay)):
                return None
            flags = (momentum != 0, dampening != 0, decay != 0, bool(group["nesterov"]), bool(group["maximize"]),
                     type(momentum), type(dampening), type(decay))     # (an int 1 - 0 is recorded as an int)
            names = ("momentum_buffer",) if momentum != 0 else ()
        else:
            beta1, beta2 = group["betas"]
            decay = group["weight_decay"]
            if type(beta1) is not float or type(beta2) is not float or (decay != 0 and type(decay) is not float):
                return None
            decoupled = bool(group.get("decoupled_weight_decay", type(opt) is torch.optim.AdamW))
            flags = (decay != 0, decoupled, bool(group["amsgrad"]), bool(group["maximize"]), group["eps"], type(decay))
            names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
            steps = []
        states = []
        for p in params:
            if not names:
                continue
            s = state.get(p)
            if s is None:
                return None
            for name in names:
                t = s.get(name)
                if type(t) is not LazyTensor:
                    return None
                states.append(t)
            if steps is not None:
                step = s.get("step")
                if type(step) is not torch.Tensor or step.dim() != 0 or step.device.type != "cpu":
                    return None
                steps.append(step)
        key.append((flags, has, tuple([p._mk for p in params]), tuple([g._mk for g in grads]),
                    tuple([t._mk for t in states])))
        roles += params
        roles += grads
        roles += states
        groups.append((group, params, steps, decoupled))
    return tuple(key), roles, groups


def _scalars(kind: str, groups: list) -> list | None:
    """The Python floats torch's foreach step lifts into scalar inputs, in the order it lifts them, as
    `_multi_tensor_sgd` and `_multi_tensor_adam` compute them (Adam's from its step counters, already
    moved); None where one of them is a value whose op records differently (0, 1 or -1: `add(x, y,
    alpha=1)` lifts nothing)."""
    out: list = []
    for group, params, steps, decoupled in groups:
        if not params:
            continue
        lr = group["lr"]
        if kind == "sgd":
            momentum, dampening, decay = group["momentum"], group["dampening"], group["weight_decay"]
            if decay != 0:
                out.append(decay)
            if momentum != 0:
                out.append(momentum)
                if dampening != 0:
                    out.append(1 - dampening)
                if group["nesterov"]:
                    out.append(momentum)
            out.append(-lr)
        else:
            beta1, beta2 = group["betas"]
            decay = group["weight_decay"]
            if decay != 0:
                out.append(1 - lr * decay if decoupled else decay)
            out += (1 - beta1, beta2, 1 - beta2)
            counts = torch.stack(steps).tolist()
            out += [(1 - beta2 ** n) ** 0.5 for n in counts]
            out += [(lr / (1 - beta1 ** n)) * -1 for n in counts]
    for v in out:
        if v == 0 or v == 1 or v == -1:
            return None
    return out


def _pydisc_hooks_only(opt) -> bool:
    for hooks in (_PRE, _POST):
        for hook in hooks.values():
            if not getattr(hook, "__module__", "").startswith("pydisc."):
                return False
    return not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def _recordable() -> bool:
    """The pending step is one whose optimizer step may be stamped: its forward was recorded fast, with
    concrete sizes."""
    rec = RECORDER
    return rec.trace.fused > 0 and rec.symbolic is None and rec.carried_dims is None and not rec.passthrough


# ---- capture --------------------------------------------------------------------------------------------

def _capture_begin(opt, args, kwargs) -> None:
    opt.__dict__.pop(_CAPTURE, None)    # (of a step that raised: its post-hook did not run)
    try:
        _begin(opt, args, kwargs)
    except Exception as exc:     # noqa: BLE001 - pydisc's failure: torch's step goes on
        _failed(exc)


def _failed(exc: Exception) -> None:
    """Recording an optimizer step from a template failed inside pydisc: counted, warned once; torch's
    step runs (and ran) as it would without pydisc."""
    METRICS.compile_failures["optimizer template: " + type(exc).__name__] += 1
    warn_once("optimizer template " + type(exc).__name__,
              "pydisc: recording an optimizer step from its template failed (%s: %s); torch's step runs instead. "
              "Please report this." % (type(exc).__name__, exc))


def _begin(opt, args, kwargs) -> None:
    if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
        return      # a closure: the forward runs inside the step
    if type(opt) not in _KINDS or not _recordable() or not _pydisc_hooks_only(opt):
        return
    config = _config(opt)
    if config is None:
        return
    key, roles, groups = config
    templates = opt.__dict__.get(_TEMPLATES)
    if templates is not None and (key in templates or len(templates) >= _MAX_TEMPLATES):
        return      # (refused for this key, or stamped: a step that got here is torch's by choice)
    rec = RECORDER
    trace = rec.trace
    counts = [torch.stack(steps).tolist() if steps else [] for _, _, steps, _ in groups]
    opt.__dict__[_CAPTURE] = (config, trace, trace.epoch, len(trace.entries), len(trace.scalars), len(trace.values),
                              METRICS.materializations, sum(METRICS.fallback_ops.values()), counts)


def _capture_end(opt, args, kwargs) -> None:
    capture = opt.__dict__.pop(_CAPTURE, None)
    if capture is None:
        return
    try:
        template = _template(opt, capture)
    except _NotATemplate:
        template = None
    except Exception as exc:     # noqa: BLE001 - pydisc's failure: torch's steps go on
        _failed(exc)
        template = None
    opt.__dict__.setdefault(_TEMPLATES, {})[capture[0][0]] = template
    if template is not None:
        METRICS.optimizer_templates += 1
        if not isinstance(opt.__dict__.get("step"), FastStep):
            opt.__dict__["step"] = FastStep(opt, opt.__dict__.get("step"))


class _NotATemplate(Exception):
    pass


def _check(ok: bool) -> None:
    if not ok:
        raise _NotATemplate


def _template(opt, capture) -> Template:
    (_, roles, groups), trace, epoch, n0, s0, v0, reads, fallbacks, counts = capture
    _check(RECORDER.trace is trace and trace.epoch == epoch and len(trace.entries) > n0 and
           METRICS.materializations == reads and sum(METRICS.fallback_ops.values()) == fallbacks)
    # The config of the step's beginning (pydisc's post-hook has put the groups' `foreach` back by now):
    # the step wrote its state tensors in place, so they are still the ones named there.
    named = {id(t) for t in roles}
    for _, params, _, _ in groups:
        for p in params:
            _check(all(id(t) in named for t in opt.state.get(p, {}).values() if type(t) is LazyTensor))
    for (_, _, steps, _), before in zip(groups, counts):
        if steps:
            _check(torch.stack(steps).tolist() == [n + 1 for n in before])
    scalars = _scalars(_KINDS[type(opt)], groups)
    _check(scalars is not None and trace.scalars[s0:] == [float(v) for v in scalars])
    slot_of: dict[int, int] = {}            # value id -> slot: the role tensors', then the values the step made
    storage_slot: dict[int, int] = {}       # id(storage) -> the slot of the value that owns it
    for i, t in enumerate(roles):
        _check(t._epoch == epoch and t._vid not in slot_of and id(t._storage) not in storage_slot)
        slot_of[t._vid] = i
        storage_slot[id(t._storage)] = i
    temps: list[tuple] = []     # (meta, nbytes) per value the step made, slot len(roles) + k

    def encode(a, slots: list):
        t = type(a)
        if t is ValueRef:
            s = slot_of.get(a.vid)
            _check(s is not None)
            slots.append(s)
            return _Slot(s)
        if t is ScalarRef:
            _check(s0 <= a.index < len(trace.scalars))
            return _Scalar(a.index - s0)
        if t is list:
            if a and all(type(x) is ValueRef for x in a):
                got = tuple(slot_of.get(x.vid) for x in a)
                _check(None not in got)
                slots.extend(got)
                return _Slots(got)
            return [encode(x, slots) for x in a]
        _check(t in (int, float, bool, str, type(None), torch.dtype, torch.device))
        return a

    entries = []
    named: set = set()          # role slots an earlier entry named
    for index in range(n0, len(trace.entries)):
        e = trace.entries[index]
        slots: list = []
        args = [encode(a, slots) for a in e.args]
        kwargs = {k: encode(v, slots) for k, v in e.kwargs.items()}
        # the role tensors this entry names first, in its arguments' order: a tensor the trace does not
        # hold yet becomes its input there, and gets its value id, as where the dispatcher records the op
        first = []
        for slot in slots:
            if slot < len(roles) and slot not in named:
                named.add(slot)
                first.append(slot)
        # the signature with its value parts as slots (in the order the arguments named them)
        values = [k for k, part in enumerate(e.sig) if type(part) is tuple and len(part) == 2 and part[0] == "v"]
        _check(len(values) == len(slots) == len(e.reads))
        sig = list(e.sig)
        for k, slot in zip(values, slots):
            sig[k] = _Slot(slot)
        sig = tuple(sig)
        writes = tuple(storage_slot.get(id(storage), -1) for storage in e.writes)
        _check(-1 not in writes)
        outs = []
        for vid in e.out_vids:
            if vid is None or vid in slot_of:
                outs.append(None if vid is None else slot_of[vid])
                continue
            storage = trace.storages[vid]
            _check(vid >= v0 and trace.values[vid] == out_kind(index) and storage.creator == vid)
            slot_of[vid] = len(roles) + len(temps)
            storage_slot[id(storage)] = slot_of[vid]
            temps.append((trace.metas[vid], storage.nbytes))
            outs.append(slot_of[vid])
        entries.append((e.fn, args, kwargs, tuple(outs), e.out_kind, sig, tuple(slots), writes, tuple(first)))
    return Template(tuple(entries), len(roles), tuple(temps), len(scalars))


class _Slot:
    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class _Slots:
    __slots__ = ("slots",)

    def __init__(self, slots: tuple) -> None:
        self.slots = slots


class _Scalar:
    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k


def _decode(a, vids: list, scalars: list):
    t = type(a)
    if t is _Slots:
        return [VALUE_REFS[vids[s]] for s in a.slots]
    if t is _Slot:
        return VALUE_REFS[vids[a.slot]]
    if t is _Scalar:
        return scalars[a.k]
    if t is list:
        return [_decode(x, vids, scalars) for x in a]
    return a


class Template:
    """The entries one optimizer step recorded, with their tensors as slots (the role tensors of
    `_config`, then the values the step made) and their lifted scalars by order."""

    __slots__ = ("entries", "n_roles", "temps", "n_scalars")

    def __init__(self, entries: tuple, n_roles: int, temps: tuple, n_scalars: int) -> None:
        self.entries = entries
        self.n_roles = n_roles
        self.temps = temps
        self.n_scalars = n_scalars

    def stamp(self, roles: list, scalars: list) -> None:
        """Append the entries for `roles` (this step's tensors, `_config`) and `scalars` (its floats) to the
        pending trace, as the dispatcher records them (`Recorder._record`). The role tensors must be
        current (`_current`)."""
        rec = RECORDER
        trace = rec.trace
        epoch = trace.epoch
        vids = [-1] * (len(roles) + len(self.temps))
        storages = [t._storage for t in roles] + [None] * len(self.temps)
        refs = [ScalarRef(len(trace.scalars) + k) for k in range(len(scalars))]
        step = rec.step_id
        source = user_source(3) if rec.capture_sources else None
        n_roles = self.n_roles
        entries = []
        written = []
        for k, (fn, args, kwargs, outs, kind_of_out, sig, reads, writes, first) in enumerate(self.entries):
            index = len(trace.entries) + k
            for s in first:
                t = roles[s]
                vids[s] = t._vid if t._epoch == epoch else rec.ref(t).vid
            out_vids = []
            for s in outs:
                if s is not None and s >= n_roles and vids[s] < 0:
                    meta, nbytes = self.temps[s - n_roles]
                    storage = LazyStorage(nbytes, None, epoch, step)
                    vids[s] = trace.new_value(out_kind(index), storage, meta)
                    storage.creator = vids[s]
                    storages[s] = storage
                out_vids.append(None if s is None else vids[s])
            written += [storages[s] for s in writes]
            entries.append(Entry(
                fn, [_decode(a, vids, refs) for a in args], {k: _decode(v, vids, refs) for k, v in kwargs.items()},
                tuple(out_vids), kind_of_out, tuple(storages[s] for s in reads),
                tuple(storages[s] for s in writes),
                tuple([VALUE_SIGS[vids[p.slot]] if type(p) is _Slot else p for p in sig]), source))
        # (all at once: a step that failed above has added nothing a plan reads, but inputs and values
        # that no entry names)
        trace.scalars += [float(v) for v in scalars]
        trace.entries += entries
        for storage in written:
            storage.written = True
        METRICS.recorded_ops += len(self.entries)
        METRICS.optimizer_steps_stamped += 1
        if len(trace.entries) >= rec.prune_at and rec.pruner is not None:
            rec.pruner()


def _current(roles: list) -> bool:
    """Whether every role tensor holds a value of the pending trace or device data (where the dispatcher
    would raise, reading a result of an abandoned step, torch's step runs and raises)."""
    epoch = RECORDER.trace.epoch
    for t in roles:
        if t._epoch != epoch and (t._real is None or t._fid is not None or t._redirect is not None):
            return False
    return True


class FastStep:
    """An optimizer's `step` while it has a template: stamps it where the step's config is the template's,
    else calls the step the optimizer had (torch's, or an LR scheduler's wrapper of it), which captures
    again. Marked as an LR scheduler's wrapper is (`_wrapped_by_lr_sched`), and notes the call as that
    wrapper does (`_opt_called`), so a scheduler made before or after it warns of nothing."""

    _wrapped_by_lr_sched = True

    def __init__(self, opt, previous) -> None:
        self.opt = weakref.ref(opt)
        self.previous = previous

    def __call__(self, closure=None):
        opt = self.opt()
        if opt is None:
            raise ReferenceError("pydisc: step() of an optimizer that no longer exists")
        opt._opt_called = True
        if closure is None and self.stamped(opt):
            return None
        if self.previous is not None:
            return self.previous(closure)
        return type(opt).step(opt, closure)

    def stamped(self, opt) -> bool:
        templates = opt.__dict__.get(_TEMPLATES)
        if not templates or not _recordable() or not _pydisc_hooks_only(opt):
            return False
        for hook in _PRE.values():
            if hook is not _capture_begin and hook not in FOREACH_HOOKS:
                hook(opt, (opt,), {})     # (pydisc's: the notes that put Adam's counters back if the step fails)
        try:
            with RECORDER.lock:
                config = _config(opt)
                template = templates.get(config[0]) if config is not None else None
                if template is None:
                    return False
                _, roles, groups = config
                kind = _KINDS[type(opt)]
                if not _current(roles):
                    return False
                steps = [t for _, _, group_steps, _ in groups if group_steps for t in group_steps]
                if steps:
                    torch._foreach_add_(steps, 1.0)     # Adam's counters, as its step moves them
                try:
                    scalars = _scalars(kind, groups)
                    if scalars is None or len(scalars) != template.n_scalars:
                        scalars = None
                    else:
                        template.stamp(roles, scalars)
                except Exception as exc:     # noqa: BLE001 - pydisc's failure: torch's step runs instead
                    _failed(exc)
                    scalars = None
                if scalars is None:
                    if steps:
                        torch._foreach_sub_(steps, 1.0)
                    return False
            return True
        finally:
            for hook in _POST.values():
                if hook is not _capture_end and hook not in FOREACH_HOOKS:
                    hook(opt, (opt,), {})
