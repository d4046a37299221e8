"""Where in the user's code an op came from: the innermost frame outside torch, pydisc and the stdlib."""
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


def user_source(depth: int = 2) -> str | None:
    """`file:line in function` of the first caller frame that is user code (about 1-2 µs)."""
    f = sys._getframe(depth)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_SKIP) and not name.startswith("<frozen"):
            return "%s:%d in %s" % (name, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None
