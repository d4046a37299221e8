"""The runtime stand-ins of a plan's compiled pieces: `CompiledCluster` (a StableHLO cluster) and
`CompiledRegion` (a region of the torch-mlir route) replace their FX submodules in the plan's graph
module. Each allocates its outputs with torch and has IREE fill them, measures itself against its ops
run eagerly where PYDISC_MEASURE asks (keeping eager when it is faster, remembered in `choices`), and
checks its values under PYDISC_CHECK. The planner (driver/plan.py) builds them.
"""
from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from ..config import CONFIG, applies
from ..diagnostics import log, warn_once
from ..metrics import METRICS
from . import choices
from .compare import mismatch
from .compiled import running_calls
from .compiler import forget_module, text_hash
from .errors import DeviceOutOfMemoryError, is_out_of_memory

__all__ = ["CompiledCluster", "CompiledRegion"]


class _Pools:
    """The clusters whose output pools are kept (`CompiledCluster._outputs`): the `LIMIT` called last. A
    step's plan calls a few; a plan not called lately (another shape's, an evaluation's) gives its pool up,
    so that dead outputs of many plans do not pile up."""

    LIMIT = 8

    def __init__(self) -> None:
        self.recent: OrderedDict[int, weakref.ref] = OrderedDict()

    def use(self, cluster: "CompiledCluster") -> None:
        key = id(cluster)
        ref = self.recent.get(key)
        if ref is not None and ref() is cluster:
            self.recent.move_to_end(key)
            return
        self.recent.pop(key, None)      # (a cluster that is gone, whose id a new one has)
        self.recent[key] = weakref.ref(cluster)
        while len(self.recent) > self.LIMIT:
            old = self.recent.popitem(last=False)[1]()
            if old is not None:
                old.pool = None


