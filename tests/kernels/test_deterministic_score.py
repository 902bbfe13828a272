"""Deterministic mode's Triton scorer (trace_replay.kernels.deterministic_score): the scoring
rule's numbers, and a row's bits whatever the rows beside it."""

import pytest
import torch

import trace_replay.kernels._triton
from trace_replay.engines.builtin.scoring import score_tokens
from trace_replay.kernels.deterministic_score import (
    score_rows_reference,
    score_rows_triton,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not trace_replay.kernels._triton.can_launch(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before the first import",
)


def grid_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits on a grid of 1/8 (exact in float32): ties are exact and no two different
    logits lie within rounding of each other, so ranks compare exactly across methods."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(-64, 64, (rows, vocab), generator=generator) / 8).to(DEVICE)


@pytest.mark.parametrize("vocab", [1000, 2048, 5003])
def test_scores_follow_the_rule(vocab):
    """logprob, rank (ties share the best), entropy and the top-5 equal the reference's
    formulas and score_tokens' numbers within float32 rounding; ranks and top ids exactly
    (vocabularies below, at and across one 2,048-logit block)."""
    logits = grid_logits(9, vocab)
    tokens = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tokens[0] = int(logits[0].argmax())  # a token of rank 1
    got = score_rows_triton(logits, tokens, 5)
    want = score_rows_reference(logits, tokens, 5)
    shared = score_tokens(logits, tokens, 5)
    for name, a, b, c in zip(
        ("logprob", "rank", "top ids", "top logprobs", "entropy"), got, want, shared
    ):
        if name in ("rank", "top ids"):
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(a, c, atol=2e-5, rtol=1e-5, msg=name)
    assert torch.equal(got[1], shared.rank)
    assert got[1][0] == 1


def test_a_row_keeps_its_bits_among_any_rows():
    """A row's five outputs are the same bits alone, among 4 or 70 rows, at any place."""
    row = grid_logits(1, 3000, seed=3)[0] + torch.randn(3000, device=DEVICE) * 1e-3
    token = torch.tensor([17], device=DEVICE)
    outs = []
    for rows, place in ((1, 0), (4, 3), (70, 41)):
        logits = grid_logits(rows, 3000, seed=rows)
        logits[place] = row
        tokens = torch.randint(0, 3000, (rows,), device=DEVICE)
        tokens[place] = token
        outs.append([t[place] for t in score_rows_triton(logits, tokens, 4)])
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))


def test_masked_vocabulary_and_no_top_k():
    """-inf logits count as probability 0 (finite entropy, never above the token); top_k 0
    gives empty top columns."""
    logits = grid_logits(3, 300)
    logits[:, 100:] = float("-inf")
    tokens = torch.tensor([5, 50, 99], device=DEVICE)
    logprob, rank, top_ids, top_lps, entropy = score_rows_triton(logits, tokens, 0)
    want = score_rows_reference(logits[:, :100], tokens, 0)
    torch.testing.assert_close(logprob, want[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(rank, want[1]) and torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, want[4], atol=2e-5, rtol=1e-5)
    assert top_ids.shape == (3, 0) and top_lps.shape == (3, 0)


def test_what_it_takes():
    """top_k up to 32 (the top-k kernel's limit), whatever the layout: a transposed view
    scores as its contiguous copy does; a larger top_k is refused by name."""
    logits = grid_logits(64, 64)
    assert supports(logits, 32) and not supports(logits, 33) and supports(logits.t(), 5)
    tokens = torch.arange(64, device=DEVICE)
    for a, b in zip(
        score_rows_triton(logits.t(), tokens, 3),
        score_rows_triton(logits.t().contiguous(), tokens, 3),
    ):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="top_k <= 32"):
        score_rows_triton(logits, tokens, 40)
