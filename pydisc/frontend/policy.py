"""What pydisc does with an ATen op on a device, in one place: the policy tables and their reasons.

An op of a step takes one route. In the order a step meets them:

- `eager`: run at once while recording (it reads data on the host, or its output's shape depends on
  data, or it changes a tensor's metadata in place); `read` ops among them are not fallbacks;
- `decomposed`: torch's decomposition replaces it when the functional graph is made
  (`decompositions.py`), except the `whole` ops where the library route takes them;
- `library`: torch's own kernel (cuBLAS, cuDNN, oneDNN, its fused softmax and attention) runs it
  between the compiled clusters, by choice, not as a fallback;
- `compiled`: a StableHLO rule (`lowering/`) or the torch-mlir route compiles it inside a cluster;
- otherwise it runs in torch and is counted as a fallback.

Each table below is a `Rule`: the ops, the devices it applies to, the route, and why. The modules that
act on the policy (the recorder, the decomposition table, the partitioner, the attention rewrite) read
these tables and `library_ops_in_torch`; `python -m pydisc.explain OP` prints the route of an op.
docs/gpu.md has the measurements behind the GPU rules.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import CONFIG
from . import attention_ops

__all__ = ["ATTENTION_OPS", "CPU_ATTENTION", "CUDA_ATTENTION", "EAGER_OPS", "FREE_OPS", "KEPT_WHOLE", "LIBRARY_OPS",
           "READ_OPS", "RULES", "Rule", "SERIAL_SCATTERS", "SLOW_ON_GPU", "SOFTMAXES", "TORCH_MLIR_WRONG_VALUES",
           "library_ops_in_torch", "rules_for"]

aten = torch.ops.aten


def library_ops_in_torch(device: torch.device) -> bool:
    """Whether matmuls, convolutions, softmaxes and attention of a step on `device` run in torch's
    libraries between the clusters: on a GPU, unless PYDISC_GPU_MATMUL=iree; on the CPU with
    PYDISC_CPU_MATMUL=torch. The partition, the kept-whole decompositions and the attention rewrite
    all follow this one test."""
    if device.type == "cuda":
        return CONFIG.gpu_matmul != "iree"
    return device.type == "cpu" and CONFIG.cpu_matmul == "torch"


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _everywhere(device: torch.device) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    name: str
    route: str                                     # eager, read, whole, library, free, not-torch-mlir
    ops: frozenset
    applies: Callable[[torch.device], bool]        # on which devices
    why: str


# -- recording --------------------------------------------------------------------------------------

# Ops that read data on the host, move data between devices, or change a tensor's metadata in place.
EAGER_OPS = frozenset({
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.allclose.default,
    aten.nonzero.default, aten._unique2.default, aten.masked_select.default,
    aten.view.dtype, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
    aten.resize_.default, aten.as_strided_.default, aten._has_compatible_shallow_copy_type.default,
})
# Of those, the reads on the host (`.item()`, `bool()`, `torch.equal`): not counted as fallbacks.
READ_OPS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
                      aten.allclose.default})

# -- torch's libraries between the clusters ---------------------------------------------------------

# Softmax and log-softmax and their gradients: torch's fused kernels read each row once; IREE's code
# for the decomposition (max, exp and sum, normalise) ran several times slower on a GPU.
SOFTMAXES = frozenset({aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
                       aten._log_softmax_backward_data.default})
# F.scaled_dot_product_attention's CPU kernel: decomposed into matmuls and a softmax where those are
# compiled (sdpa.py), torch's fused kernel where they run in torch.
CPU_ATTENTION = frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                           aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
# pydisc's own attention kernels, which cluster/attention.py puts in place of written-out attention.
ATTENTION_OPS = frozenset({attention_ops.attention._opoverload, attention_ops.attention_backward._opoverload})
LIBRARY_OPS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
                         aten.convolution.default, aten.convolution_backward.default}) \
    | SOFTMAXES | ATTENTION_OPS | CPU_ATTENTION
# torch's CUDA attention kernels (flash, memory-efficient, cuDNN and their backwards): no decomposition,
# torch runs them between the clusters on a GPU whatever PYDISC_GPU_MATMUL says.
CUDA_ATTENTION = frozenset(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward") if hasattr(aten, name))
# Ops that IREE 3.13 lowers to a scatter whose coordinates may repeat, which its GPU code runs on one
# thread: on a GPU they run in torch, unless the partitioner sees that the lowering is a parallel
# one-hot select (one element per row: nll_loss's backward).
SERIAL_SCATTERS = frozenset({aten.index_put.default, aten.scatter.src, aten.scatter.value,
                             aten.scatter_add.default, aten.scatter_reduce.two,
                             aten.max_pool2d_with_indices_backward.default})
# Max pooling with indices (a variadic reduce_window) lost to torch in every cluster that held it; a
# concatenation is copied piece by piece by IREE's GPU code, one unvectorized dispatch each.
SLOW_ON_GPU = SERIAL_SCATTERS | {aten.max_pool2d_with_indices.default, aten.cat.default}

# -- decompositions ---------------------------------------------------------------------------------

# Op packets whose torch decomposition is not used where the library ops run in torch: they reach the
# library whole. (torch's decompositions of addmm and baddbmm compute in float32, which turned bf16
# linear layers into fp32 GEMMs; a softmax left whole runs as torch's fused kernel.)
KEPT_WHOLE = frozenset({aten.addmm, aten.baddbmm, aten._softmax, aten._log_softmax, aten._softmax_backward_data,
                        aten._log_softmax_backward_data, aten._scaled_dot_product_flash_attention_for_cpu,
                        aten._scaled_dot_product_flash_attention_for_cpu_backward})

# -- the partitioner's cost policy ------------------------------------------------------------------

# Ops that move no data: a cluster made only of these is not worth an executable call.
FREE_OPS = frozenset({operator.getitem, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                      aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
                      aten.alias.default, aten.detach.default, aten.expand.default, aten.permute.default,
                      aten.t.default, aten.transpose.int, aten.select.int, aten.slice.Tensor})

# -- the torch-mlir route ---------------------------------------------------------------------------

# Ops that torch-mlir imports and IREE compiles, but to wrong values (found by the OpInfo sweep:
# embedding_bag's results are all off; scatter_reduce sums duplicate indices wrongly with
# include_self=True), or whose compiled code writes into an input buffer (IREE 3.13 scatters
# torch-mlir's scatters in place into the caller's input). Never given to that route.
TORCH_MLIR_WRONG_VALUES = frozenset({
    aten._embedding_bag.default, aten._embedding_bag_forward_only.default, aten.scatter_reduce.two,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_add.default, aten.index_put.default, aten._unsafe_index_put.default})


RULES = (
    Rule("read", "read", READ_OPS, _everywhere, "reads a value on the host: run when read, not a fallback"),
    Rule("eager", "eager", EAGER_OPS - READ_OPS, _everywhere,
         "needs data on the host, a data-dependent shape or an in-place metadata change: run while recording"),
    Rule("library", "library", LIBRARY_OPS, library_ops_in_torch,
         "torch's library kernel (cuBLAS, cuDNN, oneDNN, fused softmax, attention) between the clusters "
         "(PYDISC_GPU_MATMUL on CUDA, PYDISC_CPU_MATMUL on the CPU)"),
    Rule("cuda-attention", "library", CUDA_ATTENTION, _on_cuda, "torch's fused CUDA attention kernel"),
    Rule("slow-on-gpu", "library", SLOW_ON_GPU, _on_cuda,
         "IREE's GPU code for it is slower than torch's (a serial scatter, max pooling, a piecewise concat); "
         "a scatter with one element per row is compiled"),
    Rule("kept-whole", "whole", frozenset(op for packet in KEPT_WHOLE for op in
                                          (getattr(packet, name) for name in packet.overloads())),
         library_ops_in_torch, "torch's decomposition is not used where the op runs in the library"),
    Rule("free", "free", FREE_OPS, _everywhere, "moves no data: a cluster of only such ops is not compiled"),
    Rule("torch-mlir-wrong", "not-torch-mlir", TORCH_MLIR_WRONG_VALUES, _everywhere,
         "torch-mlir's code for it is wrong (values, or writes its input): never compiled by that route"),
)


def rules_for(op: object, device: torch.device) -> list[Rule]:
    """The policy rules that apply to `op` on `device`, in the order a step meets them."""
    return [rule for rule in RULES if op in rule.ops and rule.applies(device)]
