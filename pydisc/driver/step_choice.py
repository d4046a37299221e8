"""The whole-step choice: compiled steps or plain eager execution, whichever is faster, measured.

Once a step graph repeats (plans from the cache `WARM` times in a row), windows of `WINDOW` steps are
timed, `ROUNDS` per mode, taking turns: compiled, then plain eager (the live lazy tensors released to
plain tensors in place, `frontend/release.py`, and made lazy again after). The fastest window of each
mode counts; eager kept is for the rest of the process, warned once and reported. Kept compiled steps
are watched on the CPU and timed again when their time drifts by `DRIFT`. Before that, once per process
(and again, up to `RECHECKS` times, when the steps turn to the other recording path), the probe times
one plain eager step against the recording of the step before: recording `RECORDING_BOUND` times as
slow keeps eager at once, without compiling. Runs that reads forced between two mark_steps count with
the mark's run as one step. `PYDISC_STEP_CHOICE`: `all` (default), `cuda`, `cpu` or `off`; not in a
torch.distributed process group, nor where several threads drive steps (`_several_threads`). The policy
and what it measured: docs/gpu.md ("Whole steps are compared too").
"""
from __future__ import annotations

import gc
import time

import torch

from ..config import CONFIG, applies
from ..diagnostics import log, warn_once
from ..exec import graphs
from ..frontend.release import release_all, restore
from ..metrics import METRICS
from . import inflight
from .engine import ENGINE, ChoiceState, ReadRuns

__all__ = ["after_mark_step", "distributed", "holds_passthrough", "measuring", "note_read_run", "reset"]

WARM = 3        # cached runs in a row before measuring
WINDOW = 4      # steps per timed window (after one untimed step)
ROUNDS = 2      # windows per mode, taking turns: compiled, eager, compiled, eager
PROBE_AFTER = 2         # the recorded step whose recording the plain eager step is compared with
RECORDING_BOUND = 1.3   # recording a step this many times slower than a plain eager step: eager kept
WATCH = 50      # compiled steps kept: the median time between this many mark_steps is watched
DRIFT = 1.5     # ... and one this many times slower or faster than the compiled windows: measured again
RECHECKS = 3    # at most this many times per process
OFF_PATH_STEPS = 8      # steps in a row of new sizes not probed (`after_mark_step`), at most
RECAPTURED = 8  # compiled windows timed again because a step of theirs was captured as a CUDA graph or ran
                # before its capture, at most (a dynamic-shape template at 4 lengths has 12 such steps)


def reset() -> None:
    """Forget the measurement and leave pass-through (a new lazy model after eager was kept; tests)."""
    ENGINE.reset_choice()


def _background_passthrough() -> bool:
    """Whether ops pass through because a plan is being built in the background (not for this module's
    own timed eager steps)."""
    return ENGINE.passthrough and not holds_passthrough()


def holds_passthrough() -> bool:
    """Whether pass-through is this module's: an eager window, the timed plain step, or eager kept."""
    return measuring() or ENGINE.released


def measuring() -> bool:
    """Whether plain eager steps are being timed (the probe, an eager window): their mark_step, with
    nothing recorded, must still reach `after_mark_step`."""
    return ENGINE.choice.probe is not None or ENGINE.choice.phase == "eager"


_host_clock = time.perf_counter


