"""Where in the user's code an op came from: the innermost frame outside torch, pydisc and the stdlib.

The caller frames are walked with a cache of "is this code object pydisc's, torch's or the stdlib's";
the usual five to ten frames between __torch_dispatch__ and the user's line cost 1-3 µs.
"""
from __future__ import annotations

import os
import sys
import sysconfig

import torch

__all__ = ["user_source"]

_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,   # the pydisc package
    sysconfig.get_paths()["stdlib"] + os.sep,
)
# id(code object) -> True when it belongs to torch, pydisc or the stdlib. Keyed by id: hashing a code
# object hashes its bytecode and constants, microseconds for a large function. _SEEN holds every code
# object met, so that no id is reused by another while it is a key here.
_INTERNAL: dict = {}
_SEEN: list = []


def user_source(depth: int = 2) -> str | None:
    """`file:line in function` of the first caller frame that is user code."""
    f = sys._getframe(depth)
    internal = _INTERNAL
    while f is not None:
        code = f.f_code
        skip = internal.get(id(code))
        if skip is None:
            name = code.co_filename
            skip = internal[id(code)] = name.startswith(_SKIP) or name.startswith("<frozen")
            _SEEN.append(code)
        if not skip:
            return "%s:%d in %s" % (code.co_filename, f.f_lineno, code.co_name)
        f = f.f_back
    return None
