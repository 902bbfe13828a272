"""A compiler pass: the linear layers that read the same input, in one launch.

A decoder layer's q, k and v projections read the same normed hidden states, and so do
its gate and up projections. In a compiled layer the package's linear kernels are opaque
operators, one call per projection:

* float32 (3xTF32): ``trace_replay::fp32_linear_partials``
  (:func:`~trace_replay.kernels.fp32_linear.fp32_linear`). At the few rows of a decode
  step each call is latency-bound: a float32 SmolLM2 step on an H200 spent ~5 µs per call
  on 211 calls, whatever the layer's size.
* bfloat16/float16 at one row: ``trace_replay::gemv`` (:func:`~trace_replay.kernels.gemv.gemv`).
  Memory-bound, but a small call loses its ramp-up and tail: at Llama-3.1-8B's shape q/k/v
  as three cuBLAS calls took 29 µs, as one grouped launch 15.

:class:`GroupLinears`, an inductor post-grad pass, puts the calls of one operator that
share an input (and, for the 3xTF32 operator, a split; and bias or no bias) into one call
of its group operator (``fp32_linear_group_partials``, ``gemv_group``), whose kernel finds
each tile's weight; each former call's output becomes a column slice of the group's. The
weights are not copied or concatenated: the model keeps its own parameters, and the
model's code is not touched — the pass rewrites the graph the compiler traced from it.

What the group computes is what the members computed, up to rounding: each output is the
same dot product over the same K, but the tile shapes may differ (the group's blocks are
those of the wider output).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from trace_replay.engines.builtin.passes.graph_nodes import VIEWS, arguments
from trace_replay.kernels import fp32_linear as _fp32_linear
from trace_replay.kernels import gemv as _gemv

__all__ = ["GroupLinears"]

_MOST = 3  # members a launch takes


class _Kind(NamedTuple):
    """An operator the pass groups, and its group operator."""

    group: Callable[..., Any]  # a torch.ops OpOverload
    # 3xTF32: the output is the [split, M, N] partials, so members must agree on the split
    # and their columns lie along dimension 2; the GEMV's output is [M, N]
    split: bool

    @property
    def dim(self) -> int:
        """The output dimension the members' columns are side by side in."""
        return 2 if self.split else 1

    def key(self, node: torch.fx.Node) -> tuple:
        """What members must share besides the input and bias presence."""
        return (node.meta["val"].shape[0],) if self.split else ()

    def fits(self, x: torch.fx.Node, cols: list[int], key: tuple) -> bool:
        if not self.split:  # the GEMV's launcher narrows its tiles to any members
            return True
        rows, depth = x.meta["val"].shape
        return _fp32_linear.group_blocks(rows, cols, depth, *key) is not None

    def call(self, x, weights, biases, key: tuple) -> tuple:
        return (x, weights, biases, *key)


_KINDS = {
    torch.ops.trace_replay.fp32_linear_partials.default: _Kind(
        torch.ops.trace_replay.fp32_linear_group_partials.default, split=True
    ),
    torch.ops.trace_replay.gemv.default: _Kind(
        torch.ops.trace_replay.gemv_group.default, split=False
    ),
}


class GroupLinears(CustomGraphPass):
    """Inductor post-grad pass (``torch.compile(options={"post_grad_custom_pre_pass": ...})``)
    grouping calls of one linear operator (``fp32_linear_partials``, ``gemv``) that read the
    same input, up to three per launch, in the graph's order. Calls are grouped only where
    they agree on having a bias (and, 3xTF32, on the split, so every consumer still reads
    ``[split, M, N_i]``), where every weight and bias is defined before the first member,
    and (3xTF32) where a ``BLOCK_N`` puts each member on tiles of its own
    (:func:`~trace_replay.kernels.fp32_linear.group_blocks`)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {node: index for index, node in enumerate(graph.nodes)}
        candidates = collections.defaultdict(list)
        for node in graph.nodes:
            if node.target in _KINDS:
                x, weight, bias = arguments(node, "x", "weight", "bias")
                kind = _KINDS[node.target]
                candidates[(node.target, *_source(x), bias is None, kind.key(node))].append(node)
        for (target, _, _, _, no_bias, key), members in candidates.items():
            x = arguments(members[0], "x")[0]
            for start in range(0, len(members) - 1, _MOST):
                chunk = members[start : start + _MOST]
                if len(chunk) > 1:
                    _group(graph, order, _KINDS[target], x, chunk, key, no_bias)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, _fp32_linear.__file__, _gemv.__file__))


def _source(x: torch.fx.Node) -> tuple:
    """``(node, shape, strides)`` of the data ``x`` views: each call reshapes the layer's
    ``[rows, tokens, hidden]`` input to ``[rows × tokens, hidden]`` itself, and the graph
    may keep one view node per call."""
    val = x.meta["val"]
    while x.target in VIEWS and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x, tuple(val.shape), tuple(val.stride())


def _group(
    graph: torch.fx.Graph,
    order: dict,
    kind: _Kind,
    x: torch.fx.Node,
    members: list,
    key: tuple,
    no_bias: bool,
) -> None:
    _, weight_args, bias_args = zip(*(arguments(node, "x", "weight", "bias") for node in members))
    weights, biases = list(weight_args), [] if no_bias else list(bias_args)
    first = members[0]
    if any(order.get(arg, len(order)) > order[first] for arg in weights + biases):
        return  # an input computed after the first member: leave them as they are
    cols = [node.meta["val"].shape[kind.dim] for node in members]
    if not kind.fits(x, cols, key):
        return
    with graph.inserting_before(first):
        group = graph.call_function(kind.group, kind.call(x, weights, biases, key))
    fake_mode = x.meta["val"].fake_mode
    with fake_mode:
        group.meta["val"] = kind.group(
            *kind.call(
                x.meta["val"],
                [w.meta["val"] for w in weights],
                [b.meta["val"] for b in biases],
                key,
            )
        )
    start = 0
    for node, width in zip(members, cols):
        with graph.inserting_before(node):
            part = graph.call_function(
                torch.ops.aten.slice.Tensor, (group, kind.dim, start, start + width)
            )
        with fake_mode:
            part.meta["val"] = group.meta["val"].narrow(kind.dim, start, width)
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        start += width
