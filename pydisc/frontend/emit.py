"""Emit one partitioned cluster (an FX GraphModule of core ATen ops) as a StableHLO MLIR module.

The module has a single public function: the cluster inputs in placeholder order, then one
`!hal.buffer_view` argument per result, the storage IREE writes result N into: a tensor that torch
allocated from `EmittedCluster.outputs`. Shapes and dtypes come from `node.meta["val"]`.

Each result is placed in its storage with `hal.tensor.alias` right where it is computed, and the ops
after it read the placed value. (`{iree.abi.output = N}` on a tensor argument places results only at
the end of the function: IREE then writes a result that later ops also read into a buffer of its own
and copies it over, as it emplaces a dispatch result only when that is its one use. On a BERT-base
training step on the H200 those copies were 206 per step, 3.2 GB.) IREE 3.13 refuses the alias on
unsigned integers: a uint8 result keeps `{iree.abi.output = N}` on a tensor argument.

A graph traced with symbolic sizes has dims that are sympy expressions (printed `?`) and SymInt-valued
nodes (`aten.sym_size.int`, `operator.mul`, ...). Those nodes emit nothing: their value is their
expression, and a rule that needs it at run time gets it from the dims of the tensor arguments
(`tensor.dim`). So a SymInt input of a cluster is not an argument of the function (the executor drops
it), and a SymInt output is computed on the host from the input sizes (`EmittedCluster.layout`).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.fx.node import map_arg

from pydisc.frontend.lowering import LOWERINGS, FunctionBuilder, LoweringContext, LoweringError, TensorSpec, Value
from pydisc.frontend.lowering.builder import ELEMENT_TYPES
from pydisc.frontend.lowering.registry import DYNAMIC_RULES, SUPPORT_CHECKS, spec_of
from pydisc.frontend.lowering.size_exprs import (
    DynamicShapeError,
    Size,
    SizeBindings,
    check_computable,
    python_expression,
    size_of,
)

__all__ = ["EmittedCluster", "LoweringError", "TensorSpec", "emit_cluster", "size_function", "unsupported_reason"]


@dataclass(frozen=True)
class EmittedCluster:
    text: str
    inputs: tuple[TensorSpec, ...]    # the function's tensor arguments
    outputs: tuple[TensorSpec, ...]   # the function's results
    ops: tuple[str, ...]  # ATen op of each lowered node, in emission order
    # Placeholder position of each function argument (SymInt placeholders are not arguments).
    arguments: tuple[int, ...] = ()
    # Each cluster output: ("result", k) for the function's result k, ("size", size) for a SymInt
    # output computed on the host. Empty: the outputs are the results in order.
    layout: tuple[tuple[str, object], ...] = ()
    # Where the sizes in `outputs` and `layout` are read at run time (dims of the placeholders).
    bindings: SizeBindings | None = None

    @property
    def dynamic(self) -> bool:
        """Whether running it needs more than the static output specs: sizes evaluated per call,
        placeholders that are not arguments, or host-computed outputs."""
        return bool(self.layout) or any(not s.is_static for s in self.outputs)


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
    return None


# SymInt-valued nodes that are functions of sizes only (never of tensor data, unlike `.item()`).
_SIZE_OPS = {
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg, operator.pos,
    torch.sym_max, torch.sym_min, torch.sym_sum, torch.sym_float, operator.truediv, operator.pow,
}


def _is_size_value(val: object) -> bool:
    """An int, a SymInt, or a SymFloat computed from sizes (a mean's count, `n / 4`)."""
    if isinstance(val, torch.SymFloat):
        return not val.node.expr.is_number
    return isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool)


def _size_value(val: object) -> Size:
    """The size expression of a size value (float expressions of sizes stay sympy expressions)."""
    if isinstance(val, torch.SymFloat):
        return val.node.expr  # type: ignore[return-value]
    return size_of(val)


def _is_size_node(node: torch.fx.Node) -> bool:
    """A node whose value is an integer size (SymInt): computed from sizes, emitted as nothing."""
    return (node.op == "placeholder" or node.target in _SIZE_OPS) and _is_size_value(node.meta.get("val"))


def _size_reason(val: object) -> str | None:
    try:
        check_computable(_size_value(val))
    except DynamicShapeError as error:
        return str(error)
    return None


def _is_symbolic(val: object) -> bool:
    if isinstance(val, torch.Tensor):
        return not all(isinstance(size_of(d), int) for d in val.shape)
    if isinstance(val, (list, tuple)):
        return any(_is_symbolic(v) for v in val)
    return _is_size_value(val) and not isinstance(_size_value(val), int)


