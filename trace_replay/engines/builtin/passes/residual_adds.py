"""A compiler pass: a residual add that follows a one-row GEMV, inside the GEMV's launch.

A decoder layer ends with ``residual + down_proj(...)`` (and Llama-like layers add
``o_proj``'s output to the residual mid-layer). In a compiled layer at one row the
projection is the opaque ``trace_replay::gemv`` (:func:`~trace_replay.kernels.gemv.gemv`),
so the add cannot fuse into it: nothing follows the last add in a layer's graph, and the
add becomes a launch of its own, 32 per step at Llama-3.1-8B's shape, each costing more
in latency than its 8 KiB of data.

:class:`FoldResidualAdds`, an inductor post-grad pass, rewrites ``add(gemv(x, W, b), r)``
(either order, through views) into ``gemv_add(x, W, b, r)``: the kernel adds ``r`` in
float32 to its float32 product and rounds once, where the model rounds the product and
then the sum. So the result is the float32 sum more closely than the model's, and agrees
with it to the dtype's rounding. The add is folded only where the GEMV's output has no
other use, ``r`` has the add's shape (no broadcast) and all three share a dtype.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from trace_replay.engines.builtin.passes.graph_nodes import VIEWS, arguments
from trace_replay.kernels import gemv as _gemv

__all__ = ["FoldResidualAdds"]

_GEMV = torch.ops.trace_replay.gemv.default
_ADD = torch.ops.aten.add.Tensor


class FoldResidualAdds(CustomGraphPass):
    """Inductor post-grad pass (``torch.compile(options={"post_grad_custom_post_pass": ...})``)
    folding ``add(gemv(...), r)`` into ``trace_replay::gemv_add``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target is _ADD and not node.kwargs and len(node.args) == 2:
                for ours, other in (node.args, node.args[::-1]):
                    chain = _gemv_chain(ours)
                    if chain and _foldable(node, chain[-1], other):
                        _fold(graph, node, chain, other)
                        break

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, _gemv.__file__))


def _gemv_chain(node) -> list[torch.fx.Node] | None:
    """``[node, views..., gemv]`` when ``node`` is a GEMV's output through views that have
    no other use; else None."""
    chain = []
    while isinstance(node, torch.fx.Node) and len(node.users) == 1:
        chain.append(node)
        if node.target is _GEMV:
            return chain
        if node.target not in VIEWS:
            return None
        node = node.args[0]
    return None


def _foldable(add: torch.fx.Node, gemv: torch.fx.Node, other) -> bool:
    if not isinstance(other, torch.fx.Node) or "val" not in other.meta:
        return False
    out, product, residual = add.meta["val"], gemv.meta["val"], other.meta["val"]
    return (
        residual.shape == out.shape
        and out.numel() == product.numel()
        and residual.dtype == out.dtype == product.dtype
    )


def _fold(graph: torch.fx.Graph, add: torch.fx.Node, chain: list, other: torch.fx.Node) -> None:
    gemv = chain[-1]
    x, weight, bias = arguments(gemv, "x", "weight", "bias")
    product = gemv.meta["val"]
    fake_mode = product.fake_mode
    with graph.inserting_before(add):
        residual = graph.call_function(torch.ops.aten.reshape.default, (other, list(product.shape)))
        fused = graph.call_function(
            torch.ops.trace_replay.gemv_add.default, (x, weight, bias, residual)
        )
        out = graph.call_function(
            torch.ops.aten.reshape.default, (fused, list(add.meta["val"].shape))
        )
    with fake_mode:
        residual.meta["val"] = other.meta["val"].reshape(product.shape)
        fused.meta["val"] = torch.ops.trace_replay.gemv_add.default(
            x.meta["val"],
            weight.meta["val"],
            None if bias is None else bias.meta["val"],
            residual.meta["val"],
        )
        out.meta["val"] = fused.meta["val"].reshape(add.meta["val"].shape)
    add.replace_all_uses_with(out)
    graph.erase_node(add)
    for node in chain:  # the add's operand first, the GEMV last: each now unused
        graph.erase_node(node)
