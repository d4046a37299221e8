"""A step whose structure is not in the plan cache (`step._run`): matched to a dynamic-shape template,
run eagerly (a new graph before `PYDISC_COMPILE_AFTER`, a dim that changed size, a step with dynamic dims
that no template takes), recorded as a new template, or planned (`plan.build_plan`, here or in the
background). Also where templates are compiled, at their first match.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..config import CONFIG
from ..diagnostics import explain_recompile, log, warn_once
from ..frontend.lazy_tensor import RECORDER
from ..frontend.replay import NotDynamic, Program, concrete_program, program_from_trace, symbolic_program
from ..frontend.tensor import StrictModeError
from ..frontend.trace import Trace, storage_serial
from ..metrics import METRICS
from . import background, dynamic, fast_match, optimizer_state, template_match
from .bind import bind
from .dynamic import Binding
from .engine import ENGINE
from .oom import out_of_memory_in
from .plan import StepPlan, build_plan
from .slices import inputs_seen

__all__ = ["build_template", "plan_concrete", "plan_symbolic", "start_template"]


def _model_of(trace: Trace) -> tuple:
    """Which model a step trains, for telling its graph from another's (`ENGINE.seen_ops`): the
    storages it reads that no step made and that are not step inputs (parameters and buffers). Two
    models of one architecture and other widths (a sweep over hyperparameters in one process) have the
    same ops: without this the second one's first steps looked like the first one's with changed sizes,
    made those dims dynamic and pinned them to its weights' sizes."""
    return tuple(storage_serial(s) for s in trace.input_storages if s.produced is None and s.ordinal < 0)


def _ops_of(sig: tuple):
    """What an entry runs, for telling a step's graph from another's (`ENGINE.seen_ops`): its op, and for a
    forward recorded at `__torch_function__` the calls it made (every such step's op is "fused": two models
    would otherwise look like one graph whose input sizes changed)."""
    if sig[0] == "fused":
        return ("fused", tuple(call[0] for call in sig[1]))
    return sig[0]


def plan_concrete(trace: Trace, key: tuple, executed: list[int], outputs: tuple, inputs: list,
                   device: torch.device, remaining: list[int]):
    """A plan for a step structure not planned before: a dynamic template that matches it, or a new
    plan. None when the step ran eagerly: a dim of an input changed size (the next step records a
    dynamic-shape template instead of compiling for this one shape), or the structure is new
    (`PYDISC_COMPILE_AFTER`)."""
    ops = (tuple(_ops_of(sig) for sig in key[3]), _model_of(trace))
    if CONFIG.dynamic and ENGINE.dynamic.templates:
        if trace.fused:
            bindings = [fast_match.match_fast(trace, executed, outputs)]
        else:
            bindings = (template_match.match_template(template, trace, executed, outputs)
                        for template in ENGINE.dynamic.templates)
        for binding in bindings:
            if binding is not None:
                ENGINE.dynamic.misses = 0
                log("recompiles", "step matches a dynamic-shape plan with sizes %s", binding.sizes)
                METRICS.dynamic_matches += 1
                ENGINE.plans[key] = binding
                ENGINE.seen_ops[ops] = (key, inputs_seen(trace))
                return binding
    sources = [trace.entries[i].source for i in executed]
    seen, seen_inputs = ENGINE.seen_ops.get(ops, (None, None))
    shapes = inputs_seen(trace)
    program = program_from_trace(trace, executed, outputs)

    def run_now() -> None:
        """This step runs its recorded ops in torch and binds their results."""
        METRICS.steps += 1
        bind(trace, outputs, program(*inputs), executed, remaining)

    def run_eagerly(reason: str) -> None:
        METRICS.recompiles.append(reason)
        log("recompiles", "%s", reason)
        ENGINE.seen_ops[ops] = (key, shapes)
        METRICS.dynamic_eager_steps += 1
        run_now()

    if CONFIG.dynamic:
        changed = dynamic.changed_dims(seen_inputs, shapes, trace, seen, key) if seen is not None else {}
        if changed and dynamic.flag(changed):
            # the same ops as a step before, with other sizes: those dims are dynamic from now on
            run_eagerly(dynamic.describe(changed) + "; this step runs eagerly and the next one records "
                        "these dims as dynamic")
            return None
        state = ENGINE.dynamic
        missed = state.step_mode.get(RECORDER.step_id) is False and len(state.templates) < dynamic.MAX_TEMPLATES
        if missed and ENGINE.sightings[key] and state.last_miss < RECORDER.step_id - 1 and \
                state.replanned < dynamic.MAX_REPLANNED:
            # A step that ran before, sizes and all, and comes back after other steps (generate()'s last
            # token, beyond a guard of the template of its other tokens, at each call): planned for its
            # sizes as any step that comes back (below), up to `MAX_REPLANNED` per model. A new template,
            # recorded from whichever step came next, would not take it either.
            state.replanned += 1
        elif missed:
            # inputs with dynamic dims, recorded concretely, and no template fits (the first step of
            # an optimizer creates its state, later ones do not): run eagerly rather than compile for
            # these shapes; after two such misses, record the next step as a new template
            ENGINE.sightings[key] += 1
            state.last_miss = RECORDER.step_id
            state.misses += 1
            state.force_symbolic = state.misses >= 2 or dynamic.wants_unaligned_template()
            why = state.last_mismatch if state.templates else ""
            run_eagerly("a step with dynamic inputs matches no dynamic-shape plan%s; it runs eagerly%s" % (
                " (the last template tried: %s)" % why if why else "",
                " and the next one is recorded as a new template" if state.force_symbolic else ""))
            return None
    if ENGINE.sightings[key] + 1 < CONFIG.compile_after:
        # a graph seen for the first time runs eagerly; it is compiled when it comes back
        ENGINE.sightings[key] += 1
        ENGINE.seen_ops[ops] = (key, shapes)
        METRICS.steps_before_compile += 1
        log("recompiles", "a new step graph runs eagerly; it is compiled if it comes back")
        run_now()
        return None
    ENGINE.sightings.pop(key, None)
    if seen is not None and seen != key:
        # the same ops as a graph planned before: say what else changed
        reason = explain_recompile(seen, key, sources)
        if "eager input" in reason and CONFIG.dynamic:
            reason += " (an eager tensor has fixed sizes: pass it through pydisc.to_lazy() so that its " \
                      "sizes can vary without a compile per shape)"
        METRICS.recompiles.append(reason)
        log("recompiles", "planning again: %s", reason)
    ENGINE.seen_ops[ops] = (key, shapes)
    METRICS.graph_cache_misses += 1
    if background.enabled(device):
        # this step runs eagerly now, its plan is built in a thread (pydisc/driver/background.py)
        run_now()
        background.start(program, inputs, device, sources, lambda plan: _plan_ready(key, plan),
                         lambda exc: _plan_failed(key, program, exc))
        return None
    try:
        plan = build_plan(program, inputs, device, sources)
        METRICS.plans_compiled += 1
    except Exception as exc:     # noqa: BLE001 - a fault of pydisc's planning: the step runs in torch
        plan = _planning_failed(program, exc, "planning a step")
    except KeyboardInterrupt:
        # Ctrl-C during a long compile: finish this step eagerly, so that everything it made
        # (optimizer state included) holds data, then stop as asked.
        bind(trace, outputs, program(*inputs), executed, remaining)
        optimizer_state.completed()
        raise
    ENGINE.plans[key] = plan
    RECORDER.capture_sources = True
    return plan


