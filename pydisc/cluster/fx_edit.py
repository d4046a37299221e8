"""Graph edits shared by the rewrites that run before partitioning (pad_matmul, attention)."""
from __future__ import annotations

import contextlib

import torch
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg
from torch.utils._pytree import tree_leaves

__all__ = ["new_node", "refresh_val"]


def _fake_call(target, args: tuple, kwargs: dict, like: torch.fx.Node, swap: dict | None = None):
    vals = map_arg((args, kwargs), lambda n: (swap or {}).get(n, n).meta["val"])
    mode = detect_fake_mode(tree_leaves(vals)) or detect_fake_mode(tree_leaves(like.meta.get("val")))
    with mode or contextlib.nullcontext():
        return target(*vals[0], **vals[1])


def refresh_val(node: torch.fx.Node, swap: dict) -> None:
    """Recompute `node`'s FakeTensor value, reading each input found in `swap` as its replacement there
    (a value in another layout)."""
    node.meta["val"] = _fake_call(node.target, node.args, node.kwargs, node, swap)


def new_node(graph: torch.fx.Graph, target, args: tuple, kwargs: dict, like: torch.fx.Node) -> torch.fx.Node:
    """A call of `target` with its FakeTensor value (in the fake mode of its inputs, else of `like`:
    a factory), attributed to the source entry of `like`."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = _fake_call(target, args, kwargs, like)
    if "pydisc_entry" in like.meta:
        node.meta["pydisc_entry"] = like.meta["pydisc_entry"]
    return node