def _now(device: torch.device, settle: bool = True) -> float:
    """The time once the device has run what was queued (a compiled CPU step may still run on the worker
    thread: inflight.py); `settle=False` on the CPU: the time now, such a step still running."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif settle:
        inflight.wait("step choice")
    return time.perf_counter()


def after_mark_step(key, cached: bool, device: torch.device | None, recorded: float = 0.0,
                    fused: bool = False, off_path: bool = False) -> None:
    """Called at the end of each `mark_step()`: `key` says which plan the step ran (None: nothing ran, or
    a plan not reusable), `cached` whether it came from the plan cache, `recorded` the seconds the
    step spent recording ops (less meta kernels; 0: it recorded none), `fused` whether the fast
    recorder recorded its forward, `off_path` whether its recording is not what the steps to come will
    cost: recorded op by op only because its input sizes were new (dynamic.py: the steps of sizes seen
    before record fast), or recorded twice, fast and then op by op, because the fast recorder gave up on
    its forward midway (the steps to come record fast again, or op by op from the start once a module's
    forwards were given up on: fast.arm)."""
    s = ENGINE.choice
    if s.several_threads and not (s.phase == "decided" and s.kept_compiled is None):
        _several_threads(s)
        return
    through, s.through = s.through, _background_passthrough()
    if s.reads is not None:
        # runs that reads forced since the last mark_step count with its own: one step from mark_step
        # to mark_step (HF `generate()` runs a step per token at its read, then the loop's mark_step)
        r, s.reads = s.reads, None
        keys, all_cached = r.keys, r.cached
        if key is not None or device is not None:
            keys.append(key)
            all_cached = all_cached and cached
        key = None if None in keys else tuple(keys)
        cached, device = all_cached, device or r.device
        recorded, fused = recorded + r.recorded, fused or r.fused
        through = through or r.through
    if through:
        # some ops of this step passed through (a plan was being built in the background): neither
        # its recording nor its time is the step's
        key, recorded = None, 0.0
    if off_path and recorded:
        if s.off_path < OFF_PATH_STEPS:
            # Not the recording the steps to come will have: neither probed nor a reason to probe again.
            # (A model of variable-length batches would otherwise be judged by its first new length,
            # recorded op by op and symbolically at several times the cost of its steps of lengths seen
            # before.) Where sizes keep coming new, this is the steps' recording after all.
            s.off_path += 1
            recorded = 0.0
    elif recorded:
        s.off_path = 0
    if s.probe is not None:
        _end_probe(s)
        return
    if s.phase == "decided":
        if s.kept_compiled is not None and s.device.type == "cpu":
            _watch(s, key if cached else None)
        return
    if recorded and s.probed is not None and fused != s.probed and s.phase in ("idle", "compiled") and \
            s.reprobes < RECHECKS:
        # the probe timed the other recording path's steps (the fast recorder gave up on the model, or
        # its steps record fast from now on): probe these steps again
        s.reprobes += 1
        s.probed, s.recorded_steps = None, 0
        s.phase, s.streak, s.times = "idle", 0, {"compiled": [], "eager": []}
        s.recaptured = 0
        log("plans", "step choice: steps now recorded %s, probed again", "fast" if fused else "op by op")
    if recorded and s.recorded_steps < PROBE_AFTER and s.phase == "idle" and device is not None and \
            applies(CONFIG.step_choice, device) and not distributed():
        s.recorded_steps += 1
        if s.recorded_steps >= PROBE_AFTER:
            s.probed = fused
            _start_probe(s, recorded, device)
            return
    if s.phase == "eager":
        if _window_done(s, "eager"):
            if len(s.times["eager"]) == ROUNDS:
                _decide(s)
            elif _relazy(s):
                s.phase = "compiled"
                ENGINE.set_passthrough(False)
        return
    if key is None or not cached or device is None or not applies(CONFIG.step_choice, device) or \
            distributed():
        # a step that planned and compiled, or one not measurable
        if s.times["eager"]:
            _decide(s)          # (back from eager, the step graph changed): decide on the windows timed
        else:
            s.phase, s.streak = "idle", 0
            s.times["compiled"].clear()
        return
    # Steps whose plans come from the cache, in a row: not necessarily one plan (a plan per sequence
    # length, steps that alternate between two graphs).
    s.streak += 1
    if s.phase == "idle":
        if s.streak >= WARM:
            s.phase, s.device, s.steps = "compiled", device, 0
        return
    s.window_keys.add(key)
    if _window_done(s, "compiled"):
        s.phase = "eager"
        graphs.make_room(s.device)     # eager steps may need the memory the captured steps hold
        _release(s)


def note_read_run(key, cached: bool, device: torch.device | None, recorded: float, fused: bool) -> None:
    """A read ran (part of) the pending step (arguments as for `after_mark_step`): noted for the next
    mark_step."""
    s = ENGINE.choice
    if s.phase == "decided" and s.kept_compiled is None:
        return
    if s.reads is None:
        s.reads = ReadRuns()
    r = s.reads
    r.keys.append(key)
    r.cached = r.cached and cached
    r.device = r.device or device
    r.recorded += recorded
    r.fused = r.fused or fused
    r.through = r.through or _background_passthrough()     # the ops after this run pass through


def _release(s: ChoiceState) -> None:
    """Plain eager steps from here on, until `_relazy`: the lazy tensors are released (made plain in
    place), so that their ops run in torch without entering pydisc, and what they cost is eager's."""
    s.released, s.kept = [], []
    release_all(s.released, s.kept)
    ENGINE.set_passthrough(True)
    ENGINE.set_released(True)


