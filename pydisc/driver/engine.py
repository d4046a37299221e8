"""The one owner of the step driver's per-process state: `ENGINE`.

Everything the driver remembers between two `mark_step()`s lives here, so that one `reset()` forgets
all of it (tests, `clear_plans`, the exit handler) and a reader finds it in one place:

- `plans`, `seen_ops`, `sightings`: the plan cache by a step's structural key (step.py);
- `dynamic`: the dynamic-shape templates and flagged dims of the current step's model (dynamic.py);
- `choice`: the whole-step choice's measurement (step_choice.py);
- `jobs`: the plans being built in the background (background.py);
- `in_flight`, `worker`: a compiled CPU step running on a worker thread (inflight.py);
- `intervals`: who shortened the GIL's switch interval, and for how long (background jobs, a run in flight);
- the step mode: whether the recorder passes ops through to torch (`set_passthrough`) and whether the
  live lazy tensors were made plain (`set_released`); the recorder reads it, only the driver sets it.

The modules keep their logic; their state is `ENGINE`'s attributes.
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..exec import graphs
from ..frontend.lazy_tensor import RECORDER

__all__ = ["ENGINE", "ChoiceState", "DynamicState", "Engine"]

_thread = threading.get_ident


@dataclass
class DynamicState:
    """Dynamic shapes (dynamic.py). An input is a step input by its ordinal (an int), or ("carried", k):
    the k-th input storage of the step, a lazy tensor an earlier step made (a KV cache)."""
    flagged: dict = field(default_factory=dict)      # input -> dims
    covered: set = field(default_factory=set)        # (input, rank, dims >= 2) with a template
    templates: list = field(default_factory=list)
    step_mode: dict = field(default_factory=dict)    # step id -> True (symbolic) / False (concrete)
    force_symbolic: bool = False                     # no template matched: record the next step
    misses: int = 0                                  # steps in a row that matched no template
    last_miss: int = -2                              # the step id of the last of them
    replanned: int = 0                               # steps that missed and came back, planned for their sizes
    blocked: set = field(default_factory=set)        # (input, dim) that guards pinned: static
    last_mismatch: str = ""                          # why the last step matched no template
    fast_misses: int = 0                             # fast-recorded steps in a row no template took
    fast_refused: bool = False                       # ... too many: the dispatcher records (fast_match.py)
    shapes_seen: dict = field(default_factory=dict)  # step input shapes (and prefixes) seen, in order
    new_sizes: bool = False                          # a forward of this step was gated for its new sizes
    unaligned: bool = False                          # a size broke a template's multiple: new ones assume none


class ChoiceState:
    """The whole-step choice's measurement (step_choice.py)."""

    def __init__(self) -> None:
        self.phase = "idle"        # idle -> compiled <-> eager -> decided
        self.streak = 0            # cached runs in a row
        self.device: torch.device | None = None
        self.started = 0.0         # when the timed part of the window started (synchronised)
        self.steps = 0             # steps of that window so far, its untimed first step included
        self.captures = 0          # CUDA graph captures and runs before them, before the window's timed
                                   # steps (METRICS)
        self.recaptured = 0        # compiled windows timed again because they held one
        self.times: dict[str, list[float]] = {"compiled": [], "eager": []}   # seconds per step, per window
        self.recorded_steps = 0    # steps that recorded ops, until the probe
        self.probed: bool | None = None    # whether the probed step was fast-recorded (`fused`)
        self.reprobes = 0          # probes again because the recording path changed
        self.off_path = 0          # steps in a row recorded op by op only because their sizes were new
        self.reads: ReadRuns | None = None   # runs forced by reads since the last mark_step
        self.through = False       # pass-through was on when the last mark_step ended
        # the plain eager step being timed: [seconds the step before took to record, when the timed step
        # began, device]
        self.probe: list | None = None
        self.released: list | None = None    # what the probe or an eager window released, to restore
        self.kept: list = []       # ... and weak references to the lazy tensors it could not release
        # compiled steps kept: their time per step in the windows; the last mark_step's host time, steps
        # not to note, the noted times between mark_steps
        self.kept_compiled: float | None = None
        self.last_mark: float | None = None
        self.skip = 0
        self.intervals: list[float] = []
        self.window_keys: set = set()      # the plans the compiled windows ran
        self.rechecks = 0
        self.again = ""            # why the windows are timed again, for the report
        # the thread that drives the steps (lazy modules' forwards, mark_step, to_lazy), and whether another
        # one did too: then nothing is measured (`Engine.note_thread`)
        self.thread: int | None = None
        self.several_threads = False


@dataclass
class ReadRuns:
    """The runs that reads forced between two mark_steps, counted with the mark's own run as one step."""
    keys: list = field(default_factory=list)
    cached: bool = True            # every one of them found its plan in the cache
    device: torch.device | None = None
    recorded: float = 0.0          # seconds spent recording them
    fused: bool = False            # some were fast-recorded
    through: bool = False          # ops passed through after one (a plan was being built)


