"""Tests for trace_replay.engines.builtin.passes.graph_nodes: a call's arguments read alike whether the graph
passes them by position or by keyword, and a left-out one reads as None."""

import torch

from trace_replay.engines.builtin.passes.graph_nodes import VIEWS, arguments


def test_positional_keyword_and_missing_arguments_read_alike():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    by_position = graph.call_function(torch.nn.functional.linear, (x, w))
    by_keyword = graph.call_function(torch.nn.functional.linear, (x,), {"weight": w})
    for node in (by_position, by_keyword):
        assert arguments(node, "x", "weight", "bias") == (x, w, None)
    assert torch.ops.aten.reshape.default in VIEWS
