"""What the package's compiler passes share: reading a call's arguments, and which nodes are
views.

The passes (:mod:`~trace_replay.engines.builtin.passes.linear_groups`, :mod:`~trace_replay.engines.builtin.passes.norm_folds`,
:mod:`~trace_replay.engines.builtin.passes.residual_adds`) rewrite inductor's post-grad graph, where an
operator's argument may be positional or a keyword, and where a layer's code leaves
reshapes between a value and its users.
"""

from __future__ import annotations

import torch

__all__ = ["VIEWS", "arguments"]

# the reshapes a pass looks through
VIEWS = (
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
)


def arguments(node: torch.fx.Node, *names: str) -> tuple:
    """The call's arguments ``names`` (its schema's first ones, in order), positional or
    keyword; None for one it leaves out."""
    return tuple(
        node.args[i] if i < len(node.args) else node.kwargs.get(name)
        for i, name in enumerate(names)
    )
