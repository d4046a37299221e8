"""`python -m pydisc.explain OP [OP ...] [--device cpu|cuda]`: which route an ATen op takes in a step
on a device, and why: run while recording, decomposed, run by torch's libraries between the clusters,
compiled (a StableHLO rule, or the torch-mlir route), or run in torch as a counted fallback.

It reads the tables that decide (frontend/policy.py, the decomposition table, the lowering registry)
under the current settings, so `PYDISC_GPU_MATMUL=iree python -m pydisc.explain aten.mm --device cuda`
answers for that setting. What depends on one node of a graph (its dtypes, a dynamic dim a rule
cannot take, a scatter the partitioner sees is one element per row) is named, not decided.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch
from torch._ops import OpOverload, OpOverloadPacket

from .config import CONFIG
from .frontend import lowering  # noqa: F401  (registers the StableHLO rules)
from .frontend.decompositions import decompositions_for
from .frontend.lowering.registry import DYNAMIC_RULES, LOWERINGS, SUPPORT_CHECKS
from .frontend.lowering.values import ELEMENT_TYPES
from .frontend.policy import TORCH_MLIR_WRONG_VALUES, rules_for
from .frontend.torch_mlir import importer_available

__all__ = ["Route", "explain", "main", "resolve"]


@dataclass
class Route:
    op: str
    device: str
    route: str              # read, eager, split, decomposed, library, compiled, torch-mlir, fallback
    why: str
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = ["%s on %s: %s: %s" % (self.op, self.device, self.route, self.why)]
        lines += ["  - " + note for note in self.notes]
        return "\n".join(lines)


def resolve(name: str | OpOverload | OpOverloadPacket) -> list[OpOverload]:
    """The overloads `name` means: an OpOverload; "aten.mm.default", "aten.mm" or "mm" (a packet
    means its overloads that tensors dispatch to, but the `out=` variants)."""
    if isinstance(name, OpOverload):
        return [name]
    packet = name
    if isinstance(name, str):
        parts = name.split(".")
        namespace, parts = (parts[0], parts[1:]) if len(parts) > 1 and parts[0] in ("aten", "prims") else \
            ("aten", parts)
        try:
            packet = getattr(getattr(torch.ops, namespace), parts[0])
            if len(parts) > 1:
                return [getattr(packet, parts[1])]
        except (AttributeError, RuntimeError):
            raise ValueError("%r is not an ATen op: write it as torch names it, e.g. aten.mm.default or "
                             "aten.add.Tensor" % name) from None
    if not isinstance(packet, OpOverloadPacket):
        raise ValueError("%r is not an ATen op or op name" % (name,))
    ops = [getattr(packet, n) for n in packet.overloads()]
    ops = [op for op in ops if torch._C._dispatch_has_kernel(op.name())]   # (not TorchScript's int/str ones)
    return [op for op in ops if not op._overloadname.endswith("out")] or ops


def explain(op: str | OpOverload, device: str | torch.device = "cpu") -> Route:
    """The route `op` (one overload) takes in a step on `device` under the current settings."""
    ops = resolve(op)
    if len(ops) != 1:
        raise ValueError("%s has several overloads (%s): name one" % (op, ", ".join(o._overloadname for o in ops)))
    op, device = ops[0], torch.device(device)
    route = _route(op, device)
    route.notes += [rule.why for rule in rules_for(op, device) if rule.route in ("free", "not-torch-mlir")]
    return route


def _route(op: OpOverload, device: torch.device) -> Route:
    def route(kind: str, why: str, notes: list[str] | None = None) -> Route:
        return Route(str(op), device.type, kind, why, notes or [])

    rules = rules_for(op, device)
    for rule in rules:
        if rule.route in ("read", "eager"):
            return route(rule.route, rule.why)
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return route("split", "torch's dispatcher splits it into the ops it is made of; explain those")
    functional = _functional(op)
    if functional is not None:
        inner = _route(functional, device)
        inner.op = str(op)
        inner.notes.insert(0, "in place: functionalization records it as %s, whose route this is" % functional)
        return inner
    decomposed = op in decompositions_for(device)
    library = [rule for rule in rules if rule.route == "library"]
    if library and not decomposed:
        return route("library", library[0].why)
    if decomposed:
        return route("decomposed", "torch's decomposition replaces it when the step's graph is made; the ops it "
                     "becomes take their own routes", ["kept whole if the decomposition's result differs from the "
                                                       "op's meta function at trace time"])
    if op in LOWERINGS:
        rule = LOWERINGS[op]
        notes = ["dynamic dims: %s" % ("yes" if op in DYNAMIC_RULES else "no (a step with dynamic dims runs it in torch)")]
        check = SUPPORT_CHECKS.get(op)
        if check is not None:
            doc = (getattr(check, "func", check).__doc__ or "").strip()
            notes.append("limits checked per node (%s)%s" % (_qualname(check), ": " + doc.splitlines()[0] if doc else ""))
        notes.append("dtypes compiled: %s" % ", ".join(str(t).replace("torch.", "") for t in ELEMENT_TYPES))
        return route("compiled", "StableHLO rule %s" % _qualname(rule), notes)
    missing = importer_available()
    if not CONFIG.torch_mlir or missing is not None or op in TORCH_MLIR_WRONG_VALUES or op._schema.is_mutable:
        why = "no StableHLO rule or decomposition"
        if CONFIG.torch_mlir and missing is not None:
            why += "; the torch-mlir route is unavailable (%s)" % missing
        elif not CONFIG.torch_mlir:
            why += "; the torch-mlir route is off (PYDISC_TORCH_MLIR=0)"
        return route("fallback", why + ": runs in torch, counted in metrics()['fallback_ops']")
    return route("torch-mlir", "no StableHLO rule or decomposition: the torch-mlir route compiles it where it can "
                 "(static shapes); what it rejects runs in torch, counted as a fallback")


def _qualname(fn) -> str:
    fn = getattr(fn, "func", fn)     # (a functools.partial)
    return "%s.%s" % (getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn)))


def _functional(op: OpOverload) -> OpOverload | None:
    """The out-of-place op an in-place one (`add_`) becomes under functionalization, if there is one."""
    if not (op._schema.is_mutable and op._opname.endswith("_")):
        return None
    packet = getattr(torch.ops.aten, op._opname[:-1], None)
    functional = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(functional, OpOverload) or not torch._C._dispatch_has_kernel(functional.name()):
        return None
    return functional


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydisc.explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="+", help="ATen ops: aten.mm.default, aten.add.Tensor, aten.softmax, mm")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    try:
        for name in args.ops:
            for op in resolve(name):
                print(explain(op, args.device))
    except ValueError as error:
        print("error:", error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
