"""A compiler pass: the 3xTF32 linear layers that read the same input, in one launch.

A decoder layer's q, k and v projections read the same normed hidden states, and so do
its gate and up projections. In a compiled float32 layer each is one
``trace_replay::fp32_linear_partials`` call
(:func:`~trace_replay.kernels.fp32_linear.fp32_linear`), and at the few rows of a decode
step each is latency-bound: a float32 SmolLM2 step on an H200 spent ~5 µs per call on 211
calls, whatever the layer's size. :class:`GroupLinears`, an inductor post-grad pass, puts
the calls that share an input (and a split, and bias or no bias) into one
``trace_replay::fp32_linear_group_partials`` call, whose kernel finds each tile's weight
(:func:`~trace_replay.kernels.fp32_linear.launch_group_partials`); each former call's output
becomes a column slice of the group's. The weights are not copied or concatenated: the
model keeps its own parameters, and the model's code is not touched — the pass rewrites
the graph the compiler traced from it.

What the group computes is what the members computed, up to float32 rounding: each output
is the same dot product over the same ranges of K, added in the same order downstream,
but the tile shapes may differ (the group's :func:`~trace_replay.kernels.fp32_linear.blocks`
are those of the wider output).
"""

from __future__ import annotations

import collections

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from trace_replay.kernels import fp32_linear as _fp32_linear

__all__ = ["GroupLinears"]

_MEMBER = torch.ops.trace_replay.fp32_linear_partials.default
_GROUP = torch.ops.trace_replay.fp32_linear_group_partials.default
_MOST = 3  # members a launch takes
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.reshape.default)


class GroupLinears(CustomGraphPass):
    """Inductor post-grad pass (``torch.compile(options={"post_grad_custom_pre_pass": ...})``)
    grouping ``fp32_linear_partials`` calls that read the same input, up to three per launch,
    in the graph's order. Calls are grouped only where they agree on the split (so every
    consumer still reads ``[split, M, N_i]``) and on having a bias, where every weight and
    bias is defined before the first member, and where a ``BLOCK_N`` puts each member on
    tiles of its own (:func:`~trace_replay.kernels.fp32_linear.group_blocks`)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {node: index for index, node in enumerate(graph.nodes)}
        candidates = collections.defaultdict(list)
        for node in graph.nodes:
            if node.target is _MEMBER:
                x, weight, bias = _arguments(node)
                split = node.meta["val"].shape[0]
                candidates[(*_source(x), bias is None, split)].append(node)
        for (_, _, _, no_bias, split), members in candidates.items():
            x = _arguments(members[0])[0]
            for start in range(0, len(members) - 1, _MOST):
                chunk = members[start:start + _MOST]
                if len(chunk) > 1:
                    _group(graph, order, x, chunk, split, no_bias)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, _fp32_linear.__file__))


def _source(x: torch.fx.Node) -> tuple:
    """``(node, shape, strides)`` of the data ``x`` views: each call reshapes the layer's
    ``[rows, tokens, hidden]`` input to ``[rows × tokens, hidden]`` itself, and the graph
    may keep one view node per call."""
    val = x.meta["val"]
    while x.target in _VIEWS and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x, tuple(val.shape), tuple(val.stride())


def _arguments(node: torch.fx.Node) -> tuple:
    args = list(node.args) + [None] * (3 - len(node.args))
    names = ("x", "weight", "bias")
    return tuple(node.kwargs.get(name, arg) for name, arg in zip(names, args))


def _group(graph: torch.fx.Graph, order: dict, x: torch.fx.Node, members: list,
           split: int, no_bias: bool) -> None:
    weights = [_arguments(node)[1] for node in members]
    biases = [] if no_bias else [_arguments(node)[2] for node in members]
    first = members[0]
    if any(order.get(arg, len(order)) > order[first] for arg in weights + biases):
        return  # an input computed after the first member: leave them as they are
    x_val = x.meta["val"]
    cols = [node.meta["val"].shape[2] for node in members]
    if _fp32_linear.group_blocks(x_val.shape[0], cols, x_val.shape[1], split) is None:
        return
    with graph.inserting_before(first):
        group = graph.call_function(_GROUP, (x, weights, biases, split))
    fake_mode = x_val.fake_mode
    with fake_mode:
        group.meta["val"] = _GROUP(x_val, [w.meta["val"] for w in weights],
                                   [b.meta["val"] for b in biases], split)
    start = 0
    for node, width in zip(members, cols):
        with graph.inserting_before(node):
            part = graph.call_function(torch.ops.aten.slice.Tensor,
                                       (group, 2, start, start + width))
        with fake_mode:
            part.meta["val"] = group.meta["val"][:, :, start:start + width]
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        start += width
