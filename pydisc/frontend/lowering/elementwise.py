"""Elementwise ops: one family of rules built with functools.partial.

Every rule follows torch's semantics: operands are promoted to the node's result dtype (taken from the
recorded metadata, so torch's own type promotion decides, including the rule that a Python scalar does
not widen a tensor), Python scalars become constants, and operands broadcast numpy-style. float16 and
bfloat16 are computed in float32 and rounded once at the end, as torch's CPU kernels do.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cache, partial

import mpmath
import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from pydisc.frontend.lowering.builder import FunctionBuilder, Value
from pydisc.frontend.lowering.registry import LoweringContext, lowering, support_check

__all__ = ["as_operand", "compute_dtype", "promoted_dtype"]

aten = torch.ops.aten
prims = torch.ops.prims
_LOW_PRECISION = (torch.float16, torch.bfloat16)
Scalar = float | int | bool


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def promoted_dtype(*args: Value | Scalar | None) -> torch.dtype:
    """torch's result dtype for operands; a 0-d Value ranks below a dimensioned one, as in torch."""
    proxies = [
        torch.empty((0,) if a.rank else (), dtype=a.dtype) if isinstance(a, Value)
        else (0 if a.is_integer else 0.0) if isinstance(a, sympy.Basic) else a  # a size used as a number
        for a in args
        if a is not None
    ]
    return elementwise_dtypes(*proxies, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


def as_operand(b: FunctionBuilder, x: Value | Scalar, dtype: torch.dtype, shape: tuple[int, ...]) -> Value:
    if isinstance(x, Value):
        return b.broadcast_to(b.convert(x, dtype), shape)
    return b.full(shape, x, dtype)


Emit = Callable[..., Value]


def _arith(ctx: LoweringContext, *args: Value | Scalar, emit: Emit) -> Value:
    b = ctx.builder
    dtype = compute_dtype(ctx.out_dtype)
    operands = [as_operand(b, a, dtype, ctx.out_spec.shape) for a in args]
    return b.convert(emit(b, *operands), ctx.out_dtype)


def _binary(name: str) -> Emit:
    return lambda b, x, y: b.binary(name, x, y)


def _unary(name: str) -> Emit:
    return lambda b, x: b.unary(name, x)


def _float_only(name: str) -> Emit:
    # floor/ceil/round of an integer tensor is the tensor itself.
    return lambda b, x: b.unary(name, x) if x.dtype.is_floating_point else x


def _chlo(name: str) -> Emit:
    return lambda b, x: b.op(f"chlo.{name}", [x], x.type)


def _reciprocal(b: FunctionBuilder, x: Value) -> Value:
    return b.binary("divide", b.full(x.shape, 1, x.dtype), x)


def _relu(b: FunctionBuilder, x: Value) -> Value:
    return b.binary("maximum", x, b.full(x.shape, 0, x.dtype))


def _sign(b: FunctionBuilder, x: Value) -> Value:
    if x.dtype in (torch.bool, torch.uint8):
        return b.convert(b.convert(x, torch.bool), x.dtype)
    return b.unary("sign", x)


def _isnan(b: FunctionBuilder, x: Value) -> Value:
    return b.compare("NE", x, x)


_UNARY: dict[object, Emit] = {
    aten.neg.default: _unary("negate"),
    aten.abs.default: lambda b, x: x if x.dtype in (torch.uint8, torch.bool) else b.unary("abs", x),
    aten.exp.default: _unary("exponential"),
    aten.expm1.default: _unary("exponential_minus_one"),
    aten.log.default: _unary("log"),
    aten.log1p.default: _unary("log_plus_one"),
    aten.sqrt.default: _unary("sqrt"),
    aten.rsqrt.default: _unary("rsqrt"),
    aten.tanh.default: _unary("tanh"),
    aten.sigmoid.default: _unary("logistic"),
    aten.sin.default: lambda b, x: _periodic(b, x, "sine"),
    aten.cos.default: lambda b, x: _periodic(b, x, "cosine"),
    aten.tan.default: _chlo("tan"),
    aten.erf.default: _chlo("erf"),
    aten.asin.default: _chlo("asin"),
    aten.acos.default: _chlo("acos"),
    aten.atan.default: _chlo("atan"),
    aten.sinh.default: _chlo("sinh"),
    aten.cosh.default: _chlo("cosh"),
    aten.asinh.default: _chlo("asinh"),
    aten.acosh.default: _chlo("acosh"),
    aten.atanh.default: _chlo("atanh"),
    aten.floor.default: _float_only("floor"),
    aten.ceil.default: _float_only("ceil"),
    aten.round.default: _float_only("round_nearest_even"),
    aten.sign.default: _sign,
    aten.reciprocal.default: _reciprocal,
    aten.relu.default: _relu,
    aten.bitwise_not.default: _unary("not"),
}
for _op, _emit in _UNARY.items():
    lowering(_op, dynamic=True)(partial(_arith, emit=_emit))


def _periodic(b: FunctionBuilder, x: Value, name: str) -> Value:
    """sin/cos of float32 with the argument reduced to [-pi, pi] first, as torch's kernels (SLEEF on the
    CPU, CUDA's sinf) do for every float32: IREE's float32 sine and cosine reduce large arguments poorly
    (sin(1e5) off by 3e-3, sin(1e10) = -6e21).

    The reduction is Payne-Hanek's in float64: 1/(2 pi) is split into pieces of at most 24 bits, so that
    x times a piece is exact in float64 and so is its fractional part; the fractional parts sum to
    frac(x / (2 pi)) within ~1e-15 for every float32 x, up to 3.4e38 (a single float64 division runs out
    of bits beyond ~1e15)."""
    if x.dtype != torch.float32:
        return b.unary(name, x)
    turns = fraction_of_product(b, b.convert(x, torch.float64), _inverse_two_pi_pieces())
    reduced = b.binary("multiply", turns, b.full(x.shape, 2 * math.pi, torch.float64))
    return b.unary(name, b.convert(reduced, torch.float32))


def fraction_of_product(b: FunctionBuilder, wide: Value, pieces: Sequence[float]) -> Value:
    """x * c mod 1, in [-1/2, 1/2], for a float64 `wide` that holds a float32 x and a constant c given as
    `pieces` of at most 24 bits each (`constant_pieces`): every product is exact in float64, and so is
    its fractional part."""
    turns = None
    for piece in pieces:
        product = b.binary("multiply", wide, b.full(wide.shape, piece, torch.float64))
        fraction = b.binary("subtract", product, b.unary("round_nearest_even", product))
        turns = fraction if turns is None else b.binary("add", turns, fraction)
    return b.binary("subtract", turns, b.unary("round_nearest_even", turns))


def constant_pieces(value: Callable[[], mpmath.mpf], bits: int = 216, chunk: int = 24) -> tuple[float, ...]:
    """`value()` (an mpmath expression, below 1) to `bits` bits, as float64 pieces of `chunk` bits. 216
    bits: the last pieces reach 2^-216, enough for a float32 of up to 2^128 with ~60 fraction bits left."""
    with mpmath.workprec(bits + 32):
        scaled = int(mpmath.floor(mpmath.ldexp(value(), bits)))
    return tuple(math.ldexp((scaled >> (bits - chunk * i)) & ((1 << chunk) - 1), -chunk * i)
                 for i in range(1, bits // chunk + 1))


@cache
def _inverse_two_pi_pieces() -> tuple[float, ...]:
    return constant_pieces(lambda: 1 / (2 * mpmath.pi))


def _trunc_emit(b: FunctionBuilder, x: Value) -> Value:
    return _trunc(b, x) if x.dtype.is_floating_point else x


lowering(aten.trunc.default, prims.trunc.default, dynamic=True)(partial(_arith, emit=_trunc_emit))


def _log2(b: FunctionBuilder, x: Value) -> Value:
    return b.binary("divide", b.unary("log", x), b.full(x.shape, 0.6931471805599453, x.dtype))


def _log10(b: FunctionBuilder, x: Value) -> Value:
    return b.binary("divide", b.unary("log", x), b.full(x.shape, 2.302585092994046, x.dtype))


def _exp2(b: FunctionBuilder, x: Value) -> Value:
    return b.binary("power", b.full(x.shape, 2, x.dtype), x)


lowering(aten.log2.default, dynamic=True)(partial(_arith, emit=_log2))
lowering(aten.log10.default, dynamic=True)(partial(_arith, emit=_log10))
lowering(aten.exp2.default, dynamic=True)(partial(_arith, emit=_exp2))

_BINARY: dict[object, Emit] = {
    aten.mul.Tensor: _binary("multiply"),
    aten.mul.Scalar: _binary("multiply"),
    aten.maximum.default: _binary("maximum"),
    aten.minimum.default: _binary("minimum"),
    prims.maximum.default: _binary("maximum"),
    prims.minimum.default: _binary("minimum"),
    aten.bitwise_and.Tensor: _binary("and"),
    aten.bitwise_and.Scalar: _binary("and"),
    aten.bitwise_or.Tensor: _binary("or"),
    aten.bitwise_or.Scalar: _binary("or"),
    aten.bitwise_xor.Tensor: _binary("xor"),
    aten.bitwise_xor.Scalar: _binary("xor"),
    aten.fmod.Tensor: _binary("remainder"),
    aten.fmod.Scalar: _binary("remainder"),
    prims.mul.default: _binary("multiply"),
    prims.add.default: _binary("add"),
    prims.sub.default: _binary("subtract"),
}
for _op, _emit in _BINARY.items():
    lowering(_op, dynamic=True)(partial(_arith, emit=_emit))


def _signbit(b: FunctionBuilder, x: Value) -> Value:
    zero = b.full(x.shape, 0, x.dtype)
    negative_zero = b.binary("and", b.compare("EQ", x, zero), b.compare("LT", _reciprocal(b, x), zero))
    return b.binary("or", b.compare("LT", x, zero), negative_zero)


def _atan2(b: FunctionBuilder, y: Value, x: Value) -> Value:
    # IREE's atan2 gives NaN for two zeros or two infinities and loses the sign of y = -0: take its
    # magnitude, fix those cases as C's atan2 defines them, and give the result the sign of y.
    shape, dtype = x.shape, x.dtype
    zero, inf = b.full(shape, 0, dtype), b.full(shape, math.inf, dtype)
    x_negative = _signbit(b, x)
    both_zero = b.binary("and", b.compare("EQ", y, zero), b.compare("EQ", x, zero))
    both_inf = b.binary("and", b.compare("EQ", b.unary("abs", y), inf), b.compare("EQ", b.unary("abs", x), inf))
    magnitude = b.unary("abs", b.binary("atan2", y, x))
    magnitude = b.select(both_zero, b.select(x_negative, b.full(shape, math.pi, dtype), zero), magnitude)
    corner = b.select(x_negative, b.full(shape, 0.75 * math.pi, dtype), b.full(shape, 0.25 * math.pi, dtype))
    magnitude = b.select(both_inf, corner, magnitude)
    return b.select(_signbit(b, y), b.unary("negate", magnitude), magnitude)


lowering(aten.atan2.default, dynamic=True)(partial(_arith, emit=_atan2))


@lowering(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor, aten.rsub.Scalar, dynamic=True)
def _add_sub(ctx: LoweringContext, x: Value | Scalar, y: Value | Scalar, alpha: Scalar = 1) -> Value:
    op = ctx.node.target
    name = "add" if op in (aten.add.Tensor, aten.add.Scalar) else "subtract"
    if op in (aten.rsub.Tensor, aten.rsub.Scalar):
        x, y = y, x

        def emit(b: FunctionBuilder, y_: Value, x_: Value) -> Value:
            scaled = x_ if alpha == 1 else b.binary("multiply", x_, b.full(x_.shape, alpha, x_.dtype))
            return b.binary(name, y_, scaled)

        return _arith(ctx, y, x, emit=emit)

    def emit(b: FunctionBuilder, x_: Value, y_: Value) -> Value:
        if x_.dtype == torch.bool:  # bool + bool saturates to True in torch; i1 addition would wrap
            return b.binary("or", x_, y_)
        scaled = y_ if alpha == 1 else b.binary("multiply", y_, b.full(y_.shape, alpha, y_.dtype))
        return b.binary(name, x_, scaled)

    return _arith(ctx, x, y, emit=emit)


def _floor_divide_int(b: FunctionBuilder, x: Value, y: Value) -> Value:
    # StableHLO integer division truncates; floor it when the signs differ and it is inexact.
    quotient = b.binary("divide", x, y)
    zero = b.full(x.shape, 0, x.dtype)
    inexact = b.compare("NE", b.binary("remainder", x, y), zero)
    signs_differ = b.compare("NE", b.compare("LT", x, zero), b.compare("LT", y, zero))
    adjust = b.binary("and", inexact, signs_differ)
    return b.select(adjust, b.binary("subtract", quotient, b.full(x.shape, 1, x.dtype)), quotient)


def _floor_divide_float(b: FunctionBuilder, x: Value, y: Value) -> Value:
    # torch's div_floor_floating: floor((x - fmod(x, y)) / y), corrected so that the result is exact.
    zero = b.full(x.shape, 0, x.dtype)
    one = b.full(x.shape, 1, x.dtype)
    mod = b.binary("remainder", x, y)
    div = b.binary("divide", b.binary("subtract", x, mod), y)
    fix = b.binary("and", b.compare("NE", mod, zero), b.compare("NE", b.compare("LT", y, zero), b.compare("LT", mod, zero)))
    div = b.select(fix, b.binary("subtract", div, one), div)
    floored = b.unary("floor", div)
    round_up = b.compare("GT", b.binary("subtract", div, floored), b.full(x.shape, 0.5, x.dtype))
    floored = b.select(round_up, b.binary("add", floored, one), floored)
    # y == 0: plain division gives torch's inf/nan.
    return b.select(b.compare("EQ", y, zero), b.binary("divide", x, y), floored)


def _trunc(b: FunctionBuilder, x: Value) -> Value:
    negative = b.compare("LT", x, b.full(x.shape, 0, x.dtype))
    return b.select(negative, b.unary("ceil", x), b.unary("floor", x))


def _divide(b: FunctionBuilder, x: Value, y: Value, rounding_mode: str | None) -> Value:
    if rounding_mode is None or (rounding_mode == "trunc" and not x.dtype.is_floating_point):
        return b.binary("divide", x, y)
    if rounding_mode == "trunc":
        return _trunc(b, b.binary("divide", x, y))
    if x.dtype.is_floating_point:
        return _floor_divide_float(b, x, y)
    return _floor_divide_int(b, x, y)


@lowering(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default, dynamic=True)
def _div(ctx: LoweringContext, x: Value | Scalar, y: Value | Scalar, *, rounding_mode: str | None = None) -> Value:
    if ctx.node.target is aten.floor_divide.default:
        rounding_mode = "floor"
    return _arith(ctx, x, y, emit=partial(_divide, rounding_mode=rounding_mode))


@lowering(prims.div.default, dynamic=True)
def _prims_div(ctx: LoweringContext, x: Value, y: Value) -> Value:
    # prims.div truncates for integers and is true division for floats: StableHLO's divide exactly.
    return _arith(ctx, x, y, emit=_binary("divide"))


def _remainder_emit(b: FunctionBuilder, x: Value, y: Value) -> Value:
    # Python-style modulo: the result takes the sign of the divisor.
    rem = b.binary("remainder", x, y)
    zero = b.full(x.shape, 0, x.dtype)
    fix = b.binary("and", b.compare("NE", rem, zero), b.compare("NE", b.compare("LT", rem, zero), b.compare("LT", y, zero)))
    return b.select(fix, b.binary("add", rem, y), rem)


lowering(aten.remainder.Tensor, aten.remainder.Scalar, dynamic=True)(partial(_arith, emit=_remainder_emit))


def _pow_emit(b: FunctionBuilder, x: Value, y: Value) -> Value:
    """C's pow for floats: IREE computes power as exp(y * log(x)), NaN for a negative base and for 0**0,
    so take |x|, restore the sign for odd integer exponents, and pin x**0 = 1**y = 1."""
    if not x.dtype.is_floating_point:
        return b.binary("power", x, y)
    shape, dtype = x.shape, x.dtype
    zero, one, two = (b.full(shape, v, dtype) for v in (0, 1, 2))
    magnitude = b.binary("power", b.unary("abs", x), y)
    integral = b.compare("EQ", b.unary("floor", y), y)
    odd = b.compare("NE", b.binary("subtract", y, b.binary("multiply", b.unary("floor", b.binary("divide", y, two)), two)), zero)
    signed = b.select(odd, b.unary("negate", magnitude), magnitude)
    negative_base = b.select(integral, signed, b.full(shape, float("nan"), dtype))
    result = b.select(b.compare("LT", x, zero), negative_base, magnitude)
    result = b.select(b.compare("EQ", y, zero), one, result)
    return b.select(b.compare("EQ", x, one), one, result)


@lowering(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, dynamic=True)
def _pow(ctx: LoweringContext, x: Value | Scalar, y: Value | Scalar) -> Value:
    if not isinstance(y, Value) and y == 2:
        return _arith(ctx, x, emit=lambda b, v: b.binary("multiply", v, v))
    if not isinstance(y, Value) and y == 0.5 and ctx.out_dtype.is_floating_point:
        return _arith(ctx, x, emit=_unary("sqrt"))
    return _arith(ctx, x, y, emit=_pow_emit)


@lowering(aten.clamp.default, aten.clamp.Tensor, dynamic=True)
def _clamp(ctx: LoweringContext, x: Value, min: Value | Scalar | None = None, max: Value | Scalar | None = None) -> Value:
    b = ctx.builder
    dtype = compute_dtype(ctx.out_dtype)
    shape = ctx.out_spec.shape
    result = as_operand(b, x, dtype, shape)
    if min is not None:
        result = b.binary("maximum", result, as_operand(b, min, dtype, shape))
    if max is not None:
        result = b.binary("minimum", result, as_operand(b, max, dtype, shape))
    return b.convert(result, ctx.out_dtype)


@lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, prims.where.default, dynamic=True)
def _where(ctx: LoweringContext, cond: Value, x: Value | Scalar, y: Value | Scalar) -> Value:
    b = ctx.builder
    shape = ctx.out_spec.shape
    pred = b.broadcast_to(b.convert(cond, torch.bool), shape)
    return b.select(pred, as_operand(b, x, ctx.out_dtype, shape), as_operand(b, y, ctx.out_dtype, shape))


def _compare(ctx: LoweringContext, x: Value | Scalar, y: Value | Scalar, *, direction: str) -> Value:
    b = ctx.builder
    dtype = promoted_dtype(x, y)
    shape = ctx.out_spec.shape
    return b.compare(direction, as_operand(b, x, dtype, shape), as_operand(b, y, dtype, shape))


for _name, _direction in {"eq": "EQ", "ne": "NE", "lt": "LT", "le": "LE", "gt": "GT", "ge": "GE"}.items():
    _packet = getattr(aten, _name)
    lowering(_packet.Tensor, _packet.Scalar, dynamic=True)(partial(_compare, direction=_direction))


def _logical(ctx: LoweringContext, *args: Value | Scalar, name: str) -> Value:
    b = ctx.builder
    shape = ctx.out_spec.shape
    operands = [as_operand(b, a, torch.bool, shape) for a in args]
    result = b.unary("not", operands[0]) if name == "not" else b.binary(name, *operands)
    return b.convert(result, ctx.out_dtype)


lowering(aten.logical_and.default, dynamic=True)(partial(_logical, name="and"))
lowering(aten.logical_or.default, dynamic=True)(partial(_logical, name="or"))
lowering(aten.logical_xor.default, dynamic=True)(partial(_logical, name="xor"))
lowering(aten.logical_not.default, dynamic=True)(partial(_logical, name="not"))


@lowering(aten.isnan.default, dynamic=True)
def _isnan_rule(ctx: LoweringContext, x: Value) -> Value:
    b = ctx.builder
    if not x.dtype.is_floating_point:
        return b.full(x.shape, False, torch.bool)
    return _isnan(b, x)


@lowering(aten.isinf.default, dynamic=True)
def _isinf(ctx: LoweringContext, x: Value) -> Value:
    b = ctx.builder
    if not x.dtype.is_floating_point:
        return b.full(x.shape, False, torch.bool)
    return b.compare("EQ", b.unary("abs", x), b.full(x.shape, float("inf"), x.dtype))


# IREE's llvm-cpu backend links no float64 fmod/tanh/sin/cos/tan/atan2 (checked with IREE 3.13:
# "iree-lld: undefined symbol"), so these stay eager in float64.
_NO_F64 = (
    aten.remainder.Tensor, aten.remainder.Scalar, aten.fmod.Tensor, aten.fmod.Scalar, aten.tanh.default,
    aten.sin.default, aten.cos.default, aten.tan.default, aten.atan2.default, aten.floor_divide.default,
    aten.div.Tensor_mode, aten.div.Scalar_mode, aten.asin.default, aten.acos.default, aten.atan.default,
    aten.sinh.default, aten.cosh.default, aten.asinh.default, aten.acosh.default, aten.atanh.default,
)


@support_check(*_NO_F64)
def _float64_libm(node: torch.fx.Node) -> str | None:
    if node.target in (aten.div.Tensor_mode, aten.div.Scalar_mode) and node.kwargs.get("rounding_mode") != "floor":
        return None
    vals = [node.meta["val"], *(n.meta["val"] for n in node.all_input_nodes)]
    if any(v.dtype == torch.float64 for v in vals):
        return f"{node.target} in float64 (IREE's CPU backend has no float64 implementation)"
    return None


# prims.round (what torch's decomposition of round(x, decimals=d) calls) rounds half to even like aten.round.
lowering(prims.round.default, dynamic=True)(partial(_arith, emit=_float_only("round_nearest_even")))


def _tan(b: FunctionBuilder, x: Value) -> Value:
    """tan of float32 as accurate as torch's: IREE's float32 tan is ~5e-5 relative off even for small
    arguments (tan(-0.0011963408) = -0.0011964011), ~1e-5 near the poles.

    x / pi is reduced mod 1 in float64 (Payne-Hanek: 1/pi in 24-bit pieces, each product with a float32
    exact in float64, their fractional parts summed) to t in [-1/2, 1/2]; for |t| <= 1/4, tan(x) =
    sin(r) / cos(r) with r = pi t, else -cos(r) / sin(r) with r = pi (t -+ 1/2), |r| <= pi/4, where
    sin and cos are their Taylor series in float64 (7 terms: below 1e-13 on [-pi/4, pi/4])."""
    if x.dtype != torch.float32:
        return b.op("chlo.tan", [x], x.type)
    f64 = torch.float64
    wide = b.convert(x, f64)
    turns = None
    for piece in _inverse_pi_pieces():
        product = b.binary("multiply", wide, b.full(x.shape, piece, f64))
        fraction = b.binary("subtract", product, b.unary("round_nearest_even", product))
        turns = fraction if turns is None else b.binary("add", turns, fraction)
    turns = b.binary("subtract", turns, b.unary("round_nearest_even", turns))   # x / pi mod 1, in [-1/2, 1/2]
    far = b.compare("GT", b.unary("abs", turns), b.full(x.shape, 0.25, f64))
    half = b.select(b.compare("GT", turns, b.full(x.shape, 0, f64)), b.full(x.shape, 0.5, f64),
                    b.full(x.shape, -0.5, f64))
    near = b.select(far, b.binary("subtract", turns, half), turns)           # in [-1/4, 1/4]
    r = b.binary("multiply", near, b.full(x.shape, math.pi, f64))
    square = b.binary("multiply", r, r)

    def series(denominators: list[int]) -> Value:   # Horner: 1 - r^2/d1 (1 - r^2/d2 (1 - ...))
        total = b.full(x.shape, 1.0, f64)
        for d in reversed(denominators):
            term = b.binary("multiply", square, b.full(x.shape, 1.0 / d, f64))
            total = b.binary("subtract", b.full(x.shape, 1.0, f64), b.binary("multiply", term, total))
        return total

    sine = series([(2 * k) * (2 * k + 1) for k in range(1, 8)])      # sin(r) / r
    cosine = series([(2 * k - 1) * (2 * k) for k in range(1, 8)])
    sine = b.binary("multiply", r, sine)
    tangent = b.binary("divide", sine, cosine)
    cotangent = b.unary("negate", b.binary("divide", cosine, sine))
    return b.convert(b.select(far, cotangent, tangent), torch.float32)


def _inverse_pi_pieces() -> tuple[float, ...]:
    """1/pi to 216 bits as nine float64 pieces of 24 bits (a float32 up to 2^128 times a piece is exact
    in float64, and the last pieces reach far enough below 2^-128 to leave ~60 correct fraction bits)."""
    bits, chunk = 216, 24
    scaled = _INVERSE_PI_BITS
    return tuple(math.ldexp((scaled >> (bits - chunk * i)) & ((1 << chunk) - 1), -chunk * i)
                 for i in range(1, bits // chunk + 1))


def _inverse_pi_bits(bits: int) -> int:
    """floor(2^bits / pi), by Machin's formula in integer arithmetic (pi = 16 atan(1/5) - 4 atan(1/239))."""
    guard = bits + 32
    one = 1 << guard

    def arctan_inverse(n: int) -> int:
        total, term, k, sign = 0, one // n, 1, 1
        while term:
            total += sign * (term // k)
            term //= n * n
            k += 2
            sign = -sign
        return total

    pi = 16 * arctan_inverse(5) - 4 * arctan_inverse(239)
    return (one << bits) // pi


_INVERSE_PI_BITS = _inverse_pi_bits(216)
lowering(aten.tan.default, dynamic=True)(partial(_arith, emit=_tan))
