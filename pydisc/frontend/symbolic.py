"""Recording a step with symbolic sizes: the template that one dynamic-shape plan is built from.

A step whose inputs have dynamic dims is recorded once with torch's symbolic shapes: those dims are
`SymInt`s of a `ShapeEnv` (one fresh env per template), output metadata comes from `FakeTensorMode` on
the same env, the Python dispatcher keeps C++ kernels such as `matmul` from specialising sizes, and a
dispatch mode catches factory ops (`torch.arange(T)`) whose sizes derive from a dynamic dim. Arguments
recorded as `SymInt` keep their expression (`view(x, [2*s0, 64])`), so the plan knows which ints
depend on which input size. This costs milliseconds per op, so it happens once per template; later
steps are recorded concretely and matched against the template (`pydisc/driver/dynamic.py`).

Symbols are named by their source: the `ordinal`-th tensor made lazy in the step (a module input or a
`pydisc.to_lazy` call) or the `index`-th eager tensor the step reads, and a dim.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
from torch._C import DispatchKey
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PythonMod, TruncToInt
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from .layout import hint, is_symbolic
from .tensor import LazyTensor

__all__ = ["SymbolicStep", "SymArg", "SymExpr", "is_symbolic", "hint", "evaluate", "python_evaluator",
           "release_factory_mode", "own_modes"]


class SymArg:
    """A SymInt/SymFloat argument of a recorded op (its expression is read at planning time, after
    every guard of the step has refined the ShapeEnv's replacements)."""

    __slots__ = ("sym",)

    def __init__(self, sym) -> None:
        self.sym = sym

    @property
    def expr(self) -> sympy.Expr:
        return self.sym.node.expr


class SymExpr:
    """A size expression in a planned program, evaluated with the symbol values of each call."""

    __slots__ = ("expr", "is_float", "_fn")

    def __init__(self, expr: sympy.Expr, is_float: bool = False) -> None:
        self.expr = expr
        self.is_float = is_float
        self._fn = None

    def __repr__(self) -> str:
        return "SymExpr(%s)" % self.expr

    def __eq__(self, other) -> bool:
        return isinstance(other, SymExpr) and self.expr == other.expr

    def __hash__(self) -> int:
        return hash(self.expr)

    def value(self, env: dict) -> Any:
        """With int values in `env`: a number (fast path, a compiled lambda). With traced SymInts
        (inside make_fx): an expression of them, so the graph computes the size from its inputs."""
        if all(type(v) is int for v in env.values()):
            if self._fn is None:
                self._fn = python_evaluator(self.expr)
            v = self._fn(env)
            return float(v) if self.is_float else v if type(v) is bool else int(v)
        return evaluate(self.expr, env)


def evaluate(expr: sympy.Expr, env: dict):
    """`expr` over symbols with the values in `env` (ints, or SymInts being traced)."""
    return sympy_interp(PythonReferenceAnalysis, env, expr)


def python_evaluator(expr: sympy.Expr):
    """A Python function env -> value of `expr`, compiled once (microseconds per call)."""
    code = _py(expr)
    names = sorted(str(s) for s in expr.free_symbols)
    src = "lambda env: (lambda %s: %s)(%s)" % (
        ", ".join(names) or "_", code, ", ".join("env[S[%r]]" % n for n in names) or "0")
    symbols = {str(s): s for s in expr.free_symbols}
    return eval(src, {"S": symbols, "_fdiv": lambda a, b: a // b, "_max": max, "_min": min})


def _py(e) -> str:
    if isinstance(e, sympy.Symbol):
        return str(e)
    if isinstance(e, sympy.Integer):
        return str(int(e))
    if isinstance(e, (sympy.Rational, sympy.Float)) or e.is_number:
        return repr(float(e))
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(_py(a) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(_py(a) for a in e.args) + ")"
    if isinstance(e, sympy.Pow):
        return "(%s ** %s)" % (_py(e.args[0]), _py(e.args[1]))
    if isinstance(e, FloorDiv):
        return "(%s // %s)" % (_py(e.args[0]), _py(e.args[1]))
    if isinstance(e, CeilDiv):
        return "(-((-%s) // %s))" % (_py(e.args[0]), _py(e.args[1]))
    if isinstance(e, (Mod, PythonMod)):
        return "(%s %% %s)" % (_py(e.args[0]), _py(e.args[1]))
    if isinstance(e, Max):
        return "_max(%s)" % ", ".join(_py(a) for a in e.args)
    if isinstance(e, Min):
        return "_min(%s)" % ", ".join(_py(a) for a in e.args)
    if isinstance(e, TruncToInt):
        return "int(%s)" % _py(e.args[0])
    if isinstance(e, sympy.core.relational.Relational):     # a comparison of sizes (SymBool)
        return "(%s %s %s)" % (_py(e.lhs), e.rel_op, _py(e.rhs))
    if e is sympy.true or e is sympy.false:
        return "True" if e is sympy.true else "False"
    if isinstance(e, (sympy.And, sympy.Or)):
        return "(" + (" and " if isinstance(e, sympy.And) else " or ").join(_py(a) for a in e.args) + ")"
    if isinstance(e, sympy.Not):
        return "(not %s)" % _py(e.args[0])
    raise NotImplementedError("size expression %s (%s)" % (e, type(e).__name__))


class _FactoryMode(TorchDispatchMode):
    """While a step records symbolically, ops without a lazy argument but with a symbolic size
    (`torch.arange(T)`, `torch.ones(T, T)`) are recorded as lazy values; every other op, and every op
    while no step is symbolic, passes through.

    One instance serves every symbolic step, and it stays on torch's mode stack from the first symbolic
    step until `release_factory_mode` pops it where no dispatch is under way (a mode cannot be left from
    inside an op's dispatch, where a read that ends a step may happen)."""

    def __init__(self) -> None:
        super().__init__()
        self.record = None   # the recording function of the symbolic step in progress, or None
        self.faking = 0      # > 0 while pydisc itself computes fake metadata: pass everything through
        self.entered = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.record is not None and not self.faking and \
                not any(issubclass(t, LazyTensor) for t in types) and _has_symbols((args, kwargs)):
            return self.record(func, args, kwargs)
        return func(*args, **kwargs)


_FACTORY_MODE = _FactoryMode()


def own_modes() -> int:
    """How many of the dispatch modes on torch's stack are pydisc's own (0 or 1: the factory mode)."""
    return 1 if _FACTORY_MODE.entered else 0


def release_factory_mode() -> None:
    """Pop the factory mode if no step is symbolic and it is on top of torch's mode stack (at the end
    of a symbolic step, at mark_step, before a lazy module's forward, at `to_lazy`)."""
    mode = _FACTORY_MODE
    # not on top: inside an op's dispatch torch stashes the mode it runs; a mode entered by the user
    # above it stays theirs to leave
    if mode.entered and mode.record is None and _get_current_dispatch_mode() is mode:
        mode.entered = False
        mode.__exit__(None, None, None)


def _has_symbols(x) -> bool:
    if is_symbolic(x):
        return True
    if isinstance(x, (list, tuple)):
        return any(_has_symbols(a) for a in x)
    if isinstance(x, dict):
        return any(_has_symbols(a) for a in x.values())
    return False


# Ops whose Python decomposition (run while the Python dispatcher is on) is spelled otherwise than the
# C++ kernel that concrete steps go through, where the C++ one keeps sizes symbolic too: the symbolic
# step hides the Python one, so that both recordings are spelled alike and later concrete steps match
# the template. dropout on the CPU: C++ records `empty_like, bernoulli_, div_, mul`, Python
# `native_dropout`.
_CPP_SPELLED = (torch.ops.aten.dropout.default,)


def _hide_python_kernels() -> list:
    hidden = []
    for op in _CPP_SPELLED:
        kernel = op.py_kernels.pop(DispatchKey.CompositeImplicitAutograd, None)
        if kernel is not None:
            hidden.append((op, kernel))
            op._dispatch_cache.clear()
    return hidden


def _restore_python_kernels(hidden: list) -> None:
    for op, kernel in hidden:
        op.py_kernels[DispatchKey.CompositeImplicitAutograd] = kernel
        op._dispatch_cache.clear()


class SymbolicStep:
    """The ShapeEnv, fake mode and symbol sources of one step recorded symbolically."""

    _count = 0

    def __init__(self, record_factory) -> None:
        SymbolicStep._count += 1
        self.id = SymbolicStep._count
        # no duck sizing: two dims that happen to be equal in this step are not the same symbol
        self.shape_env = ShapeEnv(duck_shape=False)
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self.sources: dict[sympy.Symbol, tuple] = {}     # symbol -> ("conv", ordinal, dim) | ("carried", storage, dim)
        self.conversions: dict[int, tuple] = {}          # ordinal -> dims made symbolic
        self.real_fakes: dict[int, torch.Tensor] = {}     # id(eager tensor) -> its fake
        self._record_factory = record_factory
        self._mode = _FACTORY_MODE
        self._contexts: list = []
        self._hidden: list = []           # Python kernels hidden while the step records (_CPP_SPELLED)
        self.guards_seen = 0
        self.guard_sources: list = []      # (guard expr, user source line where it appeared)
        # symbol -> a number its size is assumed a multiple of, checked at each match (driver/dynamic.
        # size_multiples, template_match); None: the template's compiled code is told nothing of its sizes
        self.multiples: dict[sympy.Symbol, int] | None = None
        # Sizes Python code read of a tensor an earlier step made, before an op of this step used it (HF's
        # cache length, `keys.shape[-2]`, compared with the attention mask's): (id(storage), shape) ->
        # (storage, {dim: (symbol, SymInt)}, fake). Each symbol gets a source where an op reads the tensor
        # and the dim is dynamic (`SymbolicInputs.carried_input`), else its number (`settle`).
        self.pending: dict[tuple, tuple] = {}
        self.pinned: dict[sympy.Symbol, sympy.Integer] = {}

    # ---- lifetime: active from the first symbolic input to the end of the step ----------------------
    def enter(self) -> None:
        ctx = enable_python_dispatcher()
        ctx.__enter__()
        self._contexts.append(ctx)
        mode = self._mode
        if not mode.entered:
            mode.__enter__()
            mode.entered = True
        mode.record = self._record_factory
        self._hidden = _hide_python_kernels()

    def exit(self) -> None:
        """Safe inside an op's dispatch: the factory mode only stops recording (`release_factory_mode`
        pops it later)."""
        _restore_python_kernels(self._hidden)
        self._hidden = []
        self._mode.record = None
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        release_factory_mode()      # at once where that is safe

    # ---- symbols -----------------------------------------------------------------------------------
    def symbolic_layout(self, real: torch.Tensor, dims, source: tuple, symbols: dict | None = None) -> tuple:
        """Sizes and strides of `real` with `dims` symbolic (contiguous tensors only). `symbols`: {dim:
        (symbol, SymInt)} made for it already (`pending`), used rather than new ones."""
        sizes: list = list(real.shape)
        made = []
        for d in dims:
            if d < real.dim() and real.shape[d] >= 2:     # 0 and 1 are specialised, as torch does
                sym, sizes[d] = symbols[d] if symbols and d in symbols else \
                    self._symbol(int(real.shape[d]), "pydisc_%s%d_dim%d" % (source[0], source[1], d))
                self.sources[sym] = (source[0], source[1], d)
                made.append(d)
        return tuple(sizes), _contiguous(sizes), tuple(made)

    def _symbol(self, value: int, name: str) -> tuple:
        from torch._dynamo.source import ConstantSource   # (importing torch._dynamo costs ~1 s: only here)
        src = ConstantSource(name)
        sym = self.shape_env.create_symbol(value, source=src, dynamic_dim=DimDynamic.DYNAMIC)
        return sym, self.shape_env.create_symintnode(sym, hint=value, source=src)

    def pending_sizes(self, real: torch.Tensor, storage, make: bool = True) -> torch.Size | None:
        """The sizes Python code reads of `real`, a whole contiguous tensor an earlier step made, before any
        op of this step has read it: every dim of 2 or more a symbol without a source yet (`pending`).
        `make=False`: only those given already (None if none were)."""
        found = self.pending.get(_pending_key(real, storage))
        if found is None:
            if not make:
                return None
            n = len(self.pending)
            symbols = {d: self._symbol(int(size), "pydisc_pending%d_dim%d" % (n, d))
                       for d, size in enumerate(real.shape) if size >= 2}
            sizes = [symbols[d][1] if d in symbols else size for d, size in enumerate(real.shape)]
            found = self.pending[_pending_key(real, storage)] = (
                storage, symbols, self.fake_symbolic(sizes, _contiguous(sizes), real.dtype, real.device))
        return found[2].shape

    def pending_symbols(self, real: torch.Tensor, storage) -> dict | None:
        """{dim: (symbol, SymInt)} that `pending_sizes` gave `real`'s sizes, or None."""
        found = self.pending.get(_pending_key(real, storage))
        return None if found is None else found[1]

    def settle(self) -> None:
        """Pin each pending symbol that no dynamic dim took (`symbolic_layout`) to its number: a guard that
        the ShapeEnv turns into a replacement, and each guard is read with it (`guards`)."""
        for _, symbols, _ in self.pending.values():
            for sym, size in symbols.values():
                if sym not in self.sources and sym not in self.pinned:
                    value = int(size.node.hint)
                    torch._check(size == value)
                    self.pinned[sym] = sympy.Integer(value)

    def faking(self):
        """Context for computing fake metadata (the factory mode lets these ops through)."""
        return _Faking(self)

    def fake_static(self, size, stride, offset, dtype, device, nbytes) -> torch.Tensor:
        with self.faking():
            base = torch.empty((nbytes // _itemsize(dtype),), dtype=dtype, device=device)
            return base.as_strided(size, stride, offset)

    def fake_symbolic(self, size, stride, dtype, device) -> torch.Tensor:
        with self.faking():
            return torch.empty_strided(size, stride, dtype=dtype, device=device)

    def guards(self) -> list:
        if self.pinned:
            return [g.expr.xreplace(self.pinned) for g in self.shape_env.guards]
        return [g.expr for g in self.shape_env.guards]

    def value_of(self, sym: sympy.Symbol) -> int | None:
        """The size `sym` stands for in the step recorded; None where a guard pinned it to a number."""
        env = self.shape_env
        if env.replace(sym) != sym:
            return None
        hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # (torch 2.13)
        value = hints.get(sym)
        return None if value is None else int(value)

    def note_guards(self, source: str | None) -> None:
        """Remember where in user code the newest guards appeared (a specialised size is reported there)."""
        guards = self.shape_env.guards
        for g in guards[self.guards_seen:]:
            self.guard_sources.append((g.expr, source))
        self.guards_seen = len(guards)

    def specialised(self) -> list:
        """[(symbol, value, source line)] for dynamic dims that guards pinned to one size."""
        out = []
        for sym in self.sources:
            value = self.shape_env.replace(sym)
            if getattr(value, "is_number", False):
                where = next((src for g, src in self.guard_sources if sym in g.free_symbols), None)
                out.append((sym, int(value), where))
        return out


class _Faking:
    def __init__(self, step: SymbolicStep) -> None:
        self.step = step

    def __enter__(self):
        self.step._mode.faking += 1
        self.step.fake_mode.__enter__()

    def __exit__(self, *exc):
        try:
            self.step.fake_mode.__exit__(*exc)
        finally:
            self.step._mode.faking -= 1


def _pending_key(real: torch.Tensor, storage) -> tuple:
    return id(storage), tuple(real.shape)      # (the entry holds the storage: the id stays its own)


def _contiguous(sizes) -> tuple:
    strides: list = []
    acc: Any = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc = acc * s
    return tuple(reversed(strides))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
