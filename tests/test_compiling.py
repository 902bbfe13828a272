"""Tests for trace_replay.engines.compiling: the package's compiled functions may hold more
graphs than dynamo's default, and a higher limit set by the user stays."""

import torch

from trace_replay.engines.compiling import RECOMPILES, allow_recompiles


def test_limit_is_raised_never_lowered():
    with torch._dynamo.config.patch(recompile_limit=8):
        allow_recompiles()
        assert torch._dynamo.config.recompile_limit == RECOMPILES
    with torch._dynamo.config.patch(recompile_limit=1000):
        allow_recompiles()
        assert torch._dynamo.config.recompile_limit == 1000


def test_a_fullgraph_function_compiles_past_eight_shapes():
    """Ten shapes of one ``fullgraph=True``, ``dynamic=False`` function: with dynamo's
    default this is a hard error at the ninth."""
    with torch._dynamo.config.patch(recompile_limit=8):
        allow_recompiles()
        compiled = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True,
                                 dynamic=False)
        for n in range(1, 11):
            assert compiled(torch.ones(n)).sum().item() == 2 * n