POOLS = _Pools()


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (C++ ones included: autograd's saved tensors, DLPack exports of views) use `t`'s
    memory, `t` itself counted (the storage object made here to ask is not)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


class CompiledCluster(torch.nn.Module):
    """Stands in for a cluster submodule: allocates its outputs with torch, IREE fills them.

    A cluster with dynamic dims sizes its outputs from its inputs at each call, through a Python
    function generated once from the size expressions (`prepare`); SymInt inputs are not passed to
    IREE and SymInt outputs are computed there too.
    With PYDISC_CHECK=N, every Nth call also runs the cluster's ops eagerly and compares."""

    route = "stablehlo"

    def __init__(self, name: str, compiled, specs: list[tuple[tuple, torch.dtype]], text: str,
                 device: torch.device, fallback: torch.fx.GraphModule, prepare: Callable | None = None):
        """`specs`: (shape, dtype) of each result of the compiled function, static; `text`: the module's
        MLIR; `prepare(inputs) -> (arguments, outputs, results)`: for a cluster with dynamic dims, the
        size function that allocates the outputs at a call's sizes (`frontend.emit.size_function`)."""
        super().__init__()
        self.name = name
        self.compiled = compiled
        self.specs = specs
        self.device = device
        self.fallback = fallback
        out_node = next(n for n in fallback.graph.nodes if n.op == "output")
        self.single = not isinstance(out_node.args[0], (tuple, list))
        self.output_ops = [str(getattr(a, "target", a)) for a in
                           (out_node.args[0] if not self.single else [out_node.args[0]])]
        self.prepare = prepare
        self.calls = 0
        self.eager_faster = False     # measured on its second call (`measure`): eager ran it faster
        self.digest = text_hash(text)   # names the measured choice kept on disk (choices.py)
        self.decided = False          # compiled or eager chosen, measured here or by an earlier process
        self.run_at_once = False      # run even where the plan's calls are collected (driver/inflight.py)
        # per output: the tensor it is written into at every call, or None (a new one each call): `keep_outputs`
        self.kept: list | None = None
        # per output of a CPU cluster of static sizes: (the tensor IREE wrote it into at the last call, its
        # memory as IREE takes it by address: {address: import}), or None: `_outputs`
        self.pool: list | None = None

    def forward(self, *inputs):
        if self.eager_faster:
            return self.fallback(*inputs)
        measuring = not self.decided and applies(CONFIG.measure, self.device)
        if measuring and self.calls == 0 and self.recall(inputs):
            return self.fallback(*inputs)    # eager measured faster by an earlier process
        if self.run_at_once:
            with running_calls():
                results = self.run_compiled(inputs)
        else:
            results = self.run_compiled(inputs)
        # (into the instance's dict: `nn.Module.__setattr__` looks for parameters and submodules, ~3 us)
        self.__dict__["calls"] = self.calls + 1
        if measuring and self.calls == 2 and not (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            chosen = self.measure(inputs)    # (not while a CUDA graph is captured: it synchronises)
            if chosen is not None:
                return chosen
        if CONFIG.check_every and self.calls % CONFIG.check_every == 0:
            self.check(inputs, results)
        return results[0] if self.single else tuple(results)

    def can_defer(self) -> bool:
        """Whether its next call may be collected and run later on another thread
        (`compiled.collecting_calls`): it runs compiled, and neither times nor checks itself."""
        return not self.eager_faster and not CONFIG.check_every and (
            self.decided or not applies(CONFIG.measure, self.device))

    def keep_outputs(self, indices) -> None:
        """Outputs `indices` are written into the same tensors at every call from now on (none: a new one
        each call again): the caller copies them elsewhere before the next call and keeps nothing of them
        (a step's new values of the parameters and optimizer state, which go into their tensors at once),
        or exchanges their memory with those tensors' (driver/bind.py `handovers`): no allocation per
        call. On the CPU, for a cluster of static sizes."""
        if not indices or self.prepare is not None or self.device.type != "cpu":
            self.kept = None
            return
        kept = [None] * len(self.specs)
        for i in indices:
            shape, dtype = self.specs[i]
            # a view of a flat tensor (its `_base`), which a copy into a flat storage takes as it is
            kept[i] = torch.empty(math.prod(shape), dtype=dtype, device=self.device).view(shape)
        self.kept = kept

    def run_compiled(self, inputs) -> list:
        try:
            if self.prepare is None and self.device.type == "cpu":
                results, views = self._outputs()
                self.compiled.run(inputs, results, fresh=True, views=views)
            elif self.prepare is None:
                results = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.specs]
                self.compiled.run(inputs, results, fresh=True)
            else:
                arguments, outs, results = self.prepare(inputs)
                self.compiled.run(arguments, outs)
        except Exception as exc:
            if isinstance(exc, RuntimeError) and is_out_of_memory(exc):
                raise self.out_of_memory(exc) from exc
            forget_module(self.compiled)   # neither this process nor the next loads these bytes again
            raise
        return results

    def _outputs(self) -> tuple[list, list]:
        """The tensors a call writes its outputs into, and their memory as IREE takes it: on the CPU the
        memory of the last call's outputs again where nothing holds them any more (a training step's
        gradients and activations, dropped by `zero_grad` and the backward), or the kept ones
        (`keep_outputs`), their imports made once; else new tensors. (An allocation and an import cost
        2-4 us per output of a transformer block's ~40, more than a step's other work on them; a result
        is handed out as an alias of the pooled tensor, so the pool sees from the memory's use count
        alone, without Python references, whether anything still reads it.)"""
        POOLS.use(self)
        pool = self.pool
        if pool is None:
            pool = self.pool = [None] * len(self.specs)
        kept = self.kept
        results, views = [], []
        for i, (shape, dtype) in enumerate(self.specs):
            entry = pool[i]
            if kept is not None and kept[i] is not None:
                out = kept[i]
                if entry is None or entry[0] is not out:
                    entry = pool[i] = (out, {})
                result = out        # (the caller copies it elsewhere, or hands its memory over, before the next call)
            else:
                if entry is None or _storage_users(entry[0]) != 1:
                    entry = pool[i] = (torch.empty(shape, dtype=dtype, device=self.device), {})
                out = entry[0]
                result = out.detach()
            # The memory behind a tensor can move: a step hands a kept output's memory over to the input it
            # is the new value of, taking that input's in exchange (driver/bind.py `handovers`), and a
            # pooled output handed out earlier can be such an input (the momentum buffers SGD's first step
            # made). Its imports are kept by address: two, where the memory alternates.
            imports = entry[1]
            ptr = out.data_ptr()
            if ptr not in imports:
                if len(imports) > 1:
                    imports.clear()
                imports[ptr] = self.compiled.import_output(out)
            results.append(result)
            views.append(imports[ptr])
        return results, views

    def measure(self, inputs):
        """Time this cluster compiled and its ops run eagerly, on the same inputs (twice each, taking
        turns, the best of each; the first call, which loads the kernels, is not timed), and keep eager
        from now on when it is faster by more than 10%: kernel quality and per-call costs vary, and a
        region goes to IREE only where it pays. Returns eager's outputs when eager is kept, else None.
        The decision is reported in `metrics()["speed_choices"]` and kept in the disk cache
        (choices.py), where `recall` finds it in a later process."""
        self.decided = True
        key = choices.choice_key(self.digest, self.device, inputs)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)

        def timed(run):
            sync(self.device)
            started = time.perf_counter()
            out = run()
            sync(self.device)
            return time.perf_counter() - started, out

        what = self._what()
        compiled, eager = [], []
        try:
            for _ in range(2):
                compiled.append(timed(lambda: self.run_compiled(inputs))[0])
                seconds, expected = timed(lambda: self.fallback(*inputs))
                eager.append(seconds)
        except Exception as exc:   # eager needs more memory, say: keep the compiled cluster
            METRICS.speed_choices.append("%s: not measured (%s)" % (what, type(exc).__name__))
            return None
        c, e = min(compiled), min(eager)
        keep_eager = e < 0.9 * c
        METRICS.speed_choices.append("%s: IREE %.0f us, eager %.0f us -> %s" % (
            what, 1e6 * c, 1e6 * e, "eager" if keep_eager else "IREE"))
        choices.store(key, {"choice": "eager" if keep_eager else "IREE", "iree_us": round(1e6 * c, 1),
                            "eager_us": round(1e6 * e, 1)})
        if not keep_eager:
            return None
        log("compiles", "cluster %s runs eagerly from now on: %.0f us eager, %.0f us compiled", self.name,
            1e6 * e, 1e6 * c)
        METRICS.clusters_eager_faster += 1
        self.eager_faster = True
        return expected

    def recall(self, inputs) -> bool:
        """On the first call: take the choice an earlier process measured for this cluster text at these
        sizes on this kind of device (choices.py), if any; True when that choice is eager."""
        known = choices.lookup(choices.choice_key(self.digest, self.device, inputs))
        if known is None:
            return False
        self.decided = True
        keep_eager = known.get("choice") == "eager"
        METRICS.speed_choices.append("%s: IREE %.0f us, eager %.0f us -> %s (measured before)" % (
            self._what(), known.get("iree_us", 0), known.get("eager_us", 0), "eager" if keep_eager else "IREE"))
        if keep_eager:
            METRICS.clusters_eager_faster += 1
            self.eager_faster = True
        return keep_eager

    def _what(self) -> str:
        ops = [n for n in self.fallback.graph.nodes if n.op == "call_function"]
        names = sorted({str(n.target).replace("aten.", "").replace(".default", "") for n in ops})
        return "%s (%d ops: %s%s)" % (self.name, len(ops), ", ".join(names[:4]), ", ..." if len(names) > 4 else "")

    def out_of_memory(self, exc: RuntimeError) -> RuntimeError:
        """`exc`, a failed allocation of this cluster's outputs or inside IREE, with the cluster named."""
        ops = sorted({str(n.target) for n in self.fallback.graph.nodes if n.op == "call_function"})
        where = "compiled cluster %s (%d ops: %s%s)" % (self.name, len(ops), ", ".join(ops[:5]),
                                                        ", ..." if len(ops) > 5 else "")
        if isinstance(exc, DeviceOutOfMemoryError):      # raised inside IREE's call
            return DeviceOutOfMemoryError(str(exc), where=where + " inside IREE's call")
        nbytes = None
        if self.prepare is None:
            nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.specs)
        outputs = "its output" if len(self.specs) == 1 else "its %d outputs" % len(self.specs)
        return DeviceOutOfMemoryError(str(exc), where=where + ", allocating " + outputs, nbytes=nbytes)

    def check(self, inputs, results) -> None:
        """Compare with the same ops run eagerly; report the first output that diverges."""
        METRICS.numerics_checks += 1
        expected = self.fallback(*inputs)
        expected = [expected] if self.single else list(expected)
        for i, (got, want) in enumerate(zip(results, expected)):
            why = mismatch(got, want)       # (a size computed on the host compares as an int)
            if why is not None:
                message = "cluster %s output %d (from %s) diverges from eager: %s" % (
                    self.name, i, self.output_ops[i], why)
                METRICS.numerics_mismatches.append(message)
                warn_once("check:" + self.name + str(i), "pydisc numerics check: " + message)
                return


