"""What every ``torch.compile`` of the package needs: a recompile limit of its own, inductor's passes."""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["RECOMPILES", "compile_function", "layer_passes"]

# graphs one compiled function may hold: one per (shape, dtype) it meets
RECOMPILES = 64


def compile_function(fn, **options):
    """``torch.compile(fn, **options)`` that may hold :data:`RECOMPILES` graphs of ``fn``, or
    the user's ``torch._dynamo.config.recompile_limit`` where that is higher.

    The package compiles per static shape (``dynamic=False``) with ``fullgraph=True``, where
    dynamo's default limit of 8 is a hard error, not a fallback: a process that replays
    several models, dtypes or batch sizes (a test session, a sweep) meets more than 8
    shapes of the decoder layer or of the scorer. The limit is the compiled function's own
    (``torch.compile(recompile_limit=...)``; on a torch without it, set around each call):
    dynamo's configuration is never left changed.
    """
    limit = max(torch._dynamo.config.cache_size_limit, RECOMPILES)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=limit, **options)
    compiled = torch.compile(fn, **options)
    config = torch._dynamo.config
    # the setting's own name (torch >= 2.7; cache_size_limit is its alias there)
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    @functools.wraps(fn)
    def limited(*args, **kwargs):
        before = getattr(config, name)  # by hand: cheaper than config.patch, once per call
        setattr(config, name, limit)
        try:
            return compiled(*args, **kwargs)
        finally:
            setattr(config, name, before)

    return limited


def layer_passes(fusions: bool = True) -> dict:
    """Inductor options that add the package's graph passes to a decoder layer's compile:
    before inductor's own post-grad passes the linears that read one input go into one launch
    (:class:`~trace_replay.engines.builtin.passes.linear_groups.GroupLinears`), then, with
    ``fusions``, the batch-1 fusions' passes
    (:func:`~trace_replay.engines.builtin.passes.batch1_fusions.passes`). A graph without
    the package's operators is left as it was.
    """
    from trace_replay.engines.builtin.passes import batch1_fusions
    from trace_replay.engines.builtin.passes.linear_groups import GroupLinears  # imports inductor

    pre, post = batch1_fusions.passes(fusions)
    options = {"post_grad_custom_pre_pass": _in_order(GroupLinears(), *pre)}
    if post is not None:
        options["post_grad_custom_post_pass"] = post
    return options


def _in_order(*passes):
    """One inductor custom pass that runs ``passes`` in order."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Passes(CustomGraphPass):
        def __call__(self, graph) -> None:
            for graph_pass in passes:
                graph_pass(graph)

        def uuid(self) -> bytes:
            return b"".join(graph_pass.uuid() for graph_pass in passes)

    return Passes()
