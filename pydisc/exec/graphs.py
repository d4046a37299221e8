"""A step captured as one CUDA graph: the whole plan replayed with a single launch.

A compiled GPT-2 training step launches about 2,500 kernels (IREE's, cuBLAS's, torch's) from Python
at 10-20 µs of host time each, and the CUDA launch queue fills: `mark_step()` then waits for the GPU,
and the next step's recording no longer overlaps its work. Once a plan has run twice (its clusters
have loaded their kernels and made their measured choices), its third run is captured with
`torch.cuda.CUDAGraph` (capturable because the direct launcher queues IREE's kernels on torch's
current stream, exec/direct) and every later run of the plan is one `replay()`: `mark_step()` returns
as soon as the step is queued.

What a replay needs, and how it is kept safe:
- Inputs at the addresses the graph was captured with. An input found in the same memory on two
  runs in a row (parameters, optimizer state: written in place by each step) is read where it lives;
  any other (the batch, the step's scalars, eager tensors made during the step such as a causal mask,
  even where the allocator gave the new memory the old address) is copied into a buffer of the
  graph's own before each replay. An input that moves after the capture makes the plan capture again
  (at most `MAX_CAPTURES` times, then it runs kernel by kernel).
- Outputs are written into the graph's memory at each replay: every output that the step does not
  copy into an input's storage anyway is cloned before it is handed out, so a tensor kept from an
  earlier step keeps its values. The copies into inputs read in place (parameters, optimizer state)
  are the graph's last work.
- Only plans that run entirely on the GPU, on torch's stream: a cluster run by IREE's runtime (its
  own stream, host synchronisation) or an op on CPU tensors would not be replayed, so such plans are
  never captured. A capture that fails (an op that synchronises, say) is given up, warned once and
  counted in `metrics()["cuda_graph_fallbacks"]`; the plan then runs kernel by kernel.

A dynamic-shape template's plan serves steps of many shapes: each shape (a `Binding` of the template)
gets a graph of its own once it has run `CAPTURE_AT` times, so that lengths that recur (a training loop
over bucketed or variable-length batches) replay as a fixed-shape step does, where kernel-by-kernel
launches of a BERT-base template step took 43 ms of host time for 25 ms of GPU work. Only the
shapes run last keep their graphs: at least `MAX_SHAPE_GRAPHS`, more while they hold at most
`SHAPE_GRAPH_SHARE` of the device's memory (every length of a `generate()`); a shape seen once or twice is
never captured, and one whose graph was given back for others `MAX_EVICTIONS` times runs kernel by kernel.

Each graph keeps the memory of its step (its own pool, as `torch.cuda.graph` does): the caching
allocator's free blocks are handed back to the driver before a capture, so that the graph can take
them, and `release_memory()` gives it back when steps run eagerly instead (the step choice's eager
windows, eager kept for good). `PYDISC_CUDA_GRAPHS=0` turns this off.
"""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..config import CONFIG
from ..diagnostics import log, warn_once
from ..metrics import METRICS

__all__ = ["StepGraph", "make_room", "release_memory", "run_plan"]

CAPTURE_AT = 3      # the plan's run that is captured: its clusters measured themselves on the 2nd
MAX_CAPTURES = 6    # captures per plan (each one stages the inputs that moved): then kernel by kernel
MAX_SHAPE_GRAPHS = 8    # a dynamic-shape template's shapes whose graphs keep their memory at once, at least ...
SHAPE_GRAPH_SHARE = 0.1     # ... and more while their graphs hold at most this share of the device's memory
MAX_EVICTIONS = 2   # a shape's graph given back for others this many times: the shape runs kernel by kernel
_COUNTED = ("executions", "executions_torch_mlir", "direct_launches")   # what a replay repeats
_STREAMS: dict = {}
_LIVE: "weakref.WeakSet[StepGraph]" = weakref.WeakSet()
# the captured graphs of templates' shapes, by id, the last run last (weakly: a binding dropped from the
# plans takes its graph, and the graph's memory, with it)
_SHAPES: "dict[int, weakref.ref[StepGraph]]" = {}


