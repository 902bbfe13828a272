"""Teacher-forced scoring: one forward over prompt + trace, what a trainer computes.

The baseline to set decode replay against: same weights, but prefill kernels over the
whole sequence instead of one decode step at a time. With ``deterministic`` the forward is
:class:`~trace_replay.engines.invariant_backend.InvariantBackend`'s, row by row: a trace's
numbers do not depend on the batch, and they are the bits its decode replay gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trace_replay.engines.base import EngineBase, EngineConfig, ReplayRequest, TraceResult
from trace_replay.engines.results import split_results
from trace_replay.engines.scoring import collect_rows, score_tokens
from trace_replay.models import model_for_engine

__all__ = ["PrefillEngine"]


class PrefillEngine(EngineBase):
    """Score traces with a single teacher-forced forward per batch (right padded).

    ``config`` as for every engine (``batch_size``: traces per forward, default 8 on CPU,
    64 on CUDA; ``deterministic``: batch-invariant arithmetic, Llama-family models).
    """

    name = "prefill"
    engine_path = "teacher-forced-prefill"

    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.lm, self.model_label, self.tokenizer_source = model_for_engine(
            config.model, dtype=config.dtype, device=config.device)
        weight = next(self.lm.parameters())
        self.torch_device = weight.device
        self.device = str(weight.device)
        self.dtype = str(weight.dtype).replace("torch.", "")
        self.batch_size = config.batch_size or (64 if weight.device.type == "cuda" else 8)
        self.top_k = config.top_k
        self.max_model_len = getattr(self.lm.config, "max_position_embeddings", None)
        self.deterministic = config.deterministic
        self.backend = None
        if self.deterministic:
            from trace_replay.engines.invariant_backend import InvariantBackend

            self.backend = InvariantBackend(self.lm, cuda_graphs=False)
            self.engine_path += "[invariant]"
        self._forwards = 0

    def settings(self) -> dict:
        settings = super().settings()
        if self.deterministic:
            settings["arithmetic"] = self.backend.describe()
        return settings

    def stats(self) -> dict:
        return {"forwards": self._forwards}

    def close(self) -> None:
        self.lm = self.backend = None

    @torch.inference_mode()
    def run(self, requests: Sequence[ReplayRequest]) -> list[TraceResult]:
        """Score ``requests``; results come back in the order given."""
        results = []
        for start in range(0, len(requests), self.batch_size):
            results.extend(self._run_batch(requests[start:start + self.batch_size]))
        return results

    def _run_batch(self, batch: Sequence[ReplayRequest]) -> list[TraceResult]:
        if self.on_batch is not None:
            self.on_batch(batch)
        if self.deterministic:
            return self._run_invariant(batch)
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
        device = self.torch_device
        keep = torch.arange(first, max(cols) + 1, device=device)
        logits = self.lm(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                         logits_to_keep=keep).logits
        rows_t = torch.tensor(rows, device=device)
        cols_t = torch.tensor(cols, device=device) - first
        targets_t = torch.tensor(targets, device=device)
        self._forwards += 1
        host = collect_rows(score_tokens(logits[rows_t, cols_t], targets_t, self.top_k), targets_t)
        bounds = np.cumsum([0] + [r.trace_len for r in batch])
        return split_results(batch, host, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])])

    def _run_invariant(self, batch: Sequence[ReplayRequest]) -> list[TraceResult]:
        """Teacher forcing through the batch-invariant backend, scored row-invariantly."""
        sequences = [r.prompt_token_ids + r.trace_token_ids[:-1] for r in batch]
        # logits at position p predict the token at p + 1
        scored = [range(r.prompt_len - 1, r.prompt_len - 1 + r.trace_len) for r in batch]
        logits = self.backend.teacher_forced(sequences, scored)
        targets = torch.tensor([t for r in batch for t in r.trace_token_ids],
                               device=self.torch_device)
        self._forwards += 1
        host = collect_rows(self.backend.score(logits, targets, self.top_k), targets)
        bounds = np.cumsum([0] + [r.trace_len for r in batch])
        return split_results(batch, host, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])])
