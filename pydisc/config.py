"""All user-facing settings in one place, read from environment variables."""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Config", "CONFIG"]


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


@dataclass
class Config:
    dump_dir: str = _env("PYDISC_DUMP_DIR")              # write each cluster's MLIR + partition summary
    disable: bool = _env("PYDISC_DISABLE") == "1"        # never compile: every op runs eagerly at mark_step
    min_cluster_ops: int = int(_env("PYDISC_MIN_CLUSTER_OPS", "1"))


CONFIG = Config()
