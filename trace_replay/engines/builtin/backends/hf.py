"""The forward pass of the built-in engine: a transformers model with a growing KV cache.

A :class:`~trace_replay.engines.builtin.backends.base.Backend`. Rows of a wave advance by
different amounts in the verify path; a dropped token stays in the cache but is masked out
of attention for every later step. Its forwards call the model's own modules, so it is the
backend whose activations can be watched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trace_replay.engines.base import Activations
from trace_replay.engines.builtin.scoring import scorer_for

__all__ = ["HFBackend"]


class HFBackend:
    """Any transformers causal LM: ``DynamicCache`` and a 2-D key mask per row."""

    name = "hf"
    static_logits = False  # each decode returns a new logits tensor

    def __init__(self, lm, pad_id: int) -> None:
        self.lm = lm
        self.pad_id = pad_id
        self.device = next(lm.parameters()).device
        self.score = scorer_for(self.device)
        self.forwards = 0
        self._cache: Any = None  # transformers' past_key_values
        self._mask: torch.Tensor | None = None  # [B, width] of the last forward

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
        """Start a wave: left-pad ``prompts``, run them, return ``[B, V]`` next-token logits."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.lm(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True
        )
        self.forwards += 1
        self._cache, self._mask = out.past_key_values, mask
        return out.logits[:, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B, q]`` at ``positions`` ``[B, q]``; return ``[B, q, V]`` logits."""
        mask = self._prefilled()
        self._mask = torch.cat([mask, mask.new_ones(tokens.shape)], dim=1)
        out = self.lm(
            input_ids=tokens,
            attention_mask=self._mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        self.forwards += 1
        self._cache = out.past_key_values
        return out.logits

    def keep(self, keep: torch.Tensor) -> None:
        """``keep`` ``[B, q]`` bool: which tokens of the last ``decode`` stay in context."""
        mask = self._prefilled()
        mask[:, -keep.shape[1] :] = keep.to(mask.dtype)

    def _prefilled(self) -> torch.Tensor:
        """The attention mask so far; a RuntimeError before the first prefill."""
        if self._mask is None:
            raise RuntimeError("the hf backend decodes only after a prefill")
        return self._mask

    def settings(self) -> dict:
        """Nothing to add: the model's own forward, no choice of the backend's."""
        return {}

    def activations(self) -> Activations:
        """The model's own modules: every forward calls them."""
        return Activations(self.lm)
