"""Partitioning of a functional graph into compiled clusters and eager ops."""
from .partition import Partition, is_host_scalar, partition_graph

__all__ = ["Partition", "is_host_scalar", "partition_graph"]
