"""Why a compiled cluster cannot be launched directly."""
from __future__ import annotations

__all__ = ["LaunchUnsupported"]


class LaunchUnsupported(Exception):
    """The module uses something the direct launcher does not understand: it runs through IREE's runtime.

    Raised at plan time only (never once kernels were launched); the message is the reason counted in
    `metrics()["direct_launch_fallbacks"]`."""
