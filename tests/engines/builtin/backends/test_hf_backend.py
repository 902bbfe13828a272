"""Tests for trace_replay.engines.builtin.backends.hf on the embedded model: padded batches and dropped
tokens give the logits of an unpadded teacher-forced forward."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.builtin.backends.hf import HFBackend

pytestmark = pytest.mark.slow

PAD = 2
ATOL = 1e-4  # float32 with and without padding, measured ~1e-5


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [
        tokenizer.encode(text)
        for text in ("The capital of France is", "def add(a, b):", "Once upon a")
    ]


def forward(lm, ids: list[int]) -> torch.Tensor:
    """Logits of one unpadded sequence, [len(ids), V]: the reference every check uses."""
    with torch.inference_mode():
        return lm(input_ids=torch.tensor([ids])).logits[0]


def test_prefill_of_left_padded_prompts_equals_each_prompt_alone(lm, prompts):
    """Row b's next-token logits after a padded prefill are prompt b's own, and one forward ran."""
    backend = HFBackend(lm, PAD)
    with torch.inference_mode():
        logits = backend.prefill(prompts, max_new_tokens=4)
    assert logits.shape[0] == len(prompts) and backend.forwards == 1
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], forward(lm, prompt)[-1], atol=ATOL, rtol=0)


def test_decode_continues_each_row_at_its_positions(lm, prompts):
    """Decoding q tokens per row at positions len(prompt) + i gives the logits of the prompt
    followed by those tokens, position by position."""
    backend = HFBackend(lm, PAD)
    fed = torch.tensor([[11, 12], [21, 22], [31, 32]])
    lens = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        backend.prefill(prompts, max_new_tokens=4)
        logits = backend.decode(fed, lens[:, None] + torch.arange(2))
    assert backend.forwards == 2
    for row, prompt in enumerate(prompts):
        expected = forward(lm, prompt + fed[row].tolist())[-2:]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)


def test_dropped_tokens_are_never_attended_again(lm, prompts):
    """After keep() drops a row's rejected drafts, the next token sees only what was kept: its
    logits are those of prompt + kept tokens + it, with no trace of the dropped ones."""
    backend = HFBackend(lm, PAD)
    drafts = torch.tensor([[11, 12, 13]] * len(prompts))
    keep = torch.tensor([[True, False, False], [True, True, True], [False, False, False]])
    lens = torch.tensor([len(p) for p in prompts])
    nxt = torch.tensor([[40], [41], [42]])
    with torch.inference_mode():
        backend.prefill(prompts, max_new_tokens=8)
        backend.decode(drafts, lens[:, None] + torch.arange(3))
        backend.keep(keep)
        logits = backend.decode(nxt, (lens + keep.sum(1))[:, None])
    for row, prompt in enumerate(prompts):
        kept = drafts[row][keep[row]].tolist()
        expected = forward(lm, prompt + kept + nxt[row].tolist())[-1]
        torch.testing.assert_close(logits[row, -1], expected, atol=ATOL, rtol=0)