def run_plan(owner, runner, inputs: list, written, device: torch.device, shape: bool = False) -> list:
    """Run `runner` on `inputs`, through a CUDA graph kept in `owner.graph` (a plan's, or one shape's of a
    dynamic-shape template: `shape`), from the `CAPTURE_AT`th run on. `written()` says which outputs are
    new values of inputs ({output position: input position}: parameters, optimizer state): inside the
    graph those copies are its last work, and the input itself is returned.

    A template has a graph per shape it runs at; the captured shapes run last keep theirs (and its memory),
    `_make_room_for_shapes`."""
    graph = owner.graph
    if graph is None or graph.runner is not runner:
        graph = owner.graph = StepGraph(runner, device, written())
    captures = METRICS.cuda_graph_captures
    results = graph(inputs)
    if shape and graph.graph is not None:
        _SHAPES.pop(id(graph), None)
        _SHAPES[id(graph)] = weakref.ref(graph)
        if len(_SHAPES) > MAX_SHAPE_GRAPHS and METRICS.cuda_graph_captures != captures:
            _make_room_for_shapes(device)       # (only a capture adds memory)
    return results


def _make_room_for_shapes(device: torch.device) -> None:
    """The captured shapes on `device` that ran longest ago give their graphs back while the shapes' graphs
    there hold more than `SHAPE_GRAPH_SHARE` of its memory, the `MAX_SHAPE_GRAPHS` run last excepted:
    BERT-base training graphs of GBs each keep 8 shapes, decoding steps' graphs (a KV cache and one
    token's activations each) keep every length `generate()` runs at (it runs each once per call, in turn:
    were they given back after 8, each would be captured again at every call). A shape given back
    `MAX_EVICTIONS` times runs kernel by kernel from then on (`StepGraph.evict`): shapes that come back in
    turn, more than fit, would cost a capture each time."""
    graphs = [(key, ref()) for key, ref in _SHAPES.items()]
    graphs = [(key, g) for key, g in graphs if g is None or g.graph is None or g.device == device]
    held = sum(g.nbytes for _, g in graphs if g is not None and g.graph is not None)
    budget = _shape_budget(device)
    excess = len(graphs) - MAX_SHAPE_GRAPHS
    for key, g in graphs:       # (the shape that ran longest ago first)
        if g is None or g.graph is None:    # (gone, or given back already: it holds nothing)
            del _SHAPES[key]
            excess -= 1
            continue
        if excess <= 0 or (budget and held <= budget):
            break
        del _SHAPES[key]
        excess -= 1
        held -= g.nbytes
        g.evict()


def _shape_budget(device: torch.device) -> int:
    """The memory the shapes' graphs on `device` may hold in all, where more than the `MAX_SHAPE_GRAPHS`
    run last keep theirs (none off a GPU: those keep theirs, no more)."""
    if device.type != "cuda":
        return 0
    return int(SHAPE_GRAPH_SHARE * torch.cuda.get_device_properties(device).total_memory)