def plan_symbolic(trace: Trace, executed: list[int], outputs: tuple, inputs: list,
                   scalars, device: torch.device):
    """Plan a step recorded with symbolic sizes once, as a template that later steps match."""
    sources = [trace.entries[i].source for i in executed]
    METRICS.graph_cache_misses += 1
    RECORDER.capture_sources = True
    session = trace.symbolic
    session.settle()
    ENGINE.dynamic.misses = 0
    patterns = [(o, rank, made) for o, (_, made, rank) in session.conversions.items()]
    try:
        program = symbolic_program(trace, executed, outputs)
    except NotDynamic as exc:
        reason = "a step with dynamic dims is planned for its own shapes only: %s" % exc
        warn_once("notdynamic:" + str(exc)[:80], "pydisc: " + reason)
        METRICS.recompiles.append(reason)
        ENGINE.dynamic.covered.update(patterns)
        program = concrete_program(trace, executed, outputs)
        METRICS.plans_compiled += 1
        try:
            return build_plan(program, inputs, device, sources), inputs, None
        except Exception as exc:     # noqa: BLE001
            return _planning_failed(program, exc, "planning a step"), inputs, None
    session.note_guards(None)
    session.multiples = dynamic.size_multiples(session, device)
    pinned = session.specialised()
    if pinned:
        parts = []
        for sym, value, where in pinned:
            kind, index, d = session.sources[sym]
            key = index if kind == "conv" else ("carried", index) if kind == "carried" else -1 - index
            ENGINE.dynamic.blocked.add((key, d))
            parts.append("%s dim %d was fixed to %d%s" % (
                dynamic.describe_input(key) if kind != "real" else "eager tensor #%d" % index, d, value,
                " at " + where if where else ""))
        reason = ("dynamic dims specialised: %s (the size was compared with a fixed one: an eager "
                  "tensor of that size, int(), range() or a Python branch); these dims are compiled per "
                  "shape. Pass eager tensors whose size varies through pydisc.to_lazy() or the lazy "
                  "model" % "; ".join(parts))
        warn_once("pinned:" + reason[:120], "pydisc: " + reason)
        METRICS.recompiles.append(reason)
    template = dynamic.make_template(trace, program, None)
    template.fakes, template.sources = _fake_inputs(trace, template, scalars), sources
    ENGINE.dynamic.templates.append(template)
    ENGINE.dynamic.covered.update(patterns)
    METRICS.dynamic_templates += 1
    log("recompiles", "planned a dynamic-shape step: symbols %s, %d guards",
        ", ".join("%s = input %s%d dim %d" % (sym, kind, i, d) for sym, kind, i, d in program.sym_sources),
        len(template.guards))
    call_inputs = [s.view(tuple(trace.metas[next(v for v, i, l in program.inputs if i == k and l is None)][0]))
                   if k in program.viewed else s for k, s in enumerate(trace.storage_inputs)]
    call_inputs += list(trace.real_inputs) + ([scalars] if scalars is not None else [])
    # The template is compiled when a later step matches it: the first steps of a training loop
    # often differ (an optimizer creates its state), and a template used once is not worth a compile.
    return StepPlan(program), call_inputs, None


