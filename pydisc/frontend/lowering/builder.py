"""A small builder for StableHLO MLIR text.

Rules never paste MLIR strings together themselves: they call the builder, which names SSA values,
spells tensor types and writes one op per line. The shape-sensitive helpers (`broadcast_in_dim`,
`reshape`, `full`, `iota`, `slice`) are the only places that decide how a shape is materialised, the
way JAX's mlir.py does it: static shapes take the plain StableHLO ops, dynamic ones (a dim that is a
sympy expression, printed `?`) the forms IREE 3.13 accepts (`dynamic_broadcast_in_dim` with its
expanding-dims attributes, `tensor.collapse_shape` + `tensor.expand_shape`, `dynamic_iota`,
`real_dynamic_slice`), with the runtime sizes built from `tensor.dim` of the arguments by `arith` ops
on `index` values, one per distinct expression.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch

from pydisc.frontend.lowering.symbolic import (
    Size,
    SizeBindings,
    DynamicShapeError,
    ceil_div,
    expression_node,
    floor_div,
    is_integer,
    is_static,
    same_size,
    size_max,
    size_of,
)

__all__ = [
    "ELEMENT_TYPES",
    "FunctionBuilder",
    "IndexTensor",
    "TensorSpec",
    "Value",
    "element_type",
    "is_float",
    "is_signed_int",
]

ELEMENT_TYPES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "ui8",
    torch.bool: "i1",
}


def element_type(dtype: torch.dtype) -> str:
    return ELEMENT_TYPES[dtype]


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def is_signed_int(dtype: torch.dtype) -> bool:
    return dtype in (torch.int64, torch.int32, torch.int16, torch.int8)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one tensor; `str()` is its MLIR type. A dim is an int or, when dynamic, a
    sympy expression over the step's size symbols (printed `?`)."""

    shape: tuple[Size, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not all(type(d) is int for d in self.shape):
            object.__setattr__(self, "shape", tuple(size_of(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> Size:
        return math.prod(self.shape)

    @property
    def is_static(self) -> bool:
        return is_static(self.shape)

    def with_dtype(self, dtype: torch.dtype) -> TensorSpec:
        return TensorSpec(self.shape, dtype)

    def with_shape(self, shape: Sequence[int]) -> TensorSpec:
        return TensorSpec(tuple(shape), self.dtype)

    def __str__(self) -> str:
        dims = "".join(f"{d}x" if type(d) is int else "?x" for d in self.shape)
        return f"tensor<{dims}{element_type(self.dtype)}>"


@dataclass(frozen=True, slots=True)
class Value:
    """An SSA value of the function being built."""

    name: str
    type: TensorSpec

    @property
    def shape(self) -> tuple[Size, ...]:
        return self.type.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.type.dtype

    @property
    def rank(self) -> int:
        return self.type.rank

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class IndexTensor:
    """A 1-D `tensor<Nxindex>` (a runtime shape or index vector), an operand of the dynamic ops."""

    name: str
    length: int

    @property
    def type(self) -> str:
        return f"tensor<{self.length}xindex>"

    def __str__(self) -> str:
        return self.name


def _i64_array(values: Sequence[int]) -> str:
    return "array<i64" + ("" if not values else ": " + ", ".join(str(int(v)) for v in values)) + ">"


def _literal(value: float | int | bool, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "true" if value else "false"
    if not dtype.is_floating_point:
        return str(int(value))
    value = float(value)
    if math.isfinite(value):
        text = repr(value)
        mantissa, _, exponent = text.partition("e")
        if exponent and "." not in mantissa:  # MLIR wants 1.0e-08, not 1e-08
            text = f"{mantissa}.0e{exponent}"
        return text
    # Non-finite: give the exact bit pattern in this element type.
    bits = torch.tensor(value, dtype=dtype)
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()]
    pattern = int(bits.view(int_type).item()) & ((1 << (8 * bits.element_size())) - 1)
    return f"0x{pattern:0{2 * bits.element_size()}X}"


class FunctionBuilder:
    """Collects the body of one `func.func`; values get fresh names `%0`, `%1`, ..."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._indent = "    "
        self._count = 0
        # Values computed from constants only. IREE 3.13 folds a reduction of such a value wrongly on
        # llvm-cpu (the sum of 50 ones comes out as 7: one per 8-wide vector), so `reduce` hides them
        # behind an optimization barrier. Backward passes sum broadcast ones all the time.
        self._constant: set[str] = set()
        # Runtime sizes: where each size symbol is read (a dim of an argument) and the `index` value
        # already computed for each size expression (reused; regions get their own copy).
        self._bindings = SizeBindings()
        self._arguments: dict[int, Value] = {}
        self._sizes: dict[Size, str] = {}
        self._shapes: dict[tuple[Size, ...], IndexTensor] = {}

    # ---- low level -------------------------------------------------------------------------------
    def fresh(self, spec: TensorSpec) -> Value:
        return Value(self._fresh_name(), spec)

    def _fresh_name(self) -> str:
        self._count += 1
        return f"%{self._count - 1}"

    def _derived(self, outs: Sequence[Value], operands: Sequence[Value]) -> None:
        if operands and all(o.name in self._constant for o in operands):
            self._constant.update(o.name for o in outs)

    def _unfolded(self, x: Value) -> Value:
        return self._unfolded_always(x) if x.name in self._constant else x

    def line(self, text: str) -> None:
        self._lines.append(self._indent + text)

    @property
    def lines(self) -> list[str]:
        return self._lines

    def op(
        self,
        name: str,
        operands: Sequence[Value],
        results: Sequence[TensorSpec] | TensorSpec,
        attrs: dict[str, str] | None = None,
        regions: Sequence[Callable[[], None]] = (),
    ) -> Value | tuple[Value, ...]:
        """Emit an op in MLIR generic form; regions are callbacks that emit their own blocks."""
        single = isinstance(results, TensorSpec)
        specs = [results] if single else list(results)
        outs = [self.fresh(s) for s in specs]
        self._derived(outs, operands)
        lhs = ", ".join(o.name for o in outs)
        attr_text = ""
        if attrs:
            attr_text = " {" + ", ".join(f"{k} = {v}" for k, v in attrs.items()) + "}"
        sig = f"({', '.join(str(o.type) for o in operands)}) -> "
        sig += str(specs[0]) if len(specs) == 1 else f"({', '.join(str(s) for s in specs)})"
        head = f'{lhs} = "{name}"({", ".join(o.name for o in operands)})'
        if not regions:
            self.line(f"{head}{attr_text} : {sig}")
        else:
            self.line(head + " ({")
            for i, emit_region in enumerate(regions):
                saved = self._indent
                self._indent = saved + "  "
                emit_region()
                self._indent = saved
                if i + 1 < len(regions):
                    self.line("}, {")
            self.line(f"}}){attr_text} : {sig}")
        return outs[0] if single else tuple(outs)

    def block(self, arg_specs: Sequence[TensorSpec], body: Callable[..., Sequence[Value]]) -> Callable[[], None]:
        """A region callback with one block taking `arg_specs` and returning `body(*args)`."""

        def emit() -> None:
            args = [self.fresh(s) for s in arg_specs]
            self.line("^bb0(" + ", ".join(f"{a.name}: {a.type}" for a in args) + "):")
            # sizes computed inside the region do not dominate the code after it
            sizes, shapes = dict(self._sizes), dict(self._shapes)
            results = body(*args)
            self._sizes, self._shapes = sizes, shapes
            self.line(
                "stablehlo.return " + ", ".join(r.name for r in results)
                + " : " + ", ".join(str(r.type) for r in results)
            )

        return emit

    # ---- elementwise -----------------------------------------------------------------------------
    def unary(self, name: str, x: Value, result: TensorSpec | None = None) -> Value:
        spec = result or x.type
        out = self.fresh(spec)
        self._derived([out], [x])
        if spec == x.type:
            self.line(f"{out.name} = stablehlo.{name} {x.name} : {spec}")
        else:
            self.line(f"{out.name} = stablehlo.{name} {x.name} : ({x.type}) -> {spec}")
        return out

    def binary(self, name: str, x: Value, y: Value) -> Value:
        out = self.fresh(x.type)
        self._derived([out], [x, y])
        self.line(f"{out.name} = stablehlo.{name} {x.name}, {y.name} : {x.type}")
        return out

    def compare(self, direction: str, x: Value, y: Value) -> Value:
        """`direction` is EQ/NE/LT/LE/GT/GE; the comparison type follows the operand dtype."""
        if x.dtype.is_floating_point:
            kind = "FLOAT"
        elif x.dtype in (torch.uint8, torch.bool):
            kind = "UNSIGNED"
        else:
            kind = "SIGNED"
        out = self.fresh(x.type.with_dtype(torch.bool))
        self._derived([out], [x, y])
        self.line(
            f"{out.name} = stablehlo.compare {direction}, {x.name}, {y.name}, {kind} : "
            f"({x.type}, {y.type}) -> {out.type}"
        )
        return out

    def select(self, pred: Value, on_true: Value, on_false: Value) -> Value:
        out = self.fresh(on_true.type)
        self._derived([out], [pred, on_true, on_false])
        self.line(
            f"{out.name} = stablehlo.select {pred.name}, {on_true.name}, {on_false.name} : "
            f"{pred.type}, {on_true.type}"
        )
        return out

    def fresh_copy(self, x: Value) -> Value:
        """`x` computed into a new buffer. IREE 3.13 runs in-place ops (scatter, sort) directly on the
        buffer of a function argument, i.e. it writes into a cluster's input; adding a zero that it
        cannot fold (-0.0 keeps every float, signed zeros included) makes the operand a temporary."""
        value = False if x.dtype == torch.bool else (-0.0 if x.dtype.is_floating_point else 0)
        if x.type.is_static:
            zero = self._unfolded_always(self.full(x.shape, value, x.dtype))
        else:  # IREE cannot follow dynamic dims through a barrier: hide the 0-d constant instead
            zero = self.broadcast_in_dim(self._unfolded_always(self.constant(value, x.dtype)), x.shape, [])
        return self.binary("or" if x.dtype == torch.bool else "add", x, zero)

    def _unfolded_always(self, x: Value) -> Value:
        out = self.fresh(x.type)
        self.line(f"{out.name} = stablehlo.optimization_barrier {x.name} : {x.type}")
        return out

    # ---- constants and shapes ---------------------------------------------------------------------
    def constant(self, value: float | int | bool, dtype: torch.dtype) -> Value:
        """A 0-d constant."""
        out = self.fresh(TensorSpec((), dtype))
        self.line(f"{out.name} = stablehlo.constant dense<{_literal(value, dtype)}> : {out.type}")
        self._constant.add(out.name)
        return out

    def literal(self, tensor: torch.Tensor) -> Value:
        """A constant holding `tensor`'s values (meant for small tensors captured at trace time)."""
        out = self.fresh(TensorSpec(tuple(tensor.shape), tensor.dtype))

        def spell(values: object) -> str:
            if isinstance(values, list):
                return "[" + ", ".join(spell(v) for v in values) + "]"
            return _literal(values, tensor.dtype)  # type: ignore[arg-type]

        self.line(f"{out.name} = stablehlo.constant dense<{spell(tensor.tolist())}> : {out.type}")
        self._constant.add(out.name)
        return out

    def full(self, shape: Sequence[Size], value: float | int | bool | sympy.Expr, dtype: torch.dtype) -> Value:
        """`value` everywhere. A static shape takes a splat constant, a dynamic one broadcasts a 0-d
        constant; a symbolic value (a size used as a number) is computed at run time."""
        if isinstance(value, sympy.Basic):
            if not value.is_number:
                return self.broadcast_in_dim(self.size_scalar(value, dtype), shape, [])  # type: ignore[arg-type]
            value = int(value) if value.is_Integer else float(value)
        if not is_static(shape):
            return self.broadcast_in_dim(self.constant(value, dtype), shape, [])
        out = self.fresh(TensorSpec(tuple(shape), dtype))
        self.line(f"{out.name} = stablehlo.constant dense<{_literal(value, dtype)}> : {out.type}")
        self._constant.add(out.name)
        return out

    def broadcast_in_dim(self, x: Value, shape: Sequence[Size], dims: Sequence[int]) -> Value:
        """`x`'s dim i becomes output dim `dims[i]` (a size-1 dim may be expanded)."""
        spec = TensorSpec(tuple(shape), x.dtype)
        if _same_shape(spec.shape, x.shape) and list(dims) == list(range(x.rank)):
            return x
        if spec.is_static and x.type.is_static:
            return self.op(
                "stablehlo.broadcast_in_dim", [x], spec, {"broadcast_dimensions": _i64_array(dims)}
            )
        # A dynamic size is never 1 (torch specialises sizes 0 and 1), so only a static 1 expands. The
        # expanding dims are dropped from the operand first: IREE 3.13 folds a reshape into the
        # broadcast and loses the expanding-dims attributes, which it then requires.
        expanding = [i for i, d in enumerate(dims) if x.shape[i] == 1 and spec.shape[d] != 1]
        if expanding:
            x = self.reshape(x, [d for i, d in enumerate(x.shape) if i not in expanding])
            dims = [d for i, d in enumerate(dims) if i not in expanding]
        return self.op(
            "stablehlo.dynamic_broadcast_in_dim",
            [x, self.shape_tensor(spec.shape)],
            spec,
            {
                "broadcast_dimensions": _i64_array(dims),
                "known_expanding_dimensions": _i64_array([]),
                "known_nonexpanding_dimensions": _i64_array(range(x.rank)),
            },
        )  # type: ignore[return-value]

    def broadcast_to(self, x: Value, shape: Sequence[int]) -> Value:
        """numpy-style broadcast: align trailing dims."""
        offset = len(shape) - x.rank
        return self.broadcast_in_dim(x, shape, range(offset, len(shape)))

    def reshape(self, x: Value, shape: Sequence[Size]) -> Value:
        spec = TensorSpec(tuple(shape), x.dtype)
        if spec == x.type:
            return x
        if spec.is_static and x.type.is_static:
            return self.op("stablehlo.reshape", [x], spec)
        if _same_shape(spec.shape, x.shape):
            return Value(x.name, spec)
        return self._dynamic_reshape(x, spec)

    def _dynamic_reshape(self, x: Value, spec: TensorSpec) -> Value:
        """IREE rejects `stablehlo.dynamic_reshape`: collapse each group of source dims whose product is
        a group of result dims, then expand the groups (either step skipped when it does nothing)."""
        groups = reshape_groups(x.shape, spec.shape)
        if groups is None:  # sizes not provably equal group by group: flatten and expand everything
            if not x.rank or not spec.rank:
                raise DynamicShapeError(f"cannot express the reshape of {x.type} to {spec} with collapse/expand")
            groups = [(list(range(x.rank)), list(range(spec.rank)))]
        value = x
        if any(len(source) != 1 for source, _ in groups):
            middle = TensorSpec(tuple(math.prod(x.shape[i] for i in source) for source, _ in groups), x.dtype)
            collapsed = self.fresh(middle)
            self._derived([collapsed], [x])
            self.line(f"{collapsed.name} = tensor.collapse_shape {x.name} {_reassociation(g[0] for g in groups)} "
                      f": {x.type} into {middle}")
            value = collapsed
        if any(len(target) != 1 for _, target in groups):
            sizes = ", ".join(str(d) if type(d) is int else self.index(d) for d in spec.shape)
            expanded = self.fresh(spec)
            self._derived([expanded], [value])
            self.line(f"{expanded.name} = tensor.expand_shape {value.name} {_reassociation(g[1] for g in groups)} "
                      f"output_shape [{sizes}] : {value.type} into {spec}")
            value = expanded
        return self.cast(value, spec)

    def cast(self, x: Value, spec: TensorSpec) -> Value:
        """`x` as type `spec`: the same sizes, possibly spelled differently (a static dim where the other
        has `?`, or another expression of the same size)."""
        if str(x.type) == str(spec):
            return x if x.type == spec else Value(x.name, spec)
        out = self.fresh(spec)
        self._derived([out], [x])
        self.line(f"{out.name} = tensor.cast {x.name} : {x.type} to {spec}")
        return out

    def transpose(self, x: Value, perm: Sequence[int]) -> Value:
        if list(perm) == list(range(x.rank)):
            return x
        shape = tuple(x.shape[p] for p in perm)
        return self.op(
            "stablehlo.transpose", [x], x.type.with_shape(shape), {"permutation": _i64_array(perm)}
        )

    def convert(self, x: Value, dtype: torch.dtype) -> Value:
        """dtype conversion with torch semantics (to bool means `!= 0`; float to int truncates)."""
        if x.dtype == dtype:
            return x
        if dtype == torch.bool:
            return self.compare("NE", x, self.full(x.shape, 0, x.dtype))
        if x.dtype == torch.bool:
            # i1 -> integer may sign-extend to -1 in some lowerings: select is unambiguous.
            return self.select(x, self.full(x.shape, 1, dtype), self.full(x.shape, 0, dtype))
        if x.dtype.is_floating_point and dtype in (torch.uint8, torch.int8, torch.int16):
            # torch (on x86) converts through a wide integer, so out-of-range values wrap around.
            x = self.unary("convert", x, x.type.with_dtype(torch.int64))
        return self.unary("convert", x, x.type.with_dtype(dtype))

    def iota(self, shape: Sequence[Size], dim: int, dtype: torch.dtype) -> Value:
        if not is_static(shape):
            return self.op(
                "stablehlo.dynamic_iota", [self.shape_tensor(shape)], TensorSpec(tuple(shape), dtype),
                {"iota_dimension": f"{dim} : i64"},
            )  # type: ignore[return-value]
        return self.op(
            "stablehlo.iota", [], TensorSpec(tuple(shape), dtype), {"iota_dimension": f"{dim} : i64"}
        )

    def slice(
        self, x: Value, start: Sequence[Size], limit: Sequence[Size], strides: Sequence[int],
        shape: Sequence[Size] | None = None,
    ) -> Value:
        """x[start:limit:strides]; `shape` gives the result's sizes where the caller knows them better
        (the recorded ones) than the division here."""
        if not (x.type.is_static and is_static(start) and is_static(limit)):
            if all(lo == 0 for lo in start) and all(st == 1 for st in strides) and _same_shape(limit, x.shape):
                return x
            if shape is None:
                shape = tuple(ceil_div(hi - lo, st) for lo, hi, st in zip(start, limit, strides))
            return self.op(
                "stablehlo.real_dynamic_slice",
                [x, self.shape_tensor(start), self.shape_tensor(limit), self.shape_tensor(strides)],
                x.type.with_shape(shape),
            )  # type: ignore[return-value]
        shape = tuple(max(0, -(-(hi - lo) // st)) for lo, hi, st in zip(start, limit, strides))
        if shape == x.shape:
            return x
        return self.op(
            "stablehlo.slice",
            [x],
            x.type.with_shape(shape),
            {
                "start_indices": _i64_array(start),
                "limit_indices": _i64_array(limit),
                "strides": _i64_array(strides),
            },
        )

    def concatenate(self, xs: Sequence[Value], dim: int) -> Value:
        if len(xs) == 1:
            return xs[0]
        shape = list(xs[0].shape)
        shape[dim] = sum(x.shape[dim] for x in xs)
        return self.op(
            "stablehlo.concatenate", list(xs), xs[0].type.with_shape(shape), {"dimension": f"{dim} : i64"}
        )

    def pad(self, x: Value, value: Value, low: Sequence[int], high: Sequence[int], interior: Sequence[int]) -> Value:
        shape = tuple(
            lo + hi + d + (size_max(d - 1, 0) * i if i else 0) for d, lo, hi, i in zip(x.shape, low, high, interior)
        )
        return self.op(
            "stablehlo.pad",
            [x, value],
            x.type.with_shape(shape),
            {
                "edge_padding_low": _i64_array(low),
                "edge_padding_high": _i64_array(high),
                "interior_padding": _i64_array(interior),
            },
        )

    def reverse(self, x: Value, dims: Sequence[int]) -> Value:
        if not dims:
            return x
        return self.op("stablehlo.reverse", [x], x.type, {"dimensions": _i64_array(dims)})

    # ---- structured ops ---------------------------------------------------------------------------
    def dot_general(
        self,
        lhs: Value,
        rhs: Value,
        batch: tuple[Sequence[int], Sequence[int]],
        contract: tuple[Sequence[int], Sequence[int]],
        out_dtype: torch.dtype,
    ) -> Value:
        """Result dims: batch, lhs free, rhs free (StableHLO order)."""
        lhs_free = [d for d in range(lhs.rank) if d not in batch[0] and d not in contract[0]]
        rhs_free = [d for d in range(rhs.rank) if d not in batch[1] and d not in contract[1]]
        shape = (
            [lhs.shape[d] for d in batch[0]] + [lhs.shape[d] for d in lhs_free] + [rhs.shape[d] for d in rhs_free]
        )
        if any(lhs.shape[d] == 0 for d in contract[0]):  # an empty sum; IREE 3.13 crashes compiling it
            return self.full(shape, 0, out_dtype)
        dims = (
            "#stablehlo.dot<"
            f"lhs_batching_dimensions = [{', '.join(map(str, batch[0]))}], "
            f"rhs_batching_dimensions = [{', '.join(map(str, batch[1]))}], "
            f"lhs_contracting_dimensions = [{', '.join(map(str, contract[0]))}], "
            f"rhs_contracting_dimensions = [{', '.join(map(str, contract[1]))}]>"
        )
        return self.op(
            "stablehlo.dot_general", [lhs, rhs], TensorSpec(tuple(shape), out_dtype), {"dot_dimension_numbers": dims}
        )

    def reduce(
        self,
        xs: Sequence[Value],
        inits: Sequence[Value],
        dims: Sequence[int],
        body: Callable[..., Sequence[Value]],
    ) -> tuple[Value, ...]:
        """Variadic reduce over `dims`; `body(*accumulators, *elements)` gets 0-d values."""
        dims = sorted(set(dims))
        xs = [self._unfolded(x) for x in xs]
        shape = tuple(d for i, d in enumerate(xs[0].shape) if i not in dims)
        scalars = [TensorSpec((), x.dtype) for x in xs]
        out = self.op(
            "stablehlo.reduce",
            [*xs, *inits],
            [TensorSpec(shape, x.dtype) for x in xs],
            {"dimensions": _i64_array(dims)},
            regions=[self.block(scalars + scalars, body)],
        )
        return out if isinstance(out, tuple) else (out,)

    def reduce_window(
        self,
        x: Value,
        init: Value,
        window: Sequence[int],
        strides: Sequence[int],
        padding: Sequence[tuple[int, int]],
        body: Callable[..., Sequence[Value]],
        dilations: Sequence[int] | None = None,
    ) -> Value:
        x = self._unfolded(x)
        shape = []
        for d, w, s, (lo, hi), dil in zip(x.shape, window, strides, padding, dilations or [1] * x.rank):
            span = (w - 1) * dil + 1
            shape.append(floor_div(d + lo + hi - span, s) + 1)
        attrs = {
            "window_dimensions": _i64_array(window),
            "window_strides": _i64_array(strides),
            "padding": "dense<[" + ", ".join(f"[{lo}, {hi}]" for lo, hi in padding) + f"]> : tensor<{x.rank}x2xi64>",
        }
        if dilations is not None:
            attrs["window_dilations"] = _i64_array(dilations)
        scalar = TensorSpec((), x.dtype)
        return self.op(
            "stablehlo.reduce_window",
            [x, init],
            x.type.with_shape(shape),
            attrs,
            regions=[self.block([scalar, scalar], body)],
        )

    def text(self) -> str:
        return "\n".join(self._lines)

    # ---- runtime sizes ---------------------------------------------------------------------------
    def bind_argument(self, position: int, value: Value) -> None:
        """Make the dynamic dims of function argument `value` (input `position`) readable as sizes."""
        self._arguments[position] = value
        for dim, size in enumerate(value.shape):
            self._bindings.add(size, position, dim)

    @property
    def size_bindings(self) -> SizeBindings:
        return self._bindings

    def index(self, size: Size) -> str:
        """The name of an `index` value equal to `size` at run time (computed once per expression)."""
        name = self._sizes.get(size)
        if name is not None:
            return name
        if type(size) is int:
            name = self._fresh_name()
            self.line(f"{name} = arith.constant {size} : index")
        else:
            resolved = self._bindings.resolve(size)
            if resolved in self._bindings.leaves:
                position, dim = self._bindings.leaves[resolved]
                argument = self._arguments[position]
                dim_index = self.index(dim)
                name = self._fresh_name()
                self.line(f"{name} = tensor.dim {argument.name}, {dim_index} : {argument.type}")
            else:
                name = self._index_expression(resolved)
        self._sizes[size] = name
        return name

    def _index_expression(self, expr: sympy.Expr) -> str:
        kind, *args = expression_node(expr)
        if kind == "leaf":
            return self.index(args[0])
        if kind not in _INDEX_OPS and kind != "mod":
            raise UnboundSizeError(f"{expr} is not an integer size")
        operands = [self.index(a) for a in args]
        if kind == "mod":  # a - b * floor(a / b): Python's modulo, torch's Mod on its non-negative domain
            quotient = self._arith("floordivsi", operands[0], operands[1])
            return self._arith("subi", operands[0], self._arith("muli", quotient, operands[1]))
        result = operands[0]
        for operand in operands[1:]:
            result = self._arith(_INDEX_OPS[kind], result, operand)
        return result

    def _arith(self, op: str, lhs: str, rhs: str) -> str:
        name = self._fresh_name()
        self.line(f"{name} = arith.{op} {lhs}, {rhs} : index")
        return name

    def shape_tensor(self, sizes: Sequence[Size]) -> IndexTensor:
        """A `tensor<Nxindex>` holding `sizes` at run time."""
        key = tuple(sizes)
        out = self._shapes.get(key)
        if out is None:
            names = [self.index(d) for d in sizes]
            out = IndexTensor(self._fresh_name(), len(names))
            self.line(f"{out.name} = tensor.from_elements {', '.join(names)} : {out.type}")
            self._shapes[key] = out
        return out

    def size_scalar(self, size: Size, dtype: torch.dtype) -> Value:
        """A 0-d tensor of `dtype` holding `size` (a size used as a number, e.g. the count of a mean);
        a float expression of sizes (`s0 / 4`, `s0 ** -0.5`) is computed in float64."""
        if not is_integer(size):
            return self.convert(self._float_scalar(size), dtype)
        key = ("i64", size)
        out = self._sizes.get(key)  # type: ignore[call-overload]
        if out is None:
            wide = self._fresh_name()
            self.line(f"{wide} = arith.index_cast {self.index(size)} : index to i64")
            out = self.fresh(TensorSpec((), torch.int64))
            self.line(f"{out.name} = tensor.from_elements {wide} : {out.type}")
            self._sizes[key] = out  # type: ignore[index]
        return self.convert(out, dtype)  # type: ignore[arg-type]

    def _float_scalar(self, size: Size | float) -> Value:
        if isinstance(size, (int, float)):
            return self.constant(size, torch.float64)
        if is_integer(size):
            return self.size_scalar(size, torch.float64)
        kind, *args = expression_node(size)
        if kind == "float":
            return self._float_scalar(args[0])
        operands = [self._float_scalar(a) for a in args]
        name = {"add": "add", "mul": "multiply", "truediv": "divide", "pow": "power"}.get(kind)
        if name is None:
            raise UnboundSizeError(f"{size}: {kind} of floats")
        result = operands[0]
        for operand in operands[1:]:
            result = self.binary(name, result, operand)
        return result


_INDEX_OPS = {"add": "addi", "mul": "muli", "floordiv": "floordivsi", "ceildiv": "ceildivsi", "max": "maxsi", "min": "minsi"}


def _same_shape(a: Sequence[Size], b: Sequence[Size]) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _reassociation(groups: object) -> str:
    return "[" + ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups) + "]"  # type: ignore[attr-defined]


def reshape_groups(source: Sequence[Size], target: Sequence[Size]) -> list[tuple[list[int], list[int]]] | None:
    """Contiguous groups of source dims and target dims with equal products, in order (size-1 dims join
    a neighbouring group); None when the sizes do not split that way."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(source) or j < len(target):
        src: list[int] = []
        dst: list[int] = []
        have: Size = 1
        want: Size = 1
        if i < len(source):
            src.append(i)
            have = source[i]
            i += 1
        if j < len(target):
            dst.append(j)
            want = target[j]
            j += 1
        while not same_size(have, want):
            numerator, denominator = sympy.fraction(sympy.cancel(sympy.sympify(want) / sympy.sympify(have)))
            grow_source = i < len(source) and (denominator == 1 or j >= len(target))
            grow_target = j < len(target) and (numerator == 1 or i >= len(source))
            if not grow_source and not grow_target:  # neither divides the other: take one more of each
                grow_source, grow_target = i < len(source), j < len(target)
                if not grow_source and not grow_target:
                    return None
            if grow_source:
                src.append(i)
                have = have * source[i]
                i += 1
            if grow_target:
                dst.append(j)
                want = want * target[j]
                j += 1
        groups.append((src, dst))
    # a group of only size-1 dims on one side joins its neighbour
    merged: list[tuple[list[int], list[int]]] = []
    pending: tuple[list[int], list[int]] = ([], [])
    for src, dst in groups:
        if not src or not dst:
            if merged:
                merged[-1][0].extend(src)
                merged[-1][1].extend(dst)
            else:
                pending[0].extend(src)
                pending[1].extend(dst)
            continue
        merged.append((pending[0] + src, pending[1] + dst))
        pending = ([], [])
    if pending[0] or pending[1]:
        return None
    return merged


def i64_array(values: Sequence[int]) -> str:
    """An `array<i64: ...>` attribute (for rules that build attributes the builder has no helper for)."""
    return _i64_array(values)


__all__ += ["i64_array", "reshape_groups"]