class StepGraph:
    def __init__(self, runner, device: torch.device, kept: dict) -> None:
        self.runner = runner
        self.device = device
        self.kept = kept
        self.calls = 0
        self.captures = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.off = _not_capturable(runner, device)   # why the plan runs kernel by kernel, or None
        self.last_ptrs: list | None = None
        self.last_storages: list | None = None     # weak references to the last run's input storages
        self.moving: set[int] = set()     # positions of inputs copied into the graph's own buffers
        self.staged: dict[int, torch.Tensor] = {}
        self.direct: list[tuple[int, int]] = []   # (position, address) of inputs read where they live
        self.outputs: list = []
        self.clone: list[bool] = []
        self.counted: dict[str, int] = {}
        self.nbytes = 0       # the memory its capture took (the graph's pool), about
        self.evictions = 0    # times its graph was given back to make room for other shapes' (`evict`)
        _LIVE.add(self)

    def release(self) -> None:
        """Give the graph's memory back; the plan is captured again on its next run."""
        if self.graph is not None:
            self.graph = self.outputs = None
            self.staged = {}
            self.captures -= 1       # (not a capture that an input's move caused)

    def evict(self) -> None:
        """Give the graph back to make room for other shapes' graphs (`_make_room_for_shapes`): captured again
        when its shape comes back, up to `MAX_EVICTIONS` times; then the shape runs kernel by kernel."""
        self.release()
        self.evictions += 1
        if self.evictions >= MAX_EVICTIONS and self.off is None:
            self._give_up("more shapes of a dynamic-shape template come back in turn than keep their graphs")

    def __call__(self, inputs: list) -> list:
        self.calls += 1
        if self.graph is not None:
            moved = [k for k, ptr in self.direct if inputs[k].data_ptr() != ptr]
            if not moved:
                return self._replay(inputs)
            self.moving.update(moved)
            self.graph = self.outputs = None     # its memory goes back before the next capture
            log("recompiles", "a CUDA graph is captured again: %d inputs moved", len(moved))
        if self.off is None and self.calls == 1:
            self.off = _not_capturable_inputs(inputs, self.device)
        if self.off is not None:
            return self.runner(*inputs)
        ptrs = [None if t is None else t.data_ptr() for t in inputs]
        storages = [None if t is None else StorageWeakRef(t.untyped_storage()) for t in inputs]
        if self.last_ptrs is not None:
            self.moving.update(k for k, (a, b) in enumerate(zip(ptrs, self.last_ptrs)) if a != b)
            # new memory at an old address (the allocator reuses blocks) moves sooner or later, and
            # each move costs a capture: copied in from the start
            self.moving.update(k for k, (old, new) in enumerate(zip(self.last_storages, storages))
                               if old is not None and (old.expired() or old.cdata != new.cdata))
        self.last_ptrs = ptrs
        self.last_storages = storages
        if self.calls < CAPTURE_AT:
            METRICS.cuda_graph_warmups += 1
            return self.runner(*inputs)
        if self.captures >= MAX_CAPTURES:
            self._give_up("its inputs keep moving (%d captures)" % self.captures)
            return self.runner(*inputs)
        try:
            self._capture(inputs)
        except Exception as exc:   # noqa: BLE001 - whatever breaks a capture, the plan still runs
            self.graph = None
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            self._give_up("%s: %s" % (type(exc).__name__, first))
            return self.runner(*inputs)
        return self._replay(inputs, counted=False)

    def _capture(self, inputs: list) -> None:
        self.captures += 1
        self.staged = {k: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                       for k, t in enumerate(inputs) if k in self.moving}
        self.direct = [(k, t.data_ptr()) for k, t in enumerate(inputs) if k not in self.moving and t is not None]
        args = [self.staged.get(k, t) for k, t in enumerate(inputs)]   # (filled at each replay)
        # outputs written into inputs read in place: the copies (done by step._bind otherwise, one
        # launch each: 446 per GPT-2 step with AdamW) end the graph
        written = {k: i for k, i in self.kept.items() if i not in self.staged}

        def runner(*xs):
            outs = list(self.runner(*xs))
            copies: dict = {}    # (target dtype, source dtype) -> (targets, sources)
            for k, i in written.items():
                target = xs[i]
                if outs[k].data_ptr() != target.data_ptr():
                    targets, sources = copies.setdefault((target.dtype, outs[k].dtype), ([], []))
                    targets.append(target)
                    sources.append(outs[k].reshape(target.shape))
                outs[k] = target
            # one multi-tensor kernel per few hundred copies, where one copy each took ~800 memcpy
            # nodes (8.8 ms of a BERT-base step at batch 64 on the H200)
            # a source that is also written (a step input passed through as another's new value) is
            # read before any copy writes it: every copy sees the step's values, as the step computed
            written_to = {t.untyped_storage().data_ptr() for targets, _ in copies.values() for t in targets}
            for targets, sources in copies.values():
                sources[:] = [x.clone() if x.untyped_storage().data_ptr() in written_to else x for x in sources]
            for targets, sources in copies.values():
                torch._foreach_copy_(targets, sources)
            return outs

        before = {name: getattr(METRICS, name) for name in _COUNTED}
        reserved = _reserved(self.device)     # (after the cached free blocks went back: the pool's own)
        graph, outputs = _capture_graph(runner, args, self.device)
        if self.device.type == "cuda":
            # its pool, and the buffers its inputs are copied into (a decoding step's: its KV cache)
            self.nbytes = max(torch.cuda.memory_reserved(self.device) - reserved, 0) + \
                sum(b.untyped_storage().nbytes() for b in self.staged.values())
        self.counted = {name: getattr(METRICS, name) - before[name] for name in _COUNTED}
        outputs = list(outputs)
        direct_storages = {inputs[k].untyped_storage().data_ptr() for k, _ in self.direct}
        self.outputs = outputs
        self.clone = [isinstance(o, torch.Tensor) and k not in self.kept
                      and o.untyped_storage().data_ptr() not in direct_storages
                      for k, o in enumerate(outputs)]
        self.graph = graph
        METRICS.cuda_graph_captures += 1
        log("compiles", "step captured as a CUDA graph: %d inputs read in place, %d copied in, %d outputs",
            len(self.direct), len(self.staged), len(outputs))

    def _replay(self, inputs: list, counted: bool = True) -> list:
        for k, buffer in self.staged.items():
            buffer.copy_(inputs[k])
        self.graph.replay()
        if counted:
            METRICS.cuda_graph_replays += 1
            for name, n in self.counted.items():
                setattr(METRICS, name, getattr(METRICS, name) + n)
        return [o.clone(memory_format=torch.preserve_format) if c else o
                for o, c in zip(self.outputs, self.clone)]

    def _give_up(self, reason: str) -> None:
        self.off = reason
        METRICS.cuda_graph_fallbacks[reason[:120]] += 1
        warn_once("cudagraph:" + reason[:80], "pydisc: a step could not be captured as a CUDA graph (%s); it runs "
                  "kernel by kernel, correct but with more host time per step" % reason)