def _relazy(s: ChoiceState) -> bool:
    """Recorded steps again: what `_release` released is made lazy again in place. False where some
    tensor could not be (something else holds it): eager is then kept, which is always correct."""
    released, s.released = s.released or [], None
    failed = restore(released)
    if failed:
        s.phase = "decided"
        METRICS.step_choice += "; %d released tensors could not be made lazy again -> eager" % failed
        # (they stay plain; the others are lazy again, and released anew)
        _keep_eager(s, "%d tensors released for timed eager steps could not be made lazy again" % failed, failed)
        return False
    ENGINE.set_released(False)
    _record_again()
    return True


def _record_again() -> None:
    """Steps record from the next one on, or pass through while a plan is built in the background."""
    ENGINE.set_passthrough(bool(ENGINE.jobs))


def _start_probe(s: ChoiceState, recorded: float, device: torch.device) -> None:
    """The next step runs plainly in torch, timed."""
    _release(s)
    s.probe = [recorded, _now(device), device]


def _end_probe(s: ChoiceState) -> None:
    recorded, started, device = s.probe
    eager = _now(device) - started
    s.probe = None
    keep_eager = recorded > RECORDING_BOUND * eager
    METRICS.step_choice = "recorded in %.2f ms, a plain eager step ran in %.2f ms -> %s" % (
        1e3 * recorded, 1e3 * eager, "eager, not compiled" if keep_eager else "recording")
    log("plans", "step choice: %s", METRICS.step_choice)
    if keep_eager:
        s.phase = "decided"
        _keep_eager(s, "recording a step took %.2f ms, a plain eager step %.2f ms: a compiled step cannot be "
                    "faster than its recording" % (1e3 * recorded, 1e3 * eager))
        return
    _relazy(s)


def _window_done(s: ChoiceState, mode: str) -> bool:
    """Count a step of `mode`; at the end of its window, its time per step (and the next window starts).
    The timer starts once the window's first step is done. A compiled window on the CPU ends when its
    last mark_step returns, that step's run maybe still going on the worker thread (inflight.py): it
    started with none running, so its first step recorded with nothing beside it, and in a run of such
    steps each costs what one costs in the window (waiting for it at the end would count a run twice)."""
    s.steps += 1
    if s.steps == 1:
        s.started = _now(s.device)
        s.captures = _graph_warmups()
        return False
    if s.steps <= WINDOW:
        return False
    if mode == "compiled" and _graph_warmups() != s.captures and s.recaptured < RECAPTURED:
        # a step of the window was captured as a CUDA graph (a shape of a dynamic-shape template run for
        # the third time), or ran kernel by kernel before its capture (its first two runs), once, like a
        # compile: not what the steps cost. Timed again from here.
        s.recaptured += 1
        s.steps = 1
        s.started = _now(s.device)
        s.captures = _graph_warmups()
        log("plans", "step choice: a compiled window captured a CUDA graph or ran a step before its capture; "
            "timed again")
        return False
    s.times[mode].append((_now(s.device, settle=mode != "compiled") - s.started) / WINDOW)
    s.steps = 0
    log("plans", "step choice: %s window, %.2f ms per step", mode, 1e3 * s.times[mode][-1])
    return True


def _graph_warmups() -> int:
    """The steps so far that cost what a CUDA graph's capture costs, once: its capture, and the runs before
    it, kernel by kernel (exec/graphs.py)."""
    return METRICS.cuda_graph_captures + METRICS.cuda_graph_warmups


