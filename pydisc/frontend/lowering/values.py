"""The values a function under construction deals in: tensor types (`TensorSpec`, printed as MLIR
types, dims static ints or sympy size expressions printed `?`), SSA values (`Value`) and the 1-D index
tensors that carry runtime shapes (`IndexTensor`)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pydisc.frontend.lowering.size_exprs import Size, is_static, size_of

__all__ = ["ELEMENT_TYPES", "IndexTensor", "TensorSpec", "Value", "element_type", "is_float", "is_signed_int"]

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