class CompiledRegion(CompiledCluster):
    """A region of the torch-mlir route (pydisc/frontend/torch_mlir.py): the same calling convention, static
    shapes; its runs are counted apart (`executions_torch_mlir`), so a caller can tell the routes.

    torch-mlir's lowerings are not pydisc's own: some compute wrong values (`policy.TORCH_MLIR_WRONG_VALUES`
    lists those found), and IREE 3.13 writes the result of a torch-mlir scatter into the scatter's input
    buffer. So the first call keeps a copy of the inputs, checks that none was written (restoring it if
    one was) and runs the region eagerly to compare: a region that fails either check is demoted for
    good (`demote` moves its ops to the plan's eager ledger), warned and counted, and eager's values
    are used."""

    route = "torch-mlir"

    def __init__(self, name: str, compiled, specs: list, text: str, device: torch.device,
                 fallback: torch.fx.GraphModule, demote: Callable[[], None]):
        super().__init__(name, compiled, specs, text, device, fallback)
        self.demote = demote
        self.verified = False
        self.demoted = False

    def can_defer(self) -> bool:
        return self.verified and not self.demoted and super().can_defer()

    def forward(self, *inputs):
        if self.demoted:
            return self.fallback(*inputs)
        METRICS.executions_torch_mlir += 1
        if self.verified:
            return super().forward(*inputs)
        self.verified = True
        snapshot = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        results = super().forward(*inputs)
        written = [i for i, (t, s) in enumerate(zip(inputs, snapshot)) if isinstance(t, torch.Tensor)
                   and not _same_values(t, s)]
        for i in written:
            inputs[i].copy_(snapshot[i])
        expected = self.fallback(*inputs)
        if written:
            mismatch = "it wrote into its input%s %s" % ("s" if len(written) > 1 else "", written)
        else:
            mismatch = _first_mismatch([results] if self.single else list(results),
                                       [expected] if self.single else list(expected))
        if mismatch is not None:
            ops = sorted({str(n.target) for n in self.fallback.graph.nodes if n.op == "call_function"})
            warn_once("region-wrong:" + ",".join(ops)[:120],
                      "pydisc: torch-mlir region %s (%s) differs from eager on its first call (%s); it "
                      "runs eagerly from now on" % (self.name, ", ".join(ops[:6]), mismatch))
            METRICS.torch_mlir_failures["%s (%s)" % (", ".join(ops[:3]), "wrote its inputs" if written
                                                     else "wrong values")] += 1
            self.demoted = True
            self.demote()
            return expected
        return results


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, NaN equal to NaN."""
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _first_mismatch(results: list, expected: list) -> str | None:
    for i, (got, want) in enumerate(zip(results, expected)):
        why = mismatch(got, want)
        if why is not None:
            return "output %d: %s" % (i, why)
    return None
