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

import sympy
import torch

from pydisc.frontend.lowering.sizes import RuntimeSizes
from pydisc.frontend.lowering.size_exprs import (
    DynamicShapeError,
    Size,
    ceil_div,
    floor_div,
    is_static,
    reshape_groups,
    same_shape,
    size_max,
)
from pydisc.frontend.lowering.values import (
    ELEMENT_TYPES,
    IndexTensor,
    TensorSpec,
    Value,
    element_type,
    is_float,
    is_signed_int,
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


class FunctionBuilder(RuntimeSizes):
    """Collects the body of one `func.func`; values get fresh names `%0`, `%1`, ..."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._indent = "    "
        self._count = 0
        # Values computed from constants only. IREE 3.13 folds a reduction of such a value wrongly on
        # llvm-cpu (the sum of 50 ones comes out as 7: one per 8-wide vector), so `reduce` hides them
        # behind an optimization barrier. Backward passes sum broadcast ones all the time.
        self._constant: set[str] = set()
        # bf16 value -> the same values as float32 (`convert`): a bf16 rounding inside a cluster stays
        # in float32, because IREE 3.13 does not fuse a truncation into the ops that widen it again
        self._wide: dict[str, Value] = {}
        # Values a gather may read as they are: arguments' views and values behind a barrier
        # (indexing._whole: IREE 3.13's CUDA code misreads a gather of a slice fused into its load)
        self.whole: set[str] = set()
        self._init_sizes()  # runtime sizes (sizes.py)

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
            saved = self._save_sizes()
            results = body(*args)
            self._restore_sizes(saved)
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
        if on_true.name in self._wide or on_false.name in self._wide:
            # exact in float32 too: a masked fill of a rounded value (autocast's bf16 masked_fill)
            wide = [self._wide.get(v.name) or self.unary("convert", v, v.type.with_dtype(torch.float32))
                    for v in (on_true, on_false)]
            self._wide[out.name] = self.select(pred, *wide)
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

    def optimization_barrier(self, *xs: Value) -> tuple[Value, ...]:
        """`xs` behind one barrier: IREE neither folds them into constants nor fuses across it."""
        outs = [self.fresh(x.type) for x in xs]
        self.line(f"{', '.join(o.name for o in outs)} = stablehlo.optimization_barrier "
                  f"{', '.join(x.name for x in xs)} : {', '.join(str(x.type) for x in xs)}")
        return tuple(outs)

    def alias(self, x: Value, storage: str) -> Value:
        """`x` placed in `storage`, a `!hal.buffer_view` argument (`hal.tensor.alias`): the value that ops
        after it read. Raises DynamicShapeError where a dynamic dim of `x` cannot be computed here."""
        dims = [self.index(d) for d in x.shape if type(d) is not int]
        out = self.fresh(x.type)
        self._derived([out], [x])
        dim_text = "{%s}" % ", ".join(dims) if dims else ""
        self.line(f"{out.name} = hal.tensor.alias {x.name} : {x.type}{dim_text} to {storage} : !hal.buffer_view")
        return out

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
        if same_shape(spec.shape, x.shape) and list(dims) == list(range(x.rank)):
            return x
        if spec.is_static and x.type.is_static:
            return self.op(
                "stablehlo.broadcast_in_dim", [x], spec, {"broadcast_dimensions": _i64_array(dims)}
            )
        # A dynamic size is never 1 (torch specialises sizes 0 and 1), so only a static 1 expands. The
        # expanding dims are dropped from the operand first: IREE 3.13 folds a reshape into the
        # broadcast and loses the expanding-dims attributes, which it then requires.
        expanding = [i for i, d in enumerate(dims) if x.shape[i] == 1 and spec.shape[d] != 1]
        if not expanding and list(dims) == sorted(dims) and \
                all(spec.shape[d] == 1 for d in range(spec.rank) if d not in dims):
            # only inserts size-1 dims: a reshape. As a broadcast, IREE 3.13 folds the operand's own
            # expand_shape into it and drops the expanding-dims attributes it then requires.
            return self.reshape(x, spec.shape)
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
        return self._moved_wide(x, self._reshape(x, shape), lambda wide: self._reshape(wide, shape))

    def _reshape(self, x: Value, shape: Sequence[Size]) -> Value:
        spec = TensorSpec(tuple(shape), x.dtype)
        if spec == x.type:
            return x
        if spec.is_static and x.type.is_static:
            return self.op("stablehlo.reshape", [x], spec)
        if same_shape(spec.shape, x.shape):
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
        out = self.op("stablehlo.transpose", [x], x.type.with_shape(shape), {"permutation": _i64_array(perm)})
        return self._moved_wide(x, out, lambda wide: self.transpose(wide, perm))  # type: ignore[arg-type]

    def _moved_wide(self, x: Value, out: Value, move: Callable[[Value], Value]) -> Value:
        """`out` moves the data of `x`: if `x` has a float32 form (a bf16 rounding), `out` gets it moved
        the same way. Across a reshape IREE 3.13's llvm-cpu folds the widening of the rounded bf16 value
        into the float32 value before it, dropping the rounding."""
        wide = self._wide.get(x.name)
        if wide is not None and out.name != x.name:
            self._wide[out.name] = move(wide)
        return out

    def convert(self, x: Value, dtype: torch.dtype) -> Value:
        """dtype conversion with torch semantics (to bool means `!= 0`; float to int truncates)."""
        if x.dtype == dtype:
            return x
        if dtype == torch.float32 and x.name in self._wide:
            return self._wide[x.name]
        if dtype == torch.bool:
            return self.compare("NE", x, self.full(x.shape, 0, x.dtype))
        if x.dtype == torch.bool:
            # i1 -> integer may sign-extend to -1 in some lowerings: select is unambiguous.
            return self.select(x, self.full(x.shape, 1, dtype), self.full(x.shape, 0, dtype))
        if x.dtype.is_floating_point and dtype in (torch.uint8, torch.int8, torch.int16):
            # torch (on x86) converts through a wide integer, so out-of-range values wrap around.
            x = self.unary("convert", x, x.type.with_dtype(torch.int64))
        rounded = None
        if dtype in (torch.bfloat16, torch.float16) and x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            # torch builds a half from a float (c10::BFloat16/Half): integers and float64 round twice,
            # through float32
            x = self.unary("convert", x, x.type.with_dtype(torch.float32))
            if dtype == torch.bfloat16:
                # rounded to bf16 in float32 first (round to nearest even, as torch): IREE's llvm-cpu
                # folds int -> f32 -> bf16 into one int -> bf16 conversion that needs a runtime library
                # function it does not link (__truncsfbf2)
                x = rounded = self.round_to_bf16(x)
        out = self.unary("convert", x, x.type.with_dtype(dtype))
        if dtype == torch.bfloat16 and x.dtype == torch.float32:
            # the rounded values in float32, for a conversion back (autocast rounds to bf16 between
            # float32 ops): IREE fuses this, not the truncation, with what follows; unused, it is dropped
            self._wide[out.name] = rounded or self.round_to_bf16(x)
        return out

    def round_to_bf16(self, x: Value) -> Value:
        """float32 `x` rounded to bf16's precision (nearest even, as torch), still as float32."""
        if x.type.is_static:
            return self.op("stablehlo.reduce_precision", [x], x.type,
                           {"exponent_bits": "8 : i32", "mantissa_bits": "7 : i32"})  # type: ignore[return-value]
        # IREE 3.13's input conversion crashes on a dynamic reduce_precision: the same rounding on the
        # bits, as torch's c10::BFloat16 does it (NaN kept)
        i32 = x.type.with_dtype(torch.int32)
        bits = self.op("stablehlo.bitcast_convert", [x], i32)
        lsb = self.binary("and", self.binary("shift_right_logical", bits, self.full(x.shape, 16, torch.int32)),
                          self.full(x.shape, 1, torch.int32))
        rounded = self.binary("add", bits, self.binary("add", lsb, self.full(x.shape, 0x7FFF, torch.int32)))
        kept = self.binary("and", rounded, self.full(x.shape, -65536, torch.int32))
        y = self.op("stablehlo.bitcast_convert", [kept], x.type)
        return self.select(self.compare("NE", x, x), x, y)  # type: ignore[arg-type]

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
            if all(lo == 0 for lo in start) and all(st == 1 for st in strides) and same_shape(limit, x.shape):
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
        # a piece empty along `dim` adds nothing: IREE 3.13's CPU code fails on one in a dynamic
        # concatenation ("offset 3 is out-of-bounds: 0 >= 0"; partial rotary over the whole head)
        xs = [x for x in xs if x.shape[dim] != 0] or list(xs[:1])
        if len(xs) == 1:
            return xs[0]
        shape = list(xs[0].shape)
        shape[dim] = sum(x.shape[dim] for x in xs)
        return self.op(
            "stablehlo.concatenate", list(xs), xs[0].type.with_shape(shape), {"dimension": f"{dim} : i64"}
        )

    def pad(self, x: Value, value: Value, low: Sequence[int], high: Sequence[int], interior: Sequence[int],
            shape: Sequence | None = None) -> Value:
        if shape is None:
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
        if not (lhs.type.is_static and rhs.type.is_static) and (
                all(lhs.shape[d] == 1 for d in contract[0]) or not batch[0] and any(
                    all(side[d] == 1 for d in dims) for side, dims in ((lhs.shape, lhs_free), (rhs.shape, rhs_free)))):
            # IREE 3.13 rewrites a product with dynamic sizes whose contracting dims are none or all 1,
            # or, without batch dims, whose free dims on one side are (a Linear with one output on a
            # batch of any size and its gradient, `mv`, `dot`), into a static-only reshape it cannot
            # compile: such a product is a broadcast multiply and a sum instead. (With batch dims, a
            # decode step's one-token query, it compiles the product.)
            return self._dot_as_sum(lhs, rhs, batch, contract, lhs_free, rhs_free, out_dtype)
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

    def _dot_as_sum(self, lhs: Value, rhs: Value, batch, contract, lhs_free: list[int], rhs_free: list[int],
                    out_dtype: torch.dtype) -> Value:
        """`dot_general` as both operands broadcast to (batch, lhs free, rhs free, contracting) dims,
        multiplied in `out_dtype` and summed over the contracting dims."""
        nb, nl, nr = len(batch[0]), len(lhs_free), len(rhs_free)
        full = [lhs.shape[d] for d in batch[0]] + [lhs.shape[d] for d in lhs_free] + \
            [rhs.shape[d] for d in rhs_free] + [lhs.shape[d] for d in contract[0]]
        contracting = list(range(nb + nl + nr, len(full)))
        left = self.transpose(self.convert(lhs, out_dtype), [*batch[0], *lhs_free, *contract[0]])
        right = self.transpose(self.convert(rhs, out_dtype), [*batch[1], *rhs_free, *contract[1]])
        left = self.broadcast_in_dim(left, full, [*range(nb + nl), *contracting])
        right = self.broadcast_in_dim(right, full, [*range(nb), *range(nb + nl, nb + nl + nr), *contracting])
        product = self.binary("multiply", left, right)
        if not contracting:
            return product
        zero = self.constant(0, out_dtype)
        return self.reduce([product], [zero], contracting, lambda acc, v: [self.binary("add", acc, v)])[0]

    def reduce(
        self,
        xs: Sequence[Value],
        inits: Sequence[Value],
        dims: Sequence[int],
        body: Callable[..., Sequence[Value]],
    ) -> tuple[Value, ...]:
        """Variadic reduce over `dims`; `body(*accumulators, *elements)` gets 0-d values.

        A reduction of one tensor over its last dim and others is emitted in two: over the others first,
        then over the last. IREE 3.13's CPU code generator turns a sum over the innermost dim and a dim
        that a broadcast operand of a product is broadcast along (`(x * w).sum()` with `w` a feature
        vector, and its `mean`) into a `vector.contract` it then rejects ("invalid accumulator/result
        vector shape"): the cluster, often the whole step, could not compile and ran eagerly. The
        reduce body is associative by StableHLO's definition, so the regrouping is the same reduction."""
        dims = sorted(set(dims))
        if len(xs) == 1 and len(dims) >= 2 and dims[-1] == xs[0].rank - 1:
            (partial,) = self.reduce(xs, inits, dims[:-1], body)
            return self.reduce([partial], inits, [partial.rank - 1], body)
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


def _reassociation(groups: object) -> str:
    return "[" + ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups) + "]"  # type: ignore[attr-defined]


def i64_array(values: Sequence[int]) -> str:
    """An `array<i64: ...>` attribute (for rules that build attributes the builder has no helper for)."""
    return _i64_array(values)


__all__ += ["i64_array"]
