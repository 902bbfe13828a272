"""The verify loop of the built-in engine: ``k`` drafts per row per forward.

Each forward feeds a row's last committed token and ``k`` drafts (the trace itself, or
prompt-lookup n-grams); ``apply_trace_to_verified`` commits the trace tokens whose drafts
match, plus one. Rows then advance by different amounts, so rejected drafts stay in the
backend's KV cache but are masked out of attention for every later step (``backend.keep``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.decode import Scorer, Steps, forced_step
from trace_replay.engines.builtin.drafts import ngram_drafts
from trace_replay.engines.scoring import score_tokens
from trace_replay.engines.builtin.slots import SlotTable

__all__ = ["VerifyResult", "verify_steps"]


@dataclass
class VerifyResult:
    steps: Steps
    counts: torch.Tensor  # [forwards, B] int32, tokens each row committed per forward
    drafted: int  # drafts that could have been accepted (inside the trace)
    accepted: int


def verify_steps(backend, slots: SlotTable, idx_mapping: torch.Tensor, logits: torch.Tensor,
                 wave: Sequence[ReplayRequest], *, method: str, k: int, top_k: int,
                 score: Scorer = score_tokens,
                 on_forward: Callable[[int], None] | None = None) -> VerifyResult:
    """Replay ``wave`` verifying ``k`` drafts per forward; the first step is a plain one.

    ``on_forward(i)`` is called after forward ``i`` (0: the plain step); host only.
    """
    on_forward = on_forward or (lambda forward: None)
    device = logits.device
    batch = len(wave)
    trace_len = torch.tensor([r.trace_len for r in wave], device=device)
    sampled, scores = forced_step(logits, slots, idx_mapping, top_k, score)
    steps: Steps = [(scores, sampled)]
    on_forward(0)
    counts = [torch.ones(batch, dtype=torch.int32, device=device)]
    context = _context(wave, sampled)
    last = sampled
    cu_num_logits = torch.arange(batch + 1, device=device, dtype=torch.int32) * (k + 1)
    offsets = torch.arange(k + 1, device=device)
    # trace drafts are always accepted: every forward commits k + 1 tokens per row
    left = max(r.trace_len for r in wave) - 1
    remaining = -(-left // (k + 1)) if method == "trace" else left
    drafted = accepted = torch.zeros((), dtype=torch.long, device=device)
    while remaining > 0:
        total_len = slots.total_len(idx_mapping)
        done = slots.steps_done(idx_mapping)
        if method == "trace":
            drafts = slots.trace_state.peek(idx_mapping, k)
        else:
            drafts = ngram_drafts(context, total_len, k)
        fed = torch.cat([last[:, None], drafts], dim=1)  # [B, k+1]
        positions = total_len[:, None] - 1 + offsets
        logits = backend.decode(fed, positions)
        verified = logits.argmax(dim=-1)  # [B, k+1]
        num_sampled = torch.zeros(batch, dtype=torch.int32, device=device)
        # the draft checked by logits row j is fed.flatten()[j + 1]
        slots.trace_state.apply_trace_to_verified(
            verified, num_sampled, fed.flatten(), cu_num_logits, idx_mapping)
        slots.advance(idx_mapping, num_sampled)
        keep = offsets[None, :] < num_sampled[:, None]
        backend.keep(keep)  # rejected drafts never attended again
        steps.append((score(logits.flatten(0, 1), verified.flatten(), top_k),
                      verified.flatten()))
        counts.append(num_sampled)
        active = done < trace_len
        drafted = drafted + (torch.minimum(trace_len - done - 1, torch.full_like(done, k))
                             .clamp(min=0) * active).sum()
        accepted = accepted + ((num_sampled.long() - 1).clamp(min=0) * active).sum()
        last = verified.gather(1, (num_sampled.long() - 1).clamp(min=0)[:, None]).squeeze(1)
        context.scatter_(1, torch.where(keep, total_len[:, None] + offsets,
                                        context.shape[1] - 1), verified)
        remaining -= 1
        on_forward(len(steps) - 1)
        if method != "trace":
            # acceptance is data-dependent: one host read per forward (not per token)
            remaining = int((trace_len - slots.steps_done(idx_mapping)).max().item())
    return VerifyResult(steps, torch.stack(counts), int(drafted), int(accepted))


def _context(wave: Sequence[ReplayRequest], first_tokens: torch.Tensor) -> torch.Tensor:
    """Committed tokens per row (prompt + emitted), for n-gram lookup; last column is scratch."""
    width = max(r.prompt_len + r.trace_len for r in wave) + 1
    context = torch.full((len(wave), width), -1, dtype=torch.long)
    for row, request in enumerate(wave):
        context[row, : request.prompt_len] = torch.tensor(request.prompt_token_ids)
    context = context.to(first_tokens.device)
    plen = torch.tensor([r.prompt_len for r in wave], device=first_tokens.device)
    context.scatter_(1, plen[:, None], first_tokens[:, None])
    return context
