"""The recorder's part for symbolic steps: step inputs and carried inputs whose dims are dynamic get
symbolic sizes, and every argument of an op in such a step its fake tensor.

`SymbolicInputs` is a base of `lazy_tensor.Recorder`; it uses the recorder's fields (`inputs_seen`,
`input_shapes`, `dims_of`, `carried_dims`, `symbolic`, `trace`) and its `ref` and `record_factory`.
"""
from __future__ import annotations

import sys

import torch

from .layout import is_whole, numel
from .symbolic import SymbolicStep, hint
from .tensor import LazyTensor, LiftedScalar, concrete_layout
from .trace import LazyStorage

__all__ = ["SymbolicInputs"]


class SymbolicInputs:
    def symbolic_input(self, real: torch.Tensor, storage: LazyStorage, requires_grad: bool) -> LazyTensor | None:
        ordinal = self.inputs_seen
        self.inputs_seen += 1
        storage.ordinal = ordinal
        self.input_shapes.append(tuple(real.shape))
        if self.dims_of is None:
            return None
        dims = self.dims_of(ordinal, real)
        if not dims or real.storage_offset() != 0 or not real.is_contiguous() or \
                real.untyped_storage().nbytes() != real.numel() * real.element_size():
            return None
        session = self.symbolic_session()
        size, stride, made = session.symbolic_layout(real, dims, ("conv", ordinal))
        if not made:
            return None
        session.conversions[ordinal] = (storage, made, real.dim())
        storage.nbytes = numel(size) * real.element_size()
        t = LazyTensor(size, stride, 0, real.dtype, real.device, storage, real=real.detach(),
                       requires_grad=requires_grad)
        t._fake = session.fake_symbolic(size, stride, real.dtype, real.device)
        t._fake_sid = session.id
        return t

    def symbolic_session(self) -> SymbolicStep:
        """This step's SymbolicStep, started at its first symbolic input. While it records, Python code
        reads the sizes of lazy tensors through `python_shape`."""
        if self.symbolic is None:
            self.symbolic = SymbolicStep(self.record_factory)
            self.symbolic.enter()
            self.trace.symbolic = self.symbolic
            LazyTensor.shape = _SHAPE_HOOK
            LazyTensor.size = _size
        return self.symbolic

    def end_symbolic(self) -> None:
        self.symbolic.exit()
        self.symbolic = None
        self.trace.symbolic = None
        del LazyTensor.shape, LazyTensor.size

    def python_shape(self, t: LazyTensor) -> torch.Size | None:
        """The sizes Python code reads of `t` in this symbolic step where they are not its own (None): a
        tensor an earlier step made (a KV cache) has this step's numbers, and symbolic sizes in its dynamic
        dims, where the step's values have them. Read before an op of the step used it, every dim is a
        symbol (`SymbolicStep.pending_sizes`): HF compares the cache's length with the attention mask's
        before its attention reads the cache, and that comparison of a number with a symbol would pin the
        mask's length."""
        session = self.symbolic
        if session is None:
            return None     # (another thread, as the step ends)
        if t._concrete is not None and t._fake is not None and t._fake_sid == session.id:
            return t._fake.shape        # a carried input with dynamic dims
        storage = t._storage
        if t._epoch == self.trace.epoch or self.carried_dims is None or storage.produced != self.step_id - 1:
            return None
        real = t._real
        if real is None or not is_whole(real):
            return None
        # (an input of the step already, through another tensor: its dims were decided then)
        return session.pending_sizes(real, storage, make=storage.epoch != self.trace.epoch or storage.input_index < 0)

    def carried_input(self, t: LazyTensor, storage: LazyStorage) -> None:
        """`t`, the first tensor of this step to read `storage` (a previous step's result), gets symbolic
        sizes in the dims `carried_dims` names: its fake and concrete layout (and, where the step records
        symbolically, the sizes Python code reads, `python_shape`)."""
        real = t._real
        index = storage.input_index
        if real is None or not is_whole(real):
            return
        dims = self.carried_dims(index, real)
        if not dims:
            return
        session = self.symbolic_session()
        size, stride, made = session.symbolic_layout(real, dims, ("carried", index),
                                                     session.pending_symbols(real, storage))
        if not made:
            return
        session.conversions[("carried", index)] = (storage, made, real.dim())
        t._fake = session.fake_symbolic(size, stride, real.dtype, real.device)
        t._fake_sid = session.id
        t._concrete = (tuple(real.shape), real.stride(), 0)

    def note_carried(self, args) -> None:
        """Before an op is recorded: its lazy arguments not read yet in this step get their input
        storage now, and with it any dynamic dims (`carried_input`), so that the op sees them."""
        epoch = self.trace.epoch
        for a in args:
            if type(a) is LazyTensor:
                if a._real is None and a._epoch != epoch and self.in_flight is not None:
                    self.in_flight("a result of the step before")   # a KV cache the step before made
                if a._epoch != epoch and a._real is not None:
                    self.ref(a)
            elif type(a) is list or type(a) is tuple:
                self.note_carried(a)

    def fake_of(self, a):
        """The fake tensor standing for argument `a` in this symbolic step."""
        session = self.symbolic
        if isinstance(a, LazyTensor):
            if a._fake is None or a._fake_sid != session.id:
                size, stride, offset = concrete_layout(a)
                a._fake = session.fake_static(size, stride, offset, a.dtype, a.device, hint(a._storage.nbytes))
                a._fake_sid = session.id
            return a._fake
        if isinstance(a, LiftedScalar):
            with session.faking():
                return torch.empty((), dtype=torch.float32)
        if isinstance(a, torch.Tensor):
            fake = session.real_fakes.get(id(a))
            if fake is None:
                # eager tensors keep static sizes: C++ compares them with lazy sizes before any
                # dispatch, which would pin a symbolic size anyway (pass them through to_lazy)
                fake = session.fake_static(tuple(a.shape), a.stride(), a.storage_offset(), a.dtype,
                                           a.device, a.untyped_storage().nbytes())
                session.real_fakes[id(a)] = fake
            return fake
        if isinstance(a, (list, tuple)):
            return type(a)(self.fake_of(x) for x in a)
        return a


# While a step records symbolically, `LazyTensor.shape` and `.size()` (torch's own otherwise). pydisc's
# own code reads the wrapper's sizes: this step's numbers.
_SHAPE = torch._C.TensorBase.shape.__get__
_SIZE = torch._C.TensorBase.size


def _python_shape(t: LazyTensor):
    if sys._getframe(1).f_globals.get("__name__", "").startswith("pydisc."):
        return _SHAPE(t)
    sizes = t._recorder.python_shape(t)
    return _SHAPE(t) if sizes is None else sizes


def _size(t: LazyTensor, dim=None):
    sizes = None if sys._getframe(1).f_globals.get("__name__", "").startswith("pydisc.") or \
        not (dim is None or isinstance(dim, int)) else t._recorder.python_shape(t)
    if sizes is None:
        return _SIZE(t) if dim is None else _SIZE(t, dim)
    return sizes if dim is None else sizes[dim]


_SHAPE_HOOK = property(_python_shape)