def _dynamic_reason(node: torch.fx.Node) -> str | None:
    """Why a node with dynamic dims (or symbolic arguments) cannot be lowered, if it cannot."""
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    for val in inputs:
        if isinstance(val, (torch.SymFloat, torch.SymBool)) and not _is_size_value(val):
            return f"a symbolic {type(val).__name__} argument ({val.node.expr})"
    if node.target in DYNAMIC_RULES:
        return None
    if any(_is_symbolic(v) for v in [node.meta.get("val"), *inputs]):
        return f"dynamic shapes are not supported by the rule for {node.target}"
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
    if node.op == "output":
        return None
    val = node.meta.get("val")
    if node.op == "placeholder":
        if isinstance(val, (torch.SymFloat, torch.SymBool, float)) and not _is_size_value(val):
            return f"a {type(val).__name__} input"
        return _size_reason(val) if _is_size_value(val) else _dtype_reason(val)
    if node.op != "call_function":
        return f"{node.op} nodes are not supported"
    if node.target is operator.getitem:  # an unused result (None) of a multi-output op has no val
        return _dtype_reason(val)
    if "val" not in node.meta:
        return "node has no recorded metadata"
    if _is_size_node(node):
        return _size_reason(val)
    if node.target not in LOWERINGS:
        return f"no lowering rule for {node.target}"
    for value in [val, *(n.meta.get("val") for n in node.all_input_nodes)]:
        reason = _dtype_reason(value)
        if reason is not None:
            return reason
    reason = _dynamic_reason(node)
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
    if _is_size_node(node):
        return _size_value(node.meta["val"])
    out = _specs(node.meta["val"])
    ctx = LoweringContext(builder, node, out)  # type: ignore[arg-type]
    args = map_arg(node.args, lambda n: env[n])
    kwargs = map_arg(node.kwargs, lambda n: env[n])
    # the op only, not the FX node's name: two layers of a model emit the same text, and compile once
    builder.line(f"// {node.target}")
    try:
        result = LOWERINGS[node.target](ctx, *args, **kwargs)
    except LoweringError:
        raise
    except Exception as error:  # a rule that cannot handle its arguments is a lowering failure
        raise LoweringError(node.target, f"{type(error).__name__}: {error}") from error
    single = not isinstance(result, tuple)
    results = (result,) if single else result
    if len(results) != len(out):
        raise LoweringError(node.target, f"rule returned {len(results)} results, expected {len(out)}")
    checked = []
    for value, spec in zip(results, out):
        if spec is not None and isinstance(value, Value) and value.type != spec and _compatible(value.type, spec):
            value = builder.cast(value, spec)  # the same sizes, spelled differently
        if spec is not None and (not isinstance(value, Value) or value.type != spec):
            got = value.type if isinstance(value, Value) else value
            raise LoweringError(node.target, f"rule produced {got}, metadata says {spec}")
        checked.append(value)
    return checked[0] if single else tuple(checked)


def _placeable(value: Value) -> bool:
    """Whether `hal.tensor.alias` takes the value: IREE 3.13 leaves it illegal on unsigned integer
    tensors (its StableHLO input conversion makes them signless around it). Those results are placed at
    the end of the function, `{iree.abi.output}`."""
    return value.dtype != torch.uint8


def _alias(builder: FunctionBuilder, value: Value, k: int) -> Value:
    """`value` placed in the storage of output `k` (`hal.tensor.alias`): the value that ops after it read."""
    try:
        return builder.alias(value, f"%out{k}")
    except DynamicShapeError as error:
        raise LoweringError("output", str(error)) from error


def _place(builder: FunctionBuilder, env: dict, node: torch.fx.Node, k: int) -> Value:
    """Place output `node`'s value in the storage of output `k`; the nodes lowered so far to the same
    value (a reshape that changes nothing is its operand's value) read the placed one from now on, so
    that placing stays the value's one use where it can."""
    value = env[node]
    placed = _alias(builder, value, k)
    for other, v in env.items():
        if isinstance(v, Value) and v.name == value.name:
            env[other] = Value(placed.name, v.type) if v.type == value.type else v
    return placed


def _compatible(got: TensorSpec, want: TensorSpec) -> bool:
    """Same dtype and rank, and no two static dims that differ."""
    return got.dtype == want.dtype and got.rank == want.rank and all(
        not (type(a) is int and type(b) is int) or a == b for a, b in zip(got.shape, want.shape)
    )