def distributed() -> bool:
    """Ranks would time and decide each on its own, and could end up in different modes: not measured
    in a process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _decide(s: ChoiceState) -> None:
    # the fastest window of each mode: another process's load only ever slows a window down
    compiled, eager = min(s.times["compiled"]), min(s.times["eager"])
    keep_eager = eager < compiled
    s.phase = "decided"
    METRICS.step_choice = "%scompiled %.2f ms, eager %.2f ms per step -> %s" % (
        s.again, 1e3 * compiled, 1e3 * eager, "eager" if keep_eager else "compiled")
    s.kept_compiled = None if keep_eager else compiled
    s.last_mark, s.skip, s.intervals = None, WATCH, []
    if keep_eager:
        _keep_eager(s, "steps ran faster eagerly (%.2f ms) than recorded and compiled (%.2f ms)" % (
            1e3 * eager, 1e3 * compiled))
    elif s.released is not None:
        _relazy(s)      # decided at the end of an eager window
    else:
        _record_again()


def _watch(s: ChoiceState, key) -> None:
    """Compiled steps kept on the CPU: the host time from one `mark_step` to the next is noted (a CPU step
    has run when its mark_step returns, or, run on the worker thread, when the next one's has waited for
    it: in a run of steps, the same time per step) where both steps ran plans that the
    compiled windows ran (`key`: None for a step that planned; a loop that turns to other steps, say
    sampling after training, is not the machine changing), and the median of each `WATCH` of them
    compared with the compiled windows' time per step (a median, because what the loop does between
    some steps counts too: an evaluation, a checkpoint, the bench's other modes). One `DRIFT` times slower
    or faster says the machine changed under the measurement (another process's load came or went:
    eager CPU ops on two cores ran 9x slower while a test suite ran beside them, compiled ones 2x), and
    the windows are timed again, up to `RECHECKS` times per process. The `WATCH` steps after a decision
    are not noted: the first ones still settle (memory given back by the windows, caches warming)."""
    if key not in s.window_keys:
        s.last_mark = None
        return
    now = _host_clock()
    last, s.last_mark = s.last_mark, now
    if last is None:
        return
    if s.skip:
        s.skip -= 1
        return
    s.intervals.append(now - last)
    if len(s.intervals) < WATCH:
        return
    per_step = sorted(s.intervals)[WATCH // 2]
    s.intervals = []
    if s.rechecks < RECHECKS and not s.kept_compiled / DRIFT <= per_step <= s.kept_compiled * DRIFT:
        s.rechecks += 1
        s.again = "measured again (compiled steps took %.2f ms, against %.2f in the windows): " % (
            1e3 * per_step, 1e3 * s.kept_compiled)
        s.kept_compiled = None
        s.phase, s.steps, s.recaptured = "compiled", 0, 0
        s.times = {"compiled": [], "eager": []}
        s.window_keys = set()


def _several_threads(s: ChoiceState) -> None:
    """Steps are driven from several threads (each training its own model, or one recording while another
    marks): releasing the lazy tensors for timed eager steps, or making them lazy again, would swap
    tensors under another thread's step (`Engine.note_thread`). Compiled steps are kept, unmeasured; where
    tensors are released at the moment (the probe, an eager window), eager is kept instead, without
    walking the process's objects again (that would release the tensors of a step under way): lazy
    tensors made since pass their ops through to torch."""
    if s.probe is not None or s.released is not None:
        s.probe = None
        s.phase = "decided"
        METRICS.step_choice = "timed eager steps were running when steps came from several threads -> eager"
        _keep_eager(s, "a second thread drove steps while the lazy tensors were released for timed eager "
                    "steps, which cannot be made lazy again under its step", walk=False)
        return
    s.phase, s.kept_compiled = "decided", None
    if CONFIG.step_choice != "off":
        METRICS.step_choice = "not measured: steps are driven from several threads -> compiled"
        log("plans", "step choice: %s", METRICS.step_choice)


def _keep_eager(s: ChoiceState, why: str, plain_before: int = 0, walk: bool = True) -> None:
    """Pass-through for the rest of the process, every lazy tensor that can be released made plain
    (`plain_before`: how many are plain already, besides what the probe or an eager window released).

    Where the probe or an eager window just released everything it could (`s.released`), nothing has
    recorded since, so walking every object of the process again (`release_all`, ~110 ms on the H200
    host) finds nothing new, unless a tensor it could not release is still alive (the step before's loss,
    with its autograd history, usually is not by then)."""
    released_before, s.released = s.released, None
    walk = walk and (released_before is None or any(ref() is not None for ref in s.kept))
    if walk and released_before is not None:
        # a tensor it kept may be cyclic garbage not collected yet (the recorder pauses the cyclic
        # collector while a step records): collecting is cheaper than walking every object again
        gc.collect()
        walk = any(ref() is not None for ref in s.kept)
    s.kept = []
    ENGINE.set_passthrough(True)
    graphs.release_memory()
    released, kept = release_all() if walk else (0, 0)
    released += plain_before + len(released_before or ())
    ENGINE.set_released(True)
    METRICS.step_choice += " (%d lazy tensors released to plain, %d kept lazy)" % (released, kept)
    warn_once("step-choice", "pydisc: %s; from now on every op runs in torch at once, nothing is compiled "
              "(PYDISC_STEP_CHOICE=off keeps compiling)" % why)
