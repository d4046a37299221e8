"""Runtime sizes inside a function under construction (a mixin of `FunctionBuilder`).

A size symbol is read where it lives, a dim of a function argument (`tensor.dim`); any size expression
is built from those with `arith` ops on `index` values (`size_exprs.expression_node` says which), once per
expression: the value is cached, except that a region's own computations are forgotten after it. Shapes
become `tensor<Nxindex>` operands of the dynamic ops; a size used as a number (a mean's count) becomes a
0-d tensor, computed in float64 when it is a float expression of sizes.
"""
from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch

from pydisc.frontend.lowering.size_exprs import (
    Size,
    SizeBindings,
    UnboundSizeError,
    expression_node,
    is_integer,
    known_multiple,
)
from pydisc.frontend.lowering.values import IndexTensor, TensorSpec, Value

__all__ = ["RuntimeSizes"]

_INDEX_OPS = {"add": "addi", "mul": "muli", "floordiv": "floordivsi", "ceildiv": "ceildivsi", "max": "maxsi", "min": "minsi"}


class RuntimeSizes:
    """Size computations of `FunctionBuilder`; uses its `line`, `fresh`, `_fresh_name`, `constant`,
    `convert` and `binary`."""

    def _init_sizes(self) -> None:
        self._bindings = SizeBindings()
        self._arguments: dict[int, Value] = {}
        self._sizes: dict[object, object] = {}  # size -> index name; ("i64", size) -> 0-d Value
        self._shapes: dict[tuple[Size, ...], IndexTensor] = {}
        # symbol -> what its value is guaranteed a multiple of at run time (a template's guard); None:
        # nothing is told to IREE about the sizes
        self.multiples: dict[sympy.Symbol, int] | None = None

    def _save_sizes(self) -> tuple[dict, dict]:
        return dict(self._sizes), dict(self._shapes)

    def _restore_sizes(self, saved: tuple[dict, dict]) -> None:
        self._sizes, self._shapes = saved

    def bind_argument(self, position: int, value: Value) -> None:
        """Make the dynamic dims of function argument `value` (input `position`) readable as sizes."""
        self._arguments[position] = value
        for dim, size in enumerate(value.shape):
            self._bindings.add(size, position, dim)

    def bind_index_argument(self, position: int, name: str, size: Size) -> None:
        """Function argument `name` (input `position`) is an `index` equal to `size` at run time."""
        self._arguments[position] = name
        self._bindings.add(size, position, None)

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
                if dim is None:      # an `index` argument
                    name = argument
                else:
                    dim_index = self.index(dim)
                    name = self._fresh_name()
                    self.line(f"{name} = tensor.dim {argument.name}, {dim_index} : {argument.type}")
                    multiple = 1 if self.multiples is None else \
                        known_multiple(self._bindings.expression(resolved), self.multiples)
                    if multiple > 1:
                        # IREE reads a dim off a buffer at run time and knows nothing of it: told that it
                        # is a multiple (of a static factor, `32*s0`, or of a guarded one), its GPU code
                        # for the dispatches over it is vectorized (8 elements a thread instead of 1)
                        assumed = self._fresh_name()
                        self.line(f"{assumed} = util.assume.int {name}<udiv = {multiple}> : index")
                        name = assumed
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
