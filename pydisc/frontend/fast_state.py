"""The fast recorder's per-process state (`FAST`): the open segment (frontend/segment.py) and the thread
that owns it, whether the step was demoted and which values of a demoted segment are still around, and
how each lazy module's forwards have fared (`GIVE_UP_AFTER`). frontend/fast.py drives it."""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .segment import Segment

__all__ = ["FAST", "GIVE_UP_AFTER"]


# Demotions of a module's forwards in a row after which it records op by op (fast.arm).
GIVE_UP_AFTER = 2


class _Fast:
    """The fast recorder's per-process state: the open segment and whether this step was demoted."""

    def __init__(self) -> None:
        self.segment: Segment | None = None
        self.armed = False          # a lazy module's forward began: its first call opens a segment
        # The thread whose forward is armed or recorded (None: no thread's). Only it changes `armed` and
        # `segment`; other threads' calls take the dispatcher's path meanwhile. Claimed and let go of under
        # `lock` (fast.arm, fast.park), so that two threads never share a segment, and the handler is
        # never taken off the class while a segment is open.
        self.owner: int | None = None
        self.lock = threading.Lock()
        self.demoted = False
        self.redirected = False     # some segment was demoted: its fast values may still be around
        self.redirects: list[weakref.ref] = []  # ... those values (`still_redirected`)
        self.last_alive = None      # the fast values alive at the last segment's end (`Segment.close`)
        self.cycles = True          # the last collection at a segment's end freed values of the segment
        self.installed = False      # fast recording is on (fast.install); its handler sits on the class only
                                    # while a forward records, or while a demoted segment's values live
        self.gate = None            # a function saying whether segments may start (dynamic shapes)
        self.default = "off"        # devices whose lazy modules (with no `fast_record` of their own) record fast
        self.refused = None         # why no more segments start in this process (a fused step that failed)
        self.armed_by = None        # (module, training mode) whose forward armed the next segment
        # module -> {training mode: its forwards' segments demoted in a row} (fast.arm gives up on a mode)
        self.demoted_in_a_row: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # module -> {(training mode, device): the calls of its last segment that closed} (Segment.follow)
        self.scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def still_redirected(self) -> bool:
        """Whether a value of a demoted segment is still alive: calls on it must be forwarded (fast.park)."""
        if self.redirected:
            self.redirects = [r for r in self.redirects if r() is not None]
            self.redirected = bool(self.redirects)
        return self.redirected

    def give_up(self, armed_by) -> None:
        """`armed_by`'s forwards in its mode are recorded op by op from the next one on (fast.arm)."""
        if armed_by is not None:
            module, training = armed_by
            self.demoted_in_a_row.setdefault(module, {})[training] = GIVE_UP_AFTER

    def note(self, armed_by, demoted: bool) -> None:
        """A segment that `armed_by`'s forward opened was demoted, or closed as a fused step."""
        if armed_by is None:
            return
        module, training = armed_by
        counts = self.demoted_in_a_row.setdefault(module, {})
        counts[training] = counts.get(training, 0) + 1 if demoted else 0


FAST = _Fast()
