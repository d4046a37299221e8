"""Symbolic sizes: tensor dims that are sympy expressions over the size symbols of a step (`s0`, `s1`).

A graph traced with symbolic shapes records dims as SymInts; pydisc keeps each one as an `int` when
its expression is a number, else as the sympy expression (`Size`). Two consumers turn an expression
into code: the emitter (MLIR `arith` ops on `index` values, in `FunctionBuilder`) and the executor
(a Python function that sizes a cluster's outputs from its inputs). Both walk the same small tree
(`expression_tree`), so the set of supported functions is written once. A symbol is read at run time
from a dim of a cluster input (`SizeBindings`); an expression that cannot be built from those raises
`UnboundSizeError`, which the emitter turns into a lowering failure.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

import sympy
import torch
from torch.utils._sympy import functions as symfn

__all__ = [
    "DynamicShapeError",
    "Size",
    "SizeBindings",
    "UnboundSizeError",
    "ceil_div",
    "check_computable",
    "expression_node",
    "floor_div",
    "is_integer",
    "is_static",
    "known_multiple",
    "python_expression",
    "reshape_groups",
    "same_shape",
    "same_size",
    "size_of",
    "size_max",
    "size_min",
]

Size = Union[int, sympy.Expr]


class DynamicShapeError(ValueError):
    """A shape computation that pydisc cannot express with dynamic sizes."""


class UnboundSizeError(DynamicShapeError):
    """A size expression uses a symbol that no input of the cluster carries, or a function pydisc
    cannot compute."""


def size_of(value: object) -> Size:
    """An int for a concrete size (a SymInt whose expression is a number included), else the sympy
    expression of the SymInt. Never guards: a SymInt is never converted with int()."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    if isinstance(value, sympy.Basic):
        if value.is_Integer:
            return int(value)
        if value.is_number:
            raise UnboundSizeError(f"size {value} is not an integer")
        return value  # type: ignore[return-value]
    raise TypeError(f"expected an int or SymInt size, got {type(value).__name__}")


def is_static(shape: Sequence[Size]) -> bool:
    return all(type(d) is int for d in shape)


def same_size(a: Size, b: Size) -> bool:
    """Whether two sizes are provably equal (expression identity after expansion)."""
    if type(a) is int and type(b) is int:
        return a == b
    return a == b or sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _simplified(expr: sympy.Expr) -> Size:
    return int(expr) if expr.is_number else expr


def size_max(a: Size, b: Size) -> Size:
    if not isinstance(a, sympy.Basic) and not isinstance(b, sympy.Basic):
        return max(a, b)
    return _simplified(symfn.Max(a, b))


def size_min(a: Size, b: Size) -> Size:
    if not isinstance(a, sympy.Basic) and not isinstance(b, sympy.Basic):
        return min(a, b)
    return _simplified(symfn.Min(a, b))


