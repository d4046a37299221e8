"""Values eager refuses: indices out of range and integers divided by zero, inside compiled steps.

Eager PyTorch raises where an index is out of range (`gather`, `index`, `embedding`, the targets of
`cross_entropy`, scatters, `index_put`) or, on the CPU, an integer is divided by zero (`//`, `%`,
`fmod`). Compiled, those ops do not raise, and IREE's code does not bound its indices: an index far out
of range read or wrote memory outside the tensor (a segmentation fault on the CPU), and a division by
zero returned made-up values.

`guard_values` rewrites the functional graph before partitioning:
- every index an op reads is clamped into the range eager accepts (one `clamp` that fuses into the
  cluster of the op; values in range are unchanged), on every device: compiled code never reaches
  outside a tensor;
- with `flag=True` (the CPU by default, `PYDISC_VALUE_CHECKS`), the graph also returns one boolean:
  whether any index was out of range or any integer divisor zero. Reading it at the step's end costs
  no synchronisation on the CPU. When it is set, the step's results are not bound: the step runs again
  eagerly, where the op raises eager's own exception and message (pydisc/driver/step.py), and parameters and
  optimizer state keep their values. On CUDA reading it would synchronise every step, so by default a
  compiled step there computes with the clamped indices where CUDA eager stops at a device-side assert
  (docs/robustness.md).
Indices along dims whose size is symbolic (a dynamic-shape plan) are neither clamped nor checked.
"""
from __future__ import annotations

import torch

from .fx_edit import new_node

__all__ = ["guard_values"]

aten = torch.ops.aten


def _dim_size(tensor: torch.fx.Node, dim: int) -> int | None:
    val = tensor.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    size = val.shape[dim % val.dim()] if val.dim() else 1
    return size if type(size) is int else None     # symbolic sizes: not checked (docs/robustness.md)


def _dtype(x) -> torch.dtype | None:
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is_index(x) -> bool:
    """An index tensor (int64 or int32; a uint8 or bool index of `x[idx]` is a mask, not checked here)."""
    return _dtype(x) in (torch.int64, torch.int32)


def _bounds_of(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int, int]]:
    """(index tensor, lowest allowed, highest allowed + 1) for each index `node` reads; [] if none."""
    t, args = node.target, node.args
    if t in _DIM_INDEX_OPS:            # (self, dim, index, ...): indices in [0, size)
        self, dim, index = args[0], args[1], args[2]
        size = _dim_size(self, dim)
        return [(index, 0, size)] if size is not None and _is_index(index) else []
    if t is aten.embedding.default:    # (weight, indices, ...)
        size = _dim_size(args[0], 0)
        return [(args[1], 0, size)] if size is not None and _is_index(args[1]) else []
    if t in _INDEX_LIST_OPS:           # (self, [index or None per dim], ...): indices in [-size, size)
        out = []
        for dim, index in enumerate(args[1]):
            size = _dim_size(args[0], dim) if index is not None else None
            if size is not None and _is_index(index):
                out.append((index, -size, size))
        return out
    return []


def _divisor_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The integer divisor tensor of an integer division that eager refuses at zero, or None."""
    if node.target not in _INTEGER_DIVISIONS or len(node.args) < 2:
        return None
    if node.target is aten.div.Tensor_mode and node.kwargs.get("rounding_mode") is None:
        return None                    # true division: a float result
    divisor, result = node.args[1], _dtype(node)
    integer = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    return divisor if _dtype(divisor) in integer and result in integer else None


_DIM_INDEX_OPS = {
    aten.gather.default, aten.index_select.default, aten.index_add.default, aten.index_copy.default,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_add.default, aten.scatter_reduce.two,
}
_INDEX_LIST_OPS = {aten.index.Tensor, aten.index_put.default}
_INTEGER_DIVISIONS = {aten.div.Tensor_mode, aten.remainder.Tensor, aten.fmod.Tensor, aten.floor_divide.default}


def guard_values(gm: torch.fx.GraphModule, flag: bool) -> bool:
    """Clamp every index of `gm` into its range (in place); with `flag`, also append to `gm`'s outputs
    one 0-d bool, whether an index was out of range or an integer divisor zero. Returns whether the
    flag was added (the graph has such ops, with sizes known)."""
    graph = gm.graph
    flags: list[torch.fx.Node] = []
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        bounds = _bounds_of(node)
        divisor = _divisor_of(node) if flag else None
        if not bounds and divisor is None:
            continue
        with graph.inserting_before(node):
            clamped = {}
            for index, low, high in bounds:
                if flag:
                    below = new_node(graph, aten.lt.Scalar, (index, low), {}, node)
                    above = new_node(graph, aten.ge.Scalar, (index, high), {}, node)
                    outside = new_node(graph, aten.logical_or.default, (below, above), {}, node)
                    flags.append(_any(graph, outside, node))
                clamped[index] = new_node(graph, aten.clamp.default, (index, low, high - 1), {}, node)
            if divisor is not None:
                zero = new_node(graph, aten.eq.Scalar, (divisor, 0), {}, node)
                flags.append(_any(graph, zero, node))
        if clamped:
            node.args = _with_indices(node, clamped)
            changed = True
    if flags:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            flag_node = flags[0]
            for other in flags[1:]:
                flag_node = new_node(graph, aten.logical_or.default, (flag_node, other), {}, other)
        output.args = ([*output.args[0], flag_node],)
    if flags or changed:
        graph.lint()
        gm.recompile()
    return bool(flags)


def _any(graph: torch.fx.Graph, mask: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """Whether any element of `mask` is set: the trailing dims first, then the first. IREE 3.13's
    llvm-cpu code for one reduce of a (2, ?) tensor to a scalar asked for a stack allocation of 2**54
    bytes and failed to compile (BERT's ids with a dynamic length)."""
    rank = mask.meta["val"].dim()
    if rank > 1:
        mask = new_node(graph, aten.any.dims, (mask, list(range(1, rank))), {}, like)
    return new_node(graph, aten.any.default, (mask,), {}, like)


def _with_indices(node: torch.fx.Node, clamped: dict) -> tuple:
    args = list(node.args)
    if node.target in _DIM_INDEX_OPS:
        args[2] = clamped.get(args[2], args[2])
    elif node.target is aten.embedding.default:
        args[1] = clamped.get(args[1], args[1])
    else:
        args[1] = [clamped.get(i, i) if i is not None else None for i in args[1]]
    return tuple(args)
