"""Lowering rules from core ATen to StableHLO; importing this package registers every rule."""
from __future__ import annotations

from pydisc.frontend.lowering import (  # noqa: F401  (imported for their registrations)
    elementwise,
    indexing,
    linalg,
    nn,
    reductions,
    shape,
    sorting,
)
from pydisc.frontend.lowering.builder import FunctionBuilder, TensorSpec, Value
from pydisc.frontend.lowering.registry import LOWERINGS, LoweringContext, LoweringError, lowering

__all__ = ["LOWERINGS", "FunctionBuilder", "LoweringContext", "LoweringError", "TensorSpec", "Value", "lowering"]
