"""`python -m pydisc.cache info|clear`: inspect or empty the on-disk compile cache (docs/cache.md).

The logic lives in pydisc/exec/disk_cache.py; this module is only the entry point.
"""
from __future__ import annotations

import sys

from .exec.disk_cache import cache_command

__all__ = ["cache_command"]

if __name__ == "__main__":
    sys.exit(cache_command())
