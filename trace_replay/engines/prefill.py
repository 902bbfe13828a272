"""Teacher-forced scoring: one forward over prompt + trace, what a trainer computes.

The baseline to set decode replay against: same weights, but prefill kernels over the
whole sequence instead of one decode step at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trace_replay.engines.base import ReplayRequest, TraceResult, collect_rows, score_tokens
from trace_replay.models import load_model, resolve_dtype

__all__ = ["PrefillEngine"]


class PrefillEngine:
    """Score traces with a single teacher-forced forward per batch (right padded)."""

    name = "prefill"

    def __init__(self, model=None, *, dtype=None, device=None, batch_size=None, top_k=5):
        if isinstance(model, torch.nn.Module):
            self.lm = model.eval()
        else:
            self.lm = load_model(model, dtype=resolve_dtype(dtype), device=device)
        self.device = next(self.lm.parameters()).device
        self.dtype = next(self.lm.parameters()).dtype
        self.batch_size = batch_size or (64 if self.device.type == "cuda" else 8)
        self.top_k = top_k
        self.max_model_len = getattr(self.lm.config, "max_position_embeddings", None)

    def info(self) -> dict:
        return {"engine_path": "teacher-forced-prefill",
                "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "batch_size": self.batch_size}

    @torch.inference_mode()
    def run(self, requests: Sequence[ReplayRequest]) -> list[TraceResult]:
        """Score ``requests``; results come back in the order given."""
        results = []
        for start in range(0, len(requests), self.batch_size):
            results.extend(self._run_batch(requests[start:start + self.batch_size]))
        return results

    def _run_batch(self, batch: Sequence[ReplayRequest]) -> list[TraceResult]:
        # the last trace token is scored but never fed
        width = max(r.prompt_len + r.trace_len - 1 for r in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        rows, cols, targets = [], [], []
        for row, r in enumerate(batch):
            seq = list(r.prompt_token_ids) + list(r.trace_token_ids[:-1])
            input_ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            # logits at position p predict the token at p + 1
            rows += [row] * r.trace_len
            cols += range(r.prompt_len - 1, r.prompt_len - 1 + r.trace_len)
            targets += r.trace_token_ids
        # the lm_head only runs where a trace token is scored (prompts can be long)
        first = min(cols)
        keep = torch.arange(first, max(cols) + 1, device=self.device)
        logits = self.lm(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                         logits_to_keep=keep).logits
        rows_t = torch.tensor(rows, device=self.device)
        cols_t = torch.tensor(cols, device=self.device) - first
        targets_t = torch.tensor(targets, device=self.device)
        host = collect_rows(score_tokens(logits[rows_t, cols_t], targets_t, self.top_k), targets_t)
        results, start = [], 0
        for r in batch:
            take = slice(start, start + r.trace_len)
            start += r.trace_len
            results.append(TraceResult(trace_id=r.trace_id, prompt_len=r.prompt_len,
                                       **{name: values[take] for name, values in host.items()}))
        return results
