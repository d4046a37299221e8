"""The second lowering route: regions of ATen ops with no StableHLO rule, imported by torch-mlir.

torch-mlir's FX importer and its `torch` dialect ship inside iree-base-compiler
(`iree.compiler.extras.fx_importer`), and IREE compiles that dialect with `input_type="torch"`. After
the StableHLO clusters are formed, the partitioner groups the nodes left over that this route can take
(`torch_mlir_reason`) into convex regions; `import_region` turns one region (an FX GraphModule whose
nodes carry make_fx's `meta["val"]`) into a module with the clusters' calling convention:

    func.func @main(%arg0: !torch.vtensor<...>, ..., %out0: !torch.tensor<...>, ...)

Each result of the imported function is written into a mutable `!torch.tensor` argument
(`torch.overwrite.tensor.contents`), which IREE turns into a write into the caller's buffer: torch
allocates the outputs, as for a StableHLO cluster, and `CompiledCluster` runs either kind.

Static shapes only: a region with a symbolic dim stays eager. Ops whose values cannot match eager
(random ops: another generator), whose output shapes depend on data, that mutate, or that take or give
non-tensor values (an `.item()`, a SymInt) stay eager too.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch

from pydisc.frontend.lowering.registry import LoweringError, spec_of
from pydisc.frontend.lowering.values import TensorSpec
from pydisc.frontend.policy import TORCH_MLIR_WRONG_VALUES

__all__ = ["ImportedRegion", "import_region", "importer_available", "note_rejection", "op_key", "torch_mlir_reason"]

# dtypes the route takes (torch-mlir knows more: complex, float8; IREE's CPU and CUDA backends do not
# all handle those, and pydisc's exchange with IREE is tested for these).
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8, torch.bool})

# Tags of ops whose results cannot be compared with eager or whose shapes depend on the data.
_EXCLUDED_TAGS = {
    torch.Tag.nondeterministic_seeded: "random op (IREE's values would not follow torch's generator)",
    torch.Tag.data_dependent_output: "output depends on tensor data read on the host",
    torch.Tag.dynamic_output_shape: "output shape depends on the data",
}

aten = torch.ops.aten

# Ops ("aten.name") that torch-mlir has no definition of, or IREE's torch input conversion no lowering
# for, learned from failed regions (`note_rejection`): later regions leave them out, so that one such
# op does not keep the ops around it eager.
_REJECTED: set[str] = set()
_REJECTED_OP = re.compile(r"failed to legalize operation '?\"?torch\.(aten|prims)\.(\w+)")
_UNDEFINED_OP = re.compile(r"torch\.(aten|prims)\.(\w+)")

_IMPORT_ERROR: str | None = None
try:
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter
except Exception as error:  # noqa: BLE001 - any import failure only turns the route off
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"


def importer_available() -> str | None:
    """None if torch-mlir's FX importer can be used here, else why not."""
    return _IMPORT_ERROR


@dataclass(frozen=True)
class ImportedRegion:
    """A region as `torch` dialect text, with what the executor needs (as `EmittedCluster`)."""

    text: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    ops: tuple[str, ...]
    input_type: str = "torch"

    @property
    def dynamic(self) -> bool:
        return False  # static shapes only


def _tensor_values(val: object) -> list | None:
    """The tensors of a node's value, or None if it is (or holds) anything else."""
    vals = val if isinstance(val, (tuple, list)) else (val,)
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    return list(vals)


def _value_reason(val: object) -> str | None:
    tensors = _tensor_values(val)
    if tensors is None:
        return f"a {type(val).__name__} value (the route takes tensors only)"
    for t in tensors:
        if t.dtype not in DTYPES:
            return f"dtype {t.dtype}"
        if t.layout != torch.strided:
            return f"layout {t.layout}"
        if not all(isinstance(d, int) for d in t.shape):
            return "dynamic shape (the torch-mlir route compiles static shapes)"
    return None


def _mask_index(node: torch.fx.Node) -> bool:
    """Whether an `aten.index.Tensor` takes a boolean mask (a data-dependent shape); integer indices
    give a static shape, which the route takes."""
    return any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype in (torch.bool, torch.uint8)
               for n in node.all_input_nodes[1:])


def _returns_alias(op: object) -> bool:
    return isinstance(op, torch._ops.OpOverload) and any(r.alias_info is not None for r in op._schema.returns)


def _written_through(node: torch.fx.Node) -> bool:
    """Whether an op mutates `node`'s value, directly or through views of it: the functional graph
    keeps a few writes into views (`prims.copy_to(diagonal(x), g)` in diagonal's backward), which rely
    on the view aliasing its base, and a region's outputs are fresh tensors."""
    stack, seen = [node], set()
    while stack:
        for user in stack.pop().users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
                return True
            if user.target is operator.getitem or _returns_alias(user.target):
                stack.append(user)
    return False


def op_key(op: object) -> str | None:
    """"aten.name" of an ATen overload (torch-mlir's op names drop the overload)."""
    return op._schema.name.replace("::", ".") if isinstance(op, torch._ops.OpOverload) else None