class Engine:
    def __init__(self) -> None:
        self.plans: dict[tuple, object] = {}     # structural key -> StepPlan, or a template's Binding
        self.seen_ops: dict[tuple, tuple] = {}   # op sequence -> last key planned for it (recompile explainer)
        self.sightings: Counter = Counter()      # structural key -> steps run eagerly before it is compiled
        # dynamic-shape state per model: the module whose forward began the step (`enter_scope`), None
        # until a lazy module's forward began one
        self._dynamic_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._dynamic_default = DynamicState()
        self._scope: weakref.ref | None = None
        self._scope_step = -1
        self.choice = ChoiceState()
        self.jobs: list = []                     # background.py's jobs, oldest first
        self.in_flight = None                    # inflight.InFlight: the run on the worker, not yet bound
        self.worker = None                       # inflight.Worker, made at the first deferred run
        self.intervals: dict[str, float] = {}    # holder -> the switch interval it asked for
        self.saved_interval: float | None = None  # the process's own, while some holder is there
        self.keeping = None                      # the plan whose clusters keep their outputs (plan.keep_base_outputs)
        self.scalars: tuple | None = None        # (values, device, tensor): the last step's lifted scalars (step.py)

    # ---- the step mode the recorder reads ------------------------------------------------------
    @staticmethod
    def set_passthrough(on: bool) -> None:
        """Every op runs at once in torch, nothing is recorded (eager kept or timed, a plan being built)."""
        RECORDER.passthrough = on

    @staticmethod
    def set_released(on: bool) -> None:
        """The live lazy tensors were made plain (frontend/release.py): step inputs stay plain too."""
        RECORDER.released = on

    @property
    def passthrough(self) -> bool:
        return RECORDER.passthrough

    @property
    def released(self) -> bool:
        return RECORDER.released

    def shorten_interval(self, holder: str, seconds: float) -> None:
        """A shorter GIL switch interval while `holder` needs it: a thread of pydisc's waits for the GIL
        while the main thread runs Python (background.py, inflight.py say why and how long)."""
        if self.saved_interval is None:
            self.saved_interval = sys.getswitchinterval()
        self.intervals[holder] = seconds
        sys.setswitchinterval(min(self.saved_interval, *self.intervals.values()))

    def restore_interval(self, holder: str | None = None) -> None:
        """`holder` no longer needs a short interval (None: none does); the process's own is put back
        when no holder is left."""
        if holder is None:
            self.intervals.clear()
        else:
            self.intervals.pop(holder, None)
        if self.saved_interval is None:
            return
        if self.intervals:
            sys.setswitchinterval(min(self.saved_interval, *self.intervals.values()))
        else:
            sys.setswitchinterval(self.saved_interval)
            self.saved_interval = None

    def reset(self) -> None:
        """Forget every plan, template and measurement; wait for the plans being built and drop them;
        leave pass-through. The compile caches (exec/) are not touched."""
        for job in list(self.jobs):
            job.thread.join()
        self.jobs.clear()
        self.restore_interval()
        graphs.release_memory()
        self.keeping = None
        self.scalars = None
        self.plans.clear()
        self.seen_ops.clear()
        self.sightings.clear()
        self.reset_dynamic()
        self.reset_choice()
        RECORDER.capture_sources = True     # the next step plans: its ops' source lines are wanted

    @property
    def dynamic(self) -> DynamicState:
        """The dynamic-shape state of the current step's model (the last one's, between steps). Dims
        are flagged, pinned and covered by a step input's ordinal: kept per model, one model's varying
        batch neither makes another's dynamic nor keeps the fast recorder from it."""
        scope = self._scope() if self._scope is not None else None
        if scope is None:
            return self._dynamic_default
        state = self._dynamic_states.get(scope)
        if state is None:
            state = self._dynamic_states[scope] = DynamicState()
        return state

    def enter_scope(self, module) -> None:
        """A lazy module's forward begins: unless the step has its model already, it is `module`'s, and so
        are the dims flagged dynamic, the pins and templates its steps use (`dynamic`). A step that no
        lazy module's forward begins (`pydisc.to_lazy` alone, HF generate()'s code between two calls of
        the model) is the model's of the step before."""
        if self._scope_step != RECORDER.step_id:
            self._scope_step = RECORDER.step_id
            self._scope = weakref.ref(module)     # (not kept alive by it)

    def note_thread(self) -> None:
        """A lazy module's forward, `mark_step` or `to_lazy` on this thread. The whole-step choice swaps
        every lazy tensor of the process for a plain one and back (step_choice.py), which a step that
        another thread is recording at that moment cannot survive (its autograd graph holds the tensors
        swapped). Once a second thread drives steps, nothing is released: the note is taken under the
        recorder's lock, which `mark_step` holds while it measures, so a thread's first forward comes
        either before a release (and none happens) or after it (and finds its tensors plain)."""
        c = self.choice
        me = _thread()
        if me != c.thread and not c.several_threads:
            with RECORDER.lock:
                if c.thread is None:
                    c.thread = me
                elif me != c.thread:
                    c.several_threads = True

    def reset_dynamic(self) -> None:
        """Forget the templates and the dims flagged dynamic: the next steps are static until sizes vary."""
        self._dynamic_states = weakref.WeakKeyDictionary()
        self._dynamic_default = DynamicState()
        RECORDER.carried_dims = None
        RECORDER.last_input_shapes = []

    def reset_choice(self) -> None:
        """Forget the whole-step choice's measurement and leave pass-through."""
        self.choice = ChoiceState()
        self.set_passthrough(False)
        self.set_released(False)


ENGINE = Engine()
