"""Emit one partitioned cluster (an FX GraphModule of core ATen ops) as a StableHLO MLIR module.

The module has a single public function: the cluster inputs in placeholder order, then one argument
per result marked `{iree.abi.output = N : index}`, so that IREE writes result N into a tensor that
torch allocated from `EmittedCluster.outputs`. Shapes and dtypes come from `node.meta["val"]`.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.fx.node import map_arg

from pydisc.frontend.lowering import LOWERINGS, FunctionBuilder, LoweringContext, LoweringError, TensorSpec, Value
from pydisc.frontend.lowering.builder import ELEMENT_TYPES
from pydisc.frontend.lowering.registry import SUPPORT_CHECKS, spec_of

__all__ = ["EmittedCluster", "LoweringError", "TensorSpec", "emit_cluster", "unsupported_reason"]


@dataclass(frozen=True)
class EmittedCluster:
    text: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    ops: tuple[str, ...]  # ATen op of each lowered node, in emission order


def _tensors(val: object) -> Iterable[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from _tensors(v)


def _dtype_reason(val: object) -> str | None:
    for t in _tensors(val):
        if t.dtype not in ELEMENT_TYPES:
            return f"dtype {t.dtype} is not supported"
        if any(not isinstance(d, int) for d in t.shape):
            return "dynamic shapes are not supported yet"
    return None


# Constants captured by tracing (torch.tensor(...) in user code) are inlined into the MLIR text.
_MAX_CONSTANT_ELEMENTS = 1024


def _constant(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor:
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    if not isinstance(value, torch.Tensor) or value.dtype not in ELEMENT_TYPES:
        raise LoweringError("get_attr", f"{node.target} is not a supported tensor constant")
    if value.numel() > _MAX_CONSTANT_ELEMENTS:
        raise LoweringError("get_attr", f"constant {node.target} is too large to inline ({value.numel()} elements)")
    return value.detach().cpu()


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """None if `emit_cluster` can lower `node`, else a short reason (a pure predicate)."""
    if node.op == "get_attr":
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > _MAX_CONSTANT_ELEMENTS:
            return "constant too large to inline"
        return _dtype_reason(val)
    if node.op in ("placeholder", "output"):
        return _dtype_reason(node.meta.get("val")) if node.op == "placeholder" else None
    if node.op != "call_function":
        return f"{node.op} nodes are not supported"
    if node.target is operator.getitem:  # an unused result (None) of a multi-output op has no val
        return _dtype_reason(node.meta.get("val"))
    if "val" not in node.meta:
        return "node has no recorded metadata"
    if node.target not in LOWERINGS:
        return f"no lowering rule for {node.target}"
    for value in [node.meta["val"], *(n.meta.get("val") for n in node.all_input_nodes)]:
        reason = _dtype_reason(value)
        if reason is not None:
            return reason
    check = SUPPORT_CHECKS.get(node.target)
    return check(node) if check is not None else None


def _specs(val: object) -> tuple[TensorSpec | None, ...]:
    if isinstance(val, (list, tuple)):
        return tuple(spec_of(v) if isinstance(v, torch.Tensor) else None for v in val)
    return (spec_of(val),)


def _lower_node(builder: FunctionBuilder, node: torch.fx.Node, env: dict[torch.fx.Node, object]) -> object:
    reason = unsupported_reason(node)
    if reason is not None:
        raise LoweringError(node.target, reason)
    if node.target is operator.getitem:
        source, index = node.args
        return env[source][index]  # type: ignore[index]
    out = _specs(node.meta["val"])
    ctx = LoweringContext(builder, node, out)  # type: ignore[arg-type]
    args = map_arg(node.args, lambda n: env[n])
    kwargs = map_arg(node.kwargs, lambda n: env[n])
    builder.line(f"// {node.target}  ({node.name})")
    try:
        result = LOWERINGS[node.target](ctx, *args, **kwargs)
    except LoweringError:
        raise
    except Exception as error:  # a rule that cannot handle its arguments is a lowering failure
        raise LoweringError(node.target, f"{type(error).__name__}: {error}") from error
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(out):
        raise LoweringError(node.target, f"rule returned {len(results)} results, expected {len(out)}")
    for value, spec in zip(results, out):
        if spec is not None and (not isinstance(value, Value) or value.type != spec):
            got = value.type if isinstance(value, Value) else value
            raise LoweringError(node.target, f"rule produced {got}, metadata says {spec}")
    return result


def emit_cluster(gm: torch.fx.GraphModule, *, func_name: str = "main") -> EmittedCluster:
    builder = FunctionBuilder()
    env: dict[torch.fx.Node, object] = {}
    inputs: list[Value] = []
    ops: list[str] = []
    results: list[Value] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            reason = unsupported_reason(node)
            if reason is not None:
                raise LoweringError("placeholder", f"{node.name}: {reason}")
            value = Value(f"%arg{len(inputs)}", spec_of(node.meta["val"]))
            inputs.append(value)
            env[node] = value
        elif node.op == "call_function":
            env[node] = _lower_node(builder, node, env)
            if node.target is not operator.getitem:
                ops.append(str(node.target))
        elif node.op == "get_attr":
            constant = _constant(gm, node)
            env[node] = builder.literal(constant)
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            for out in outs:
                value = env.get(out) if isinstance(out, torch.fx.Node) else None
                if not isinstance(value, Value):
                    raise LoweringError("output", f"cluster output {out!r} is not a tensor")
                results.append(value)
        else:
            raise LoweringError(node.op, f"unsupported FX node kind {node.op}")

    params = [f"{v.name}: {v.type}" for v in inputs]
    params += [f"%out{i}: {r.type} {{iree.abi.output = {i} : index}}" for i, r in enumerate(results)]
    result_types = ", ".join(str(r.type) for r in results)
    lines = [
        f"func.func @{func_name}({', '.join(params)}) -> ({result_types}) {{",
        *builder.lines,
        "    return" + (f" {', '.join(r.name for r in results)} : {result_types}" if results else ""),
        "}",
    ]
    return EmittedCluster(
        text="module {\n" + "\n".join("  " + line for line in lines) + "\n}\n",
        inputs=tuple(v.type for v in inputs),
        outputs=tuple(r.type for r in results),
        ops=tuple(ops),
    )
