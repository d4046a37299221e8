"""The registry of lowering rules: one rule per ATen op, registered next to its implementation.

A rule receives a `LoweringContext` and the op's arguments with every tensor argument already replaced
by its IR `Value`; Python scalars, int lists, dtypes and None pass through unchanged. It returns the
result `Value` (or a tuple of them for multi-output ops). Shapes and dtypes of results come from the
recorded FX metadata (`ctx.out`), never from looking at emitted text.

Dynamic dims (sympy expressions, from a graph traced with symbolic sizes) reach a rule only if it was
registered with `dynamic=True`: it then builds shapes through the builder's helpers and may receive
sizes (int arguments such as a slice bound) as sympy expressions. For any other rule, a node with a
dynamic dim or a symbolic argument is unsupported, so the partitioner leaves it to eager execution.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._prims  # noqa: F401  (registers the prims ops some decompositions emit)
from torch._ops import OpOverload

from pydisc.frontend.lowering.builder import FunctionBuilder, TensorSpec
from pydisc.frontend.lowering.size_exprs import size_of

__all__ = [
    "DYNAMIC_RULES", "LOWERINGS", "SUPPORT_CHECKS", "LoweringContext", "LoweringError", "Rule", "lowering", "spec_of",
    "support_check",
]


class LoweringError(Exception):
    """An op that the emitter cannot lower; `op` names it so callers can fall back to eager for it."""

    def __init__(self, op: object, message: str) -> None:
        self.op = op
        super().__init__(f"cannot lower {op}: {message}")


@dataclass(frozen=True)
class LoweringContext:
    builder: FunctionBuilder
    node: torch.fx.Node
    out: tuple[TensorSpec, ...]  # one spec per result, from the node's FakeTensor metadata

    @property
    def out_spec(self) -> TensorSpec:
        return self.out[0]

    @property
    def out_dtype(self) -> torch.dtype:
        return self.out[0].dtype


Rule = Callable[..., Any]

LOWERINGS: dict[OpOverload, Rule] = {}
# Ops whose rule handles dynamic dims and symbolic size arguments.
DYNAMIC_RULES: set[OpOverload] = set()


def lowering(*ops: OpOverload, dynamic: bool = False) -> Callable[[Rule], Rule]:
    """Register `rule` for each of `ops`; `dynamic=True` if it handles dynamic dims."""

    def register(rule: Rule) -> Rule:
        for op in ops:
            LOWERINGS[op] = rule
            if dynamic:
                DYNAMIC_RULES.add(op)
            else:
                DYNAMIC_RULES.discard(op)
        return rule

    return register


SupportCheck = Callable[[torch.fx.Node], "str | None"]

# Rule-specific limits, checked before lowering so the partitioner can leave such nodes to eager.
SUPPORT_CHECKS: dict[OpOverload, SupportCheck] = {}


def support_check(*ops: OpOverload) -> Callable[[SupportCheck], SupportCheck]:
    """Register `check(node) -> reason | None` for each of `ops`."""

    def register(check: SupportCheck) -> SupportCheck:
        for op in ops:
            SUPPORT_CHECKS[op] = check
        return check

    return register


def spec_of(val: object) -> TensorSpec:
    """The spec of a FakeTensor (or real tensor) from `node.meta["val"]`."""
    if not isinstance(val, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(val).__name__}")
    return TensorSpec(tuple(size_of(d) for d in val.shape), val.dtype)