def _scalar_reads(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Per input, its nodes `select(arg, 0, i)` of static 0-d float results: how a step reads its
    lifted scalars (learning rates, the Python floats of arithmetic ops) out of the one tensor that
    holds them all.

    IREE fuses such a slice into every dispatch that uses the value, with the offset `i` baked in, so
    a chain of identical layers that differ only in the scalar they read becomes as many distinct
    executables, each compiled on its own (~0.15 s apiece on llvm-cpu: 40 of the 44 s of a 1,000-op
    step). `emit_cluster` therefore reads them all at the first, behind one optimization barrier: the
    dispatches then take the scalars as operands, are identical and are deduplicated. One barrier at
    the top costs nothing measurable at run time; one barrier per scalar would split the schedule into
    as many submissions (+70% on an MLP training step)."""
    reads: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or \
                node.target not in (torch.ops.aten.select.int, torch.ops.aten.select_copy.int):
            continue
        source, val = node.args[0], node.meta.get("val")
        if isinstance(source, torch.fx.Node) and source.op == "placeholder" and \
                all(type(a) is int for a in node.args[1:]) and isinstance(val, torch.Tensor) and \
                val.dim() == 0 and val.dtype.is_floating_point:
            reads.setdefault(source, []).append(node)
    return {source: group for source, group in reads.items() if len(group) > 1}


def emit_cluster(gm: torch.fx.GraphModule, *, func_name: str = "main", share_scalars: bool = True,
                 multiples: dict | None = None) -> EmittedCluster:
    """The StableHLO function of a cluster. `share_scalars` reads the lifted scalars behind one barrier
    (`_scalar_reads`): fewer distinct dispatches to compile, at the cost of a buffer copy per scalar
    when the module runs. On CUDA those copies were 1,332 of the 3,462 launches of a GPT-2 training
    step, so the CUDA target passes False: each dispatch then reads its scalars itself. `multiples`:
    size symbol -> a number its value is guaranteed a multiple of (a dynamic-shape template's guard);
    with it, what each dynamic dim is known to be a multiple of (those and the dim's constant factors)
    is told to IREE where the dim is read (`RuntimeSizes.index`). None: nothing is."""
    builder = FunctionBuilder()
    builder.multiples = multiples
    env: dict[torch.fx.Node, object] = {}
    inputs: list[Value] = []
    arguments: list[int] = []
    ops: list[str] = []
    results: list[Value] = []
    layout: list[tuple[str, object]] = []
    placeholders = 0
    scalar_reads = _scalar_reads(gm) if share_scalars else {}
    hoisted = {read for group in scalar_reads.values() for read in group}
    params: list[str] = []
    sizes_in: list[tuple[int, torch.fx.Node]] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        reason = unsupported_reason(node)
        if reason is not None:
            raise LoweringError("placeholder", f"{node.name}: {reason}")
        if _is_size_value(node.meta["val"]):
            env[node] = _size_value(node.meta["val"])
            sizes_in.append((placeholders, node))
        else:
            value = Value(f"%arg{placeholders}", spec_of(node.meta["val"]))
            builder.bind_argument(placeholders, value)
            inputs.append(value)
            arguments.append(placeholders)
            params.append(f"{value.name}: {value.type}")
            env[node] = value
        placeholders += 1
    # A size input is computed in the function from the dims of tensor arguments where it can be (no
    # argument then); one that no tensor carries (`s0*s1` rows of a matmul result that is viewed as
    # (s0, s1, ...)) becomes an `index` argument.
    for position, node in sizes_in:
        size = env[node]
        if type(size) is int:
            continue
        try:
            builder.size_bindings.resolve(size)
        except DynamicShapeError:
            name = f"%arg{position}"
            builder.bind_index_argument(position, name, size)
            arguments.append(position)
            params.append(f"{name}: index")
    # the result index of each output node (its first place in the output list), placed when computed
    result_of: dict[torch.fx.Node, int] = {}
    placed: dict[int, Value] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            tensors = [out for out in outs if not (isinstance(out, torch.fx.Node) and _is_size_node(out))]
            for k, out in enumerate(tensors):
                if isinstance(out, torch.fx.Node) and out.op == "call_function":
                    result_of.setdefault(out, k)
    order = sorted(range(len(arguments)), key=arguments.__getitem__)
    arguments = [arguments[k] for k in order]
    params = [params[k] for k in order]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        elif node.op == "call_function":
            if node in hoisted and node not in env:
                # the first read of a lifted scalar: read all those of that input now (`_scalar_reads`)
                group = scalar_reads[node.args[0]]
                values = [_lower_node(builder, read, env) for read in group]
                env.update(zip(group, builder.optimization_barrier(*values)))  # type: ignore[arg-type]
            if node not in env:
                env[node] = _lower_node(builder, node, env)
            k = result_of.get(node)
            if k is not None and isinstance(env[node], Value) and _placeable(env[node]):
                placed[k] = _place(builder, env, node, k)
            if node.target is not operator.getitem and not _is_size_node(node):
                ops.append(str(node.target))
        elif node.op == "get_attr":
            constant = _constant(gm, node)
            env[node] = builder.literal(constant)
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            for out in outs:
                value = env.get(out) if isinstance(out, torch.fx.Node) else None
                if isinstance(value, Value):
                    layout.append(("result", len(results)))
                    results.append(value)
                elif isinstance(out, torch.fx.Node) and _is_size_node(out):
                    layout.append(("size", env[out]))  # a SymInt output: computed on the host
                else:
                    raise LoweringError("output", f"cluster output {out!r} is not a tensor")
        else:
            raise LoweringError(node.op, f"unsupported FX node kind {node.op}")

    # The executor sizes the outputs from the inputs: every size it needs must be readable there.
    bindings = builder.size_bindings
    try:
        for size in [d for r in results for d in r.shape] + [size for kind, size in layout if kind == "size"]:
            check_computable(bindings.resolve(size))  # type: ignore[arg-type]
    except DynamicShapeError as error:
        raise LoweringError("output", str(error)) from error

    for k, value in enumerate(results):
        if not _placeable(value):
            params.append(f"%out{k}: {value.type} {{iree.abi.output = {k} : index}}")
            continue
        # inputs, constants, and a value returned twice: placed here (IREE copies these, as it must)
        if placed.get(k) != value:
            results[k] = _alias(builder, value, k)
        params.append(f"%out{k}: !hal.buffer_view")
    result_types = ", ".join(str(r.type) for r in results)
    lines = [
        f"func.func @{func_name}({', '.join(params)}) -> ({result_types}) {{",
        *builder.lines,
        "    return" + (f" {', '.join(r.name for r in results)} : {result_types}" if results else ""),
        "}",
    ]
    plain = arguments == list(range(placeholders)) and all(kind == "result" for kind, _ in layout)
    return EmittedCluster(
        text="module {\n" + "\n".join("  " + line for line in lines) + "\n}\n",
        inputs=tuple(v.type for v in inputs),
        outputs=tuple(r.type for r in results),
        ops=tuple(ops),
        arguments=tuple(arguments),
        layout=() if plain else tuple(layout),
        bindings=bindings,
    )


def size_function(emitted: EmittedCluster, device: torch.device) -> Callable:
    """`prepare(inputs) -> (arguments, outputs, results)` for a cluster with dynamic dims, generated as
    Python source once: it reads each needed size symbol from an input's dim, allocates the outputs at
    this call's sizes and lists the cluster's results (tensors, and SymInt outputs as ints). Sympy is
    not involved per call; the cost is a few dim reads and one `torch.empty` per output."""
    bindings = emitted.bindings
    reads: list[str] = []
    names: dict = {}

    def leaf(symbol) -> str:
        if symbol not in names:
            position, dim = bindings.leaves[symbol]
            names[symbol] = "n%d" % len(names)
            if dim is None:     # a size passed as an int (an `index` argument)
                reads.append("    %s = inputs[%d]" % (names[symbol], position))
            else:
                reads.append("    %s = inputs[%d].size(%d)" % (names[symbol], position, dim))
        return names[symbol]

    def size(expr) -> str:
        return python_expression(bindings.resolve(expr), leaf)

    allocations = []
    for k, spec in enumerate(emitted.outputs):
        dims = ", ".join(size(d) for d in spec.shape) + ("," if spec.rank == 1 else "")
        allocations.append("    o%d = empty((%s), dtype=dtype%d, device=device)" % (k, dims, k))
    layout = emitted.layout or tuple(("result", k) for k in range(len(emitted.outputs)))
    results = ["o%d" % value if kind == "result" else size(value) for kind, value in layout]
    arguments = "".join("inputs[%d], " % p for p in emitted.arguments)
    source = "\n".join([
        "def prepare(inputs):",
        *reads,
        *allocations,
        "    return (%s), [%s], (%s)" % (arguments, ", ".join("o%d" % k for k in range(len(emitted.outputs))),
                                       "".join(r + ", " for r in results)),
    ])
    scope = {"empty": torch.empty, "device": device, "max": max, "min": min}
    scope.update({"dtype%d" % k: spec.dtype for k, spec in enumerate(emitted.outputs)})
    exec(compile(source, "<pydisc cluster sizes>", "exec"), scope)
    prepare = scope["prepare"]
    prepare.source = source
    return prepare
