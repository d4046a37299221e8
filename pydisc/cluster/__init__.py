"""Partitioning of a functional graph into compiled clusters, torch-mlir regions and eager ops."""
from .attention import fuse_attention
from .pad_matmul import pad_unaligned_matmuls
from .partition import Partition, add_torch_mlir_regions, is_host_scalar, partition_graph, partition_regions

__all__ = ["Partition", "add_torch_mlir_regions", "fuse_attention", "is_host_scalar", "pad_unaligned_matmuls",
           "partition_graph", "partition_regions"]
