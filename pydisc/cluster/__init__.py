"""Partitioning of a functional graph into compiled clusters and eager ops."""
from .partition import Partition, partition_graph

__all__ = ["Partition", "partition_graph"]