def ceil_div(a: Size, b: Size) -> Size:
    if type(a) is int and type(b) is int:
        return -(-a // b)
    return _simplified(symfn.CeilDiv(a, b))


def floor_div(a: Size, b: Size) -> Size:
    if type(a) is int and type(b) is int:
        return a // b
    return _simplified(symfn.FloorDiv(a, b))


# ---- one walk over an expression, two back ends --------------------------------------------------
def is_integer(size: Size | float) -> bool:
    """Whether a size expression is an integer (else a float computed from sizes, e.g. `s0 / 4`)."""
    if isinstance(size, (int, float)):
        return type(size) is int
    return size.is_integer is True


def _operand(expr: sympy.Expr) -> Size | float:
    if expr.is_Integer:
        return int(expr)
    if expr.is_number:
        return float(expr)
    return expr


def expression_node(expr: sympy.Expr) -> tuple:
    """One level of `expr`: ("leaf", symbol) or (op, operand, ...) with op one of add, mul, floordiv,
    ceildiv, mod, max, min (on integers), float (int to float), truediv, pow (on floats), and operands
    ints, floats or expressions. Natural powers become products."""
    if expr.is_Symbol:
        return ("leaf", expr)
    args = tuple(map(_operand, expr.args))
    if isinstance(expr, sympy.Add):
        return ("add", *args)
    if isinstance(expr, sympy.Mul):
        return ("mul", *args)
    if isinstance(expr, (sympy.Pow, symfn.PowByNatural)):
        base, exponent = args
        if type(exponent) is int and exponent >= 1:
            return ("mul", *[base] * exponent)
        if type(exponent) is int and exponent < 0:
            return ("truediv", 1.0, base ** -exponent if exponent != -1 else base)
    if isinstance(expr, (symfn.FloorDiv, symfn.CleanDiv)):
        return ("floordiv", *args)
    if isinstance(expr, symfn.CeilDiv):
        return ("ceildiv", *args)
    if isinstance(expr, (symfn.Mod, symfn.PythonMod)):
        # torch's Mod is defined for non-negative operands, PythonMod floors: both are a - b*(a//b)
        return ("mod", *args)
    if isinstance(expr, symfn.Max):
        return ("max", *args)
    if isinstance(expr, symfn.Min):
        return ("min", *args)
    if isinstance(expr, symfn.Identity):
        return ("add", *args)
    if isinstance(expr, symfn.ToFloat):
        return ("float", *args)
    if isinstance(expr, (symfn.IntTrueDiv, symfn.FloatTrueDiv)):
        return ("truediv", *args)
    if isinstance(expr, symfn.FloatPow):
        return ("pow", *args)
    raise UnboundSizeError(f"size expression {expr} uses {type(expr).__name__}, which pydisc cannot compute")


def check_computable(size: Size | float) -> None:
    """Raise UnboundSizeError when `size` uses a function that neither back end computes."""
    if isinstance(size, (int, float)):
        return
    kind, *args = expression_node(size)
    if kind != "leaf":
        for a in args:
            check_computable(a)


_PYTHON_INFIX = {"add": " + ", "mul": " * ", "floordiv": " // ", "mod": " % ", "truediv": " / ", "pow": " ** "}


def python_expression(size: Size | float, leaf: Callable[[sympy.Symbol], str]) -> str:
    """Python source computing `size` (ints, or floats for float expressions); `leaf(symbol)` names
    a leaf's variable."""
    if isinstance(size, (int, float)):
        return repr(size)
    kind, *args = expression_node(size)
    if kind == "leaf":
        return leaf(args[0])
    parts = [python_expression(a, leaf) for a in args]
    if kind in _PYTHON_INFIX:
        return "(" + _PYTHON_INFIX[kind].join(parts) + ")"
    if kind == "ceildiv":
        return f"(-((-{parts[0]}) // {parts[1]}))"
    return f"{kind}({', '.join(parts)})"  # max, min, float


# ---- where sizes come from at run time -------------------------------------------------------------
@dataclass
class SizeBindings:
    """Where each size can be read at run time: an expression that is a dim of a cluster input maps to
    (input position, dim). Symbols map directly; a compound dim (an input of size `s0*s1`) gets a
    stand-in symbol that expressions are rewritten over (`2*s0*s1` -> `2*d0`)."""

    leaves: dict[sympy.Symbol, tuple[int, int]] = field(default_factory=dict)
    _compound: dict[sympy.Expr, sympy.Symbol] = field(default_factory=dict)
    _names: itertools.count = field(default_factory=itertools.count)

    def add(self, size: Size, position: int, dim: int) -> None:
        if type(size) is int:
            return
        if size.is_Symbol:
            self.leaves.setdefault(size, (position, dim))
        elif size not in self._compound:
            stand_in = sympy.Symbol(f"pydisc_dim{next(self._names)}", integer=True, positive=True)
            self._compound[size] = stand_in
            self.leaves[stand_in] = (position, dim)

    def expression(self, leaf: sympy.Symbol) -> Size:
        """What a bound leaf stands for: itself, or the compound dim a stand-in names."""
        for compound, stand_in in self._compound.items():
            if stand_in == leaf:
                return compound
        return leaf

    def resolve(self, size: Size) -> Size:
        """`size` rewritten over bound leaves only; UnboundSizeError when that is impossible."""
        if type(size) is int or size in self.leaves:
            return size
        if size in self._compound:
            return self._compound[size]
        expr = size
        if not expr.free_symbols <= self.leaves.keys():
            # largest compound dims first: `s0*s1*s2` before `s0*s1`
            for compound in sorted(self._compound, key=lambda e: -len(e.free_symbols)):
                if compound.free_symbols <= expr.free_symbols:
                    expr = expr.subs(compound, self._compound[compound])
        missing = expr.free_symbols - self.leaves.keys()
        if missing:
            # a part of a compound dim: `s0` from an input of `32*s0` (a reduction split by 32) is that
            # dim // 32, exactly
            for compound, stand_in in self._compound.items():
                factor, part = compound.as_coeff_Mul()
                if factor.is_Integer and factor > 1 and part.free_symbols <= missing and part in expr.atoms(type(part)):
                    expr = expr.subs(part, symfn.FloorDiv(stand_in, int(factor)))
            missing = expr.free_symbols - self.leaves.keys()
        if missing:
            # a symbol from a dim that is it times a number plus a constant: `s0` from an input of `s0 + 1`
            # (an attention mask one column longer) is that dim - 1; from `2*s0 + 1`, (dim - 1) // 2, exactly
            for compound, stand_in in self._compound.items():
                constant, term = compound.as_coeff_Add()
                factor, part = term.as_coeff_Mul()
                if constant.is_Integer and constant != 0 and factor.is_Integer and factor > 0 and \
                        part.is_Symbol and part in missing:
                    shifted = stand_in - int(constant)
                    expr = expr.subs(part, shifted if factor == 1 else symfn.FloorDiv(shifted, int(factor)))
                    missing = expr.free_symbols - self.leaves.keys()
        if missing:
            raise UnboundSizeError(
                f"size {size} needs {', '.join(sorted(map(str, missing)))}, which no tensor input of the "
                "cluster has as a dim"
            )
        return expr


def known_multiple(size: Size, multiples: Mapping[sympy.Symbol, int]) -> int:
    """The largest number `size` is known to be a multiple of at run time: its constant factors
    (`32*s0`: 32), times what each symbol is guaranteed a multiple of (`multiples`: a template's,
    guarded, driver/dynamic.size_multiples). 1 where nothing is known."""
    if type(size) is int:
        return abs(size) or 1
    if size.is_Integer:
        return abs(int(size)) or 1
    if size.is_Symbol:
        return multiples.get(size, 1)
    if size.is_Mul:
        return math.prod(known_multiple(a, multiples) for a in size.args)
    if size.is_Add:
        return math.gcd(*(known_multiple(a, multiples) for a in size.args))
    if size.is_Pow and size.exp.is_Integer and size.exp > 0:
        return known_multiple(size.base, multiples) ** int(size.exp)
    return 1


def same_shape(a: Sequence[Size], b: Sequence[Size]) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


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
