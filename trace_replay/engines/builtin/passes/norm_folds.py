"""A compiler pass: an RMSNorm whose output only feeds one-row GEMVs, inside those GEMVs.

In a decoder layer each RMSNorm feeds projections: the input norm q/k/v, the MLP's norm
gate/up. At one row the static backend's view runs the norm as the opaque
``trace_replay::rms_norm`` (:mod:`~trace_replay.kernels.rms_norm`) and the projections as
the GEMV operators, so the norm is a launch of its own: 64 per step at Llama-3.1-8B's
shape, ~2.2 µs each for 8 KiB of data. Every GEMV program reads the whole input row
anyway, so it can norm the row itself (:mod:`~trace_replay.kernels.gemv_input`).

:class:`FoldNorms`, an inductor post-grad pass run after
:class:`~trace_replay.engines.builtin.passes.linear_groups.GroupLinears`, rewrites ``gemv(rms_norm(x))``,
``gemv_group(rms_norm(x))`` and ``gated_gemv(rms_norm(x))`` (through views) into
``gemv_normed(x)`` and ``gated_gemv_normed(x)``, where every use of the norm's output is
one of them; a norm with any other use stays as it is. The normed row is never rounded to
the dtype: the result is the float32 one more closely than the model's, and agrees with
it to the dtype's rounding.
"""

from __future__ import annotations

from typing import cast

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from trace_replay.engines.builtin.passes.graph_nodes import VIEWS, arguments
from trace_replay.kernels import gated_gemv as _gated_gemv
from trace_replay.kernels import gemv as _gemv
from trace_replay.kernels import rms_norm as _rms_norm

__all__ = ["FoldNorms"]

_NORM = torch.ops.trace_replay.rms_norm.default
_ops = torch.ops.trace_replay


def _from_gemv(node: torch.fx.Node, x, norm: tuple) -> tuple:
    weight, bias = arguments(node, "x", "weight", "bias")[1:]
    return _ops.gemv_normed.default, (x, [weight], [] if bias is None else [bias], *norm)


def _from_group(node: torch.fx.Node, x, norm: tuple) -> tuple:
    weights, biases = arguments(node, "x", "weights", "biases")[1:]
    return _ops.gemv_normed.default, (x, weights, biases, *norm)


def _from_gated(node: torch.fx.Node, x, norm: tuple) -> tuple:
    rest = arguments(node, "x", "gate", "up", "gate_bias", "up_bias", "act")[1:]
    return _ops.gated_gemv_normed.default, (x, *rest, *norm)


# the GEMV operators a norm folds into, each with its rewrite: (normed operator, arguments)
_FOLDS = {
    _ops.gemv.default: _from_gemv,
    _ops.gemv_group.default: _from_group,
    _ops.gated_gemv.default: _from_gated,
}


class FoldNorms(CustomGraphPass):
    """Inductor post-grad pass folding ``trace_replay::rms_norm`` into the one-row GEMVs that
    are all its output's uses (module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target is _NORM:
                uses = _uses(node)
                if uses is not None:
                    _fold(graph, node, uses)

    def uuid(self) -> bytes:
        return get_hash_for_files(
            (__file__, _gemv.__file__, _gated_gemv.__file__, _rms_norm.__file__)
        )


def _uses(norm: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The GEMV nodes that read ``norm``'s output (as their input row, through views), when
    they are all its uses and each reads it in the norm input's shape; else None."""
    shape = cast(torch.fx.Node, norm.args[0]).meta["val"].shape
    found, frontier = [], [norm]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target in VIEWS:
                frontier.append(user)
            elif (
                user.target in _FOLDS
                and arguments(user, "x")[0] is node
                and node.meta["val"].shape == shape
                and not any(a is node for a in list(user.args[1:]) + list(user.kwargs.values()))
            ):
                found.append(user)
            else:
                return None
    return found or None


def _fold(graph: torch.fx.Graph, norm: torch.fx.Node, uses: list) -> None:
    x, weight, eps, offset = arguments(norm, "x", "weight", "eps", "offset")
    for use in uses:
        target, args = _FOLDS[use.target](use, x, (weight, eps, offset))
        with graph.inserting_before(use):
            fused = graph.call_function(target, args)
        fused.meta["val"] = use.meta["val"]  # the same output (not the old call's other meta:
        # inductor reads its recorded inputs, which the new arguments no longer match)
        use.replace_all_uses_with(fused)
        graph.erase_node(use)
    _erase_unused(graph, norm)


def _erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and the views hanging from it, now that nothing reads them."""
    for user in list(node.users):
        _erase_unused(graph, user)
    graph.erase_node(node)
