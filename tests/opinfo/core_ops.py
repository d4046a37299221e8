"""Which OpInfo entries measure Core ATen coverage.

An OpInfo entry is selected when the ATen op it tests is in torch's Core ATen set (the overloads
tagged `torch.Tag.core`, ~160 op names): first by name (`OpInfo.aten_name` or `OpInfo.name`), then
through `_CORE_BY_OPINFO` for the core ops whose OpInfo is named after the Python API
(`nn.functional.conv2d` tests `convolution`, `softmax` tests `_softmax`, ...). Backward-only core ops
(`convolution_backward`, `native_layer_norm_backward`, `max_pool2d_with_indices_backward`, ...) are
covered by the backward cases of their forward ops. Core ops with no OpInfo (`sym_size`, `copy`,
`alias`, `col2im`) are not measured.
"""
from __future__ import annotations

from functools import cache
from typing import Any

import torch

from .harness import RANDOM_OPS, full_name

__all__ = ["core_aten_names", "core_opinfos", "DATA_DEPENDENT"]

# OpInfo name (with variant) -> the core ATen op it exercises.
_CORE_BY_OPINFO = {
    "nn.functional.adaptive_avg_pool1d": "adaptive_avg_pool1d",
    "nn.functional.adaptive_avg_pool2d": "_adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool3d": "_adaptive_avg_pool3d",
    "cdist": "_cdist_forward",
    "nn.functional.pdist": "_pdist_forward",
    "nn.functional.embedding_bag": "_embedding_bag",
    "fft.rfft": "_fft_r2c",
    "fft.irfft": "_fft_c2r",
    "item": "_local_scalar_dense",
    "log_softmax": "_log_softmax",
    "softmax": "_softmax",
    "nn.functional.batch_norm": "_native_batch_norm_legit",
    "to": "_to_copy",
    "nn.functional.conv1d": "convolution",
    "nn.functional.conv2d": "convolution",
    "nn.functional.conv3d": "convolution",
    "nn.functional.conv_transpose1d": "convolution",
    "nn.functional.conv_transpose2d": "convolution",
    "nn.functional.conv_transpose3d": "convolution",
    "nn.functional.elu": "elu",
    "nn.functional.embedding": "embedding",
    "__getitem__": "index",
    "nn.functional.max_pool2d": "max_pool2d_with_indices",
    "nn.functional.max_pool3d": "max_pool3d_with_indices",
    "nn.functional.group_norm": "native_group_norm",
    "nn.functional.layer_norm": "native_layer_norm",
    "nn.functional.pad.reflect": "reflection_pad2d",
    "nn.functional.pad.replicate": "replication_pad2d",
    "nn.functional.interpolate.bilinear": "upsample_bilinear2d",
    "nn.functional.interpolate.nearest": "upsample_nearest2d",
    "nn.functional.upsample_bilinear": "upsample_bilinear2d",
    "nn.functional.upsample_nearest": "upsample_nearest2d",
    "nn.functional.grid_sample": "grid_sampler_2d",
}

# Ops whose output shape depends on the data: pydisc runs them eagerly by design (static shapes).
DATA_DEPENDENT = {"nonzero", "item", "masked_select", "unique"}


@cache
def core_aten_names() -> frozenset[str]:
    names = set()
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not hasattr(packet, "overloads"):
            continue
        for overload in packet.overloads():
            if torch.Tag.core in getattr(packet, overload).tags:
                names.add(name)
                break
    return frozenset(names)


def core_op(op: Any) -> str | None:
    """The core ATen op that `op` tests, or None."""
    core = core_aten_names()
    for name in (op.aten_name, op.name):
        if name in core:
            return name
    return _CORE_BY_OPINFO.get(full_name(op), _CORE_BY_OPINFO.get(op.name))


def core_opinfos() -> list[Any]:
    """The selected OpInfo entries (random ops excluded: their values cannot be compared)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if core_op(op) is not None and op.name not in RANDOM_OPS]