def note_rejection(error: Exception) -> str | None:
    """The op a region failed on ("aten.name"), from IREE's "failed to legalize operation 'torch.aten...'"
    or the importer's undefined op, remembered for later regions; None if the error names none."""
    text = str(getattr(error, "diagnostics", None) or error)
    match = _REJECTED_OP.search(text)
    if match is None and isinstance(error, LoweringError) and isinstance(error.op, str):
        match = _UNDEFINED_OP.match(error.op)
    if match is None:
        return None
    key = f"{match.group(1)}.{match.group(2)}"
    _REJECTED.add(key)
    return key


def torch_mlir_reason(node: torch.fx.Node) -> str | None:
    """None if the torch-mlir route may take `node`, else a short reason (a pure predicate)."""
    if _IMPORT_ERROR is not None:
        return "torch-mlir importer unavailable (" + _IMPORT_ERROR + ")"
    if node.op != "call_function":
        return f"{node.op} node"
    if "val" not in node.meta:
        return "node has no recorded metadata"
    if node.target is operator.getitem:
        return _value_reason(node.meta["val"])
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op.namespace not in ("aten", "prims"):
        return f"{op} is not an ATen op"
    for tag, reason in _EXCLUDED_TAGS.items():
        if tag in op.tags and not (op is torch.ops.aten.index.Tensor and not _mask_index(node)):
            return reason
    if op._schema.is_mutable:
        return "mutates an argument"
    if op in TORCH_MLIR_WRONG_VALUES:
        return "torch-mlir's code for it is wrong (values, or writes its input)"
    if _REJECTED and op_key(op) in _REJECTED:
        return "torch-mlir or IREE rejected it in an earlier region"
    if _returns_alias(op) and _written_through(node):
        return "a view that a later op writes through (a compiled view is a copy)"
    for value in [node.meta["val"], *(n.meta.get("val") for n in node.all_input_nodes)]:
        reason = _value_reason(value)
        if reason is not None:
            return reason
    return None


def import_region(gm: torch.fx.GraphModule) -> ImportedRegion:
    """Import a region (a cluster-like submodule of `torch_mlir_reason` nodes) as `torch` dialect text
    with output arguments. Raises `LoweringError` when the importer rejects it."""
    if _IMPORT_ERROR is not None:
        raise LoweringError("torch-mlir", "the FX importer is unavailable: " + _IMPORT_ERROR)
    inputs, ops = [], []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            reason = _value_reason(node.meta.get("val"))
            if reason is not None:
                raise LoweringError("placeholder", f"{node.name}: {reason}")
            inputs.append(spec_of(node.meta["val"]))
        elif node.op == "call_function":
            reason = torch_mlir_reason(node)
            if reason is not None:
                raise LoweringError(node.target, reason)
            if node.target is not operator.getitem:
                ops.append(str(node.target))
        elif node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            outputs = tuple(spec_of(r.meta["val"]) for r in results)
    # The importer rewrites the graph it is given (as_strided): hand it a copy, so that `gm` stays
    # runnable as the eager fallback.
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(gm.graph, {}))
    owner = torch.fx.GraphModule(gm, copy)
    importer = FxImporter()
    try:
        region = importer.import_stateless_graph(owner.graph, func_name="region", func_visibility="private")
        with importer.module.context, ir.Location.unknown():
            signature = ir.FunctionType(ir.TypeAttr(region.attributes["function_type"]).value)
            # parsed next to a declaration of @region (the parser verifies the call), then moved over
            wrapper = ir.Module.parse(_main_text([str(t) for t in signature.inputs],
                                                 [str(t) for t in signature.results]))
            importer.module.body.append(wrapper.body.operations[1])
        text = str(importer.module_op)
    except Exception as error:  # the importer's NotImplementedError, AssertionError, MLIRError, ...
        first = str(error).splitlines()[0] if str(error) else ""
        raise LoweringError("torch-mlir import", f"{type(error).__name__}: {first}") from error
    if 'torch.operator "' in text:
        # an op torch-mlir has no definition for, imported opaquely: IREE would reject it after seconds
        name = text.split('torch.operator "', 1)[1].split('"', 1)[0]
        raise LoweringError(name, "torch-mlir has no definition of this op")
    return ImportedRegion(text, tuple(inputs), outputs, tuple(ops))


def _main_text(inputs: list[str], results: list[str]) -> str:
    """`@main`: calls the imported `@region` and writes its results into output arguments."""
    mutable = [t.replace("!torch.vtensor", "!torch.tensor", 1) for t in results]
    params = [f"%arg{i}: {t}" for i, t in enumerate(inputs)] + [f"%out{i}: {t}" for i, t in enumerate(mutable)]
    args = ", ".join(f"%arg{i}" for i in range(len(inputs)))
    lines = [f"func.func private @region({', '.join(inputs)}) -> ({', '.join(results)})",
             f"func.func @main({', '.join(params)}) {{",
             f"  %r:{len(results)} = func.call @region({args}) : ({', '.join(inputs)}) -> ({', '.join(results)})"]
    for i, (value, target) in enumerate(zip(results, mutable)):
        lines.append(f"  torch.overwrite.tensor.contents %r#{i} overwrites %out{i} : {value}, {target}")
    lines += ["  return", "}"]
    return "\n".join(lines)