def _plan_ready(key: tuple, plan: StepPlan) -> None:
    METRICS.plans_compiled += 1
    ENGINE.plans[key] = plan
    RECORDER.capture_sources = True


def _plan_failed(key: tuple, program: Program, exc: BaseException) -> None:
    ENGINE.plans[key] = _planning_failed(program, exc, "building a step's plan in the background")


def _planning_failed(program: Program, exc: BaseException, what: str) -> StepPlan:
    """Planning raised: a fault of pydisc's (eager runs the step), so the graph's plan runs its ops in
    torch from now on; warned once and counted in `compile_failures` ("planning:<exception>"). Strict
    mode's refusal and running out of memory are the user's to see: raised again."""
    if isinstance(exc, StrictModeError) or out_of_memory_in(exc):
        raise exc
    warn_once("planning:" + type(exc).__name__,
              "pydisc: %s failed (%s: %s); this graph runs eagerly from now on" % (what, type(exc).__name__, exc))
    METRICS.compile_failures["planning:" + type(exc).__name__] += 1
    return StepPlan(program, Counter(str(e[0]) for e in program.entries))


def start_template(template, device: torch.device) -> None:
    """Build a template's plan in a thread; when it is ready, the bindings matched meanwhile are checked
    against the guards that tracing added (those that break one are matched again)."""
    template.building = True
    METRICS.graph_cache_misses += 1

    def done(plan: StepPlan) -> None:
        template.plan, template.building = plan, False
        METRICS.plans_compiled += 1
        template.guards = template.session.guards()
        template.fakes = None
        for k, b in list(ENGINE.plans.items()):
            if type(b) is Binding and b.template is template and not template_match.guards_hold(template, b.sizes):
                del ENGINE.plans[k]

    def failed(exc: BaseException) -> None:
        template.building = False
        template.plan = _planning_failed(template.program, exc, "building a dynamic-shape plan in the background")
        template.guards = template.session.guards()
        template.fakes = None

    background.start(template.program, template.fakes, device, template.sources, done, failed,
                     template.session.multiples)


def build_template(binding, device: torch.device) -> bool:
    """Compile a template at its first match; False if the matched sizes break a guard that tracing
    the graph added (the template then serves only steps that satisfy it)."""
    template = binding.template
    METRICS.graph_cache_misses += 1
    try:
        template.plan = build_plan(template.program, template.fakes, device, template.sources,
                                   template.session.multiples)
        METRICS.plans_compiled += 1
    except Exception as exc:     # noqa: BLE001
        template.plan = _planning_failed(template.program, exc, "planning a dynamic-shape step")
    template.guards = template.session.guards()
    template.fakes = None
    return template_match.guards_hold(template, binding.sizes)


def _fake_inputs(trace: Trace, template, scalars) -> list:
    """Fake inputs (the recorded step's symbolic sizes) of a template's program, to plan it with."""
    session = trace.symbolic
    program = template.program
    fakes = []
    for k, s in enumerate(trace.storage_inputs):
        if k in program.viewed:
            vid = next(v for v, i, layout in program.inputs if i == k and layout is None)
            size, stride, _, dtype = trace.sym_metas[vid]
            fakes.append(session.fake_symbolic(size, stride, dtype, s.device))
        else:
            fakes.append(session.fake_static(tuple(s.shape), s.stride(), 0, s.dtype, s.device,
                                             s.untyped_storage().nbytes()))
    for (kind, index), types in zip(template.real_sources, template.real_types):
        if kind == "value":     # a value on sizes alone, computed in torch by the steps that match
            size, stride, _, dtype = trace.sym_metas.get(index) or trace.metas[index]
            fakes.append(session.fake_symbolic(size, stride, dtype, types[2]))
            continue
        t = trace.real_inputs[index]
        fake = session.real_fakes.get(id(t))
        if fake is None:
            fake = session.fake_static(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device,
                                       t.untyped_storage().nbytes())
        fakes.append(fake)
    if program.n_scalars:   # (fewer than the recorded step's where entries on sizes alone took some)
        fakes.append(session.fake_static((program.n_scalars,), (1,), 0, scalars.dtype, scalars.device,
                                         program.n_scalars * scalars.element_size()))
    return fakes
