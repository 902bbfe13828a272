"""Row-invariant operations, and the library behaviour deterministic mode relies on.

The assumption tests check, on the machine running the suite, what the module docstring of
``trace_replay.engines.builtin.backends.deterministic_ops`` states; if one fails here, deterministic mode's
guarantee does not hold on this machine and the failure says which assumption broke.
"""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.builtin.backends.deterministic_ops import (
    LINEAR_MENU,
    RowBlocks,
    probe_linear,
    score_rows,
    silu_mul,
)
from trace_replay.engines.builtin.scoring import score_tokens


def _placed(row: torch.Tensor, rows: int, position: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, row.shape[-1], generator=torch.Generator().manual_seed(seed))
    x[position] = row
    return x


def test_assumption_gemm_row_ignores_neighbours_at_fixed_shape():
    """For a fixed [M, K] x [K, N], a row's bits do not depend on the other rows or its place."""
    weight, row = torch.randn(96, 64), torch.randn(64)
    for rows in (4, 16):
        outs = [
            torch.nn.functional.linear(_placed(row, rows, p, seed), weight)[p]
            for seed, p in enumerate((0, rows // 2, rows - 1))
        ]
        assert all(torch.equal(o, outs[0]) for o in outs), rows


def test_assumption_row_reductions_ignore_neighbours():
    """sum/mean/amax/log_softmax/softmax over the last dim: a row's bits are its own."""
    row = torch.randn(1000)
    for op in (
        lambda x: x.sum(-1),
        lambda x: x.pow(2).mean(-1),
        lambda x: x.amax(-1),
        lambda x: torch.log_softmax(x, -1),
        lambda x: torch.softmax(x, -1),
    ):
        outs = [op(_placed(row, 8, p, seed))[p] for seed, p in enumerate((0, 3, 7))]
        assert all(torch.equal(o, outs[0]) for o in outs)


def test_assumption_exp_same_bits_in_body_and_tail():
    """CPU exp gives an element the same bits in the vectorized body and the scalar tail."""
    x = torch.randn(4099)
    whole = torch.exp(x)
    pieces = torch.cat([torch.exp(x[i : i + 7]) for i in range(0, len(x), 7)])
    assert torch.equal(whole, pieces)


def test_silu_mul_same_bits_anywhere():
    """silu_mul gives an element the same bits wherever it sits (F.silu does not on CPU)."""
    gate, up = torch.randn(4099), torch.randn(4099)
    whole = silu_mul(gate, up)
    pieces = torch.cat([silu_mul(gate[i : i + 7], up[i : i + 7]) for i in range(0, 4099, 7)])
    assert torch.equal(whole, pieces)
    torch.testing.assert_close(whole, torch.nn.functional.silu(gate) * up)


def test_probe_keeps_the_menu_that_agrees():
    """On this machine the probe returns sizes of the menu; each gives a row the same bits."""
    weight = torch.randn(160, 64)
    sizes = probe_linear([weight], LINEAR_MENU)
    assert sizes and set(sizes) <= set(LINEAR_MENU)
    row = torch.randn(64)
    outs = [torch.nn.functional.linear(_placed(row, s, s - 1, s), weight)[s - 1] for s in sizes]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_score_rows_matches_score_tokens():
    """Same logprob, rank, top-k and entropy as the default scoring, up to rounding."""
    logits = torch.randn(13, 500) * 3
    ids = torch.randint(0, 500, (13,))
    ours, theirs = score_rows(logits, ids, 5, 8), score_tokens(logits, ids, 5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_score_rows_row_invariant():
    """A row's scores are the same bits alone, first, or last among others."""
    row, token = torch.randn(500) * 3, torch.tensor([7])
    outs = []
    for rows, p in ((1, 0), (9, 0), (17, 16)):
        x = _placed(row, rows, p, rows)
        ids = torch.randint(0, 500, (rows,))
        ids[p] = token
        outs.append([field[p] for field in score_rows(x, ids, 5, 8)])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_row_blocks_per_device():
    """CPU blocks are small (batch 1 stays cheap); reductions always see at least 2 rows."""
    cpu = RowBlocks.for_device(torch.device("cpu"))
    assert cpu.linear == LINEAR_MENU and min(cpu.rowwise, cpu.score) >= 2
    assert RowBlocks.for_device(torch.device("cuda")).score >= 2


@pytest.mark.parametrize("bad", [[torch.randn(8, 8)]])
def test_probe_runs_on_any_weight(bad):
    """The probe needs only the weights' shapes and dtype."""
    assert probe_linear(bad, (8, 16))