def make_room(device: torch.device | None) -> None:
    """Before eager steps that may come back to the captured ones (the step choice's eager windows): the
    graphs keep their memory where the device has that much free besides, so that the compiled steps
    after the window replay at once rather than capture again (a dynamic-shape template captures a graph
    per shape); else `release_memory`."""
    if device is not None and device.type == "cuda":
        held = sum(g.nbytes for g in list(_LIVE) if g.graph is not None)
        if held and torch.cuda.mem_get_info(device)[0] >= held:
            return
    release_memory()


def release_memory() -> None:
    """Free the memory that captured steps hold (each graph keeps its step's): when steps run eagerly
    instead (eager kept for good, or an eager window where memory is short: `make_room`), eager needs that
    memory."""
    _SHAPES.clear()
    released = [g for g in list(_LIVE) if g.graph is not None]
    for g in released:
        g.release()
    if released:
        torch.cuda.empty_cache()


def _capture_graph(runner, args: list, device: torch.device):
    """Capture `runner(*args)` on a side stream: (the graph, its outputs). Nothing runs; the outputs are
    filled by each `replay()`."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    stream = _stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.device(device), torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            outputs = runner(*args)
        except BaseException:
            try:
                graph.capture_end()
            except Exception:   # noqa: BLE001 - the capture was already invalid; the first error counts
                _end_generator_capture(device)
            raise
        try:
            graph.capture_end()
        except BaseException:
            _end_generator_capture(device)
            raise
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, outputs


def _reserved(device: torch.device) -> int:
    """The memory torch's allocator holds on `device`, its free cached blocks handed back first (as
    `_capture_graph` does): before a capture, what the capture then adds is the graph's pool."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _end_generator_capture(device: torch.device) -> None:
    """After a capture that failed to end: torch's CUDA generator still counts its draws as captured
    (its state leaves capture mode only when a capture ends well), and every random op after it would
    fail. A capture of one small kernel, ended normally, puts it back."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.stream(_stream(device)):
            graph.capture_begin(capture_error_mode="thread_local")
            torch.empty(1, device=device).zero_()
            graph.capture_end()
    except Exception:   # noqa: BLE001 - the capture's own error is the one to report
        pass


def _not_capturable(runner, device: torch.device) -> str | None:
    """Why `runner` (a plan's graph module) cannot be replayed from a CUDA graph, or None. A compiled
    cluster is a submodule holding its loaded module in `compiled` (CompiledModule or DirectModule)."""
    if CONFIG.check_every:
        return "PYDISC_CHECK compares with eager on the host"
    if not isinstance(runner, torch.fx.GraphModule):
        return "the step runs op by op"
    for module in runner.modules():
        compiled = getattr(module, "compiled", None)
        if compiled is not None and not getattr(compiled, "on_torch_stream", False):
            return "cluster %s runs through IREE's runtime" % module.name
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                val = node.meta.get("val")
                for v in (val if isinstance(val, (tuple, list)) else (val,)):
                    if isinstance(v, torch.Tensor) and v.device.type != device.type:
                        return "%s works on a %s tensor" % (node.target, v.device.type)
    return None


def _not_capturable_inputs(inputs: list, device: torch.device) -> str | None:
    for t in inputs:
        if t is None:   # an input of a template that this shape of it does not read
            continue
        if not isinstance(t, torch.Tensor):
            return "an input is a %s" % type(t).__name__
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            return "an input is on %s" % t.device
    return None


def _stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and CONFIG.cuda_graphs
