"""Verify steps for the replay loop: ``k`` drafts per row per forward.

Each forward after the first feeds a row's last committed token and ``k`` drafts (the trace
itself, or prompt-lookup n-grams); ``apply_trace_to_verified`` commits the trace tokens whose
drafts match, plus one. Rows then advance by different amounts, so rejected drafts stay in
the backend's KV cache but are masked out of attention for every later step
(``backend.keep``). The loop is :func:`~trace_replay.engines.builtin.decode.replay_forwards`;
these steps run eagerly (no CUDA graph: n-gram acceptance is read back once per forward, and
the draft context and ``keep`` are per-forward work a capture would have to key on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.backends.base import Backend
from trace_replay.engines.builtin.decode import (
    Scorer,
    SlotTable,
    Steps,
    forced_step,
    replay_forwards,
)
from trace_replay.engines.builtin.drafts import ngram_drafts
from trace_replay.engines.builtin.scoring import score_tokens

__all__ = ["VerifyResult", "VerifySteps", "verify_steps"]


@dataclass
class VerifyResult:
    steps: Steps
    counts: torch.Tensor  # [forwards, B] int32, tokens each row committed per forward
    drafted: int  # drafts that could have been accepted (inside the trace)
    accepted: int


def verify_steps(
    backend: Backend,
    slots: SlotTable,
    idx_mapping: torch.Tensor,
    logits: torch.Tensor,
    wave: Sequence[ReplayRequest],
    *,
    method: str,
    k: int,
    top_k: int,
    score: Scorer = score_tokens,
    on_forward: Callable[[int], None] | None = None,
) -> VerifyResult:
    """Replay ``wave`` verifying ``k`` drafts per forward; the first step is a plain one.

    ``logits``: the prefill's ``[B, V]``. ``on_forward(i)`` is called after forward ``i``
    (0: the plain step); host only.
    """
    runner = VerifySteps(
        backend, slots, idx_mapping, wave, method=method, k=k, top_k=top_k, score=score
    )
    replay_forwards(backend, runner, logits, on_forward)
    return runner.result()


class VerifySteps:
    """A :class:`~trace_replay.engines.builtin.decode.StepRunner` of ``k + 1`` tokens per row.

    Forward 0 is a plain forced step on the prefill's logits; each later forward's logits
    ``[B * (k + 1), V]`` verify the ``tokens`` fed (the last committed token, then ``k``
    drafts). Trace drafts are all accepted, so the forwards are counted on the host; n-gram
    ones are data-dependent: one host read per forward (not per token) says whether to go on.
    """

    def __init__(
        self,
        backend: Backend,
        slots: SlotTable,
        idx_mapping: torch.Tensor,
        wave: Sequence[ReplayRequest],
        *,
        method: str,
        k: int,
        top_k: int,
        score: Scorer,
    ) -> None:
        self.backend, self.slots, self.idx_mapping = backend, slots, idx_mapping
        self.wave, self.method, self.k, self.top_k, self.score = wave, method, k, top_k, score
        device = idx_mapping.device
        self.trace_len = torch.tensor([r.trace_len for r in wave], device=device)
        self.cu_num_logits = torch.arange(len(wave) + 1, device=device, dtype=torch.int32) * (k + 1)
        self.offsets = torch.arange(k + 1, device=device)
        left = max(r.trace_len for r in wave) - 1
        # trace drafts are always accepted: every forward commits k + 1 tokens per row
        self.remaining = -(-left // (k + 1)) if method == "trace" else left
        self.steps: Steps = []
        self.counts: list[torch.Tensor] = []
        self.drafted = self.accepted = torch.zeros((), dtype=torch.long, device=device)
        # set by the first step: committed tokens, for n-gram drafts (empty until then)
        self.context = torch.empty((0, 0), dtype=torch.long, device=device)
        # set by each feed: the next forward's tokens and positions, the rows' lengths
        unset = torch.empty(0, dtype=torch.long, device=device)
        self.tokens = self.positions = self._total_len = self._done = unset

    def step(self, logits: torch.Tensor, forward: int) -> bool:
        last = self._first(logits) if forward == 0 else self._verify(logits)
        if forward > 0:
            self.remaining -= 1
            if self.method != "trace":  # acceptance is data-dependent: read it back
                done = self.slots.steps_done(self.idx_mapping)
                self.remaining = int((self.trace_len - done).max().item())
        if self.remaining <= 0:
            return False
        self._feed(last)
        return True

    def result(self) -> VerifyResult:
        return VerifyResult(
            self.steps, torch.stack(self.counts), int(self.drafted), int(self.accepted)
        )

    def _first(self, logits: torch.Tensor) -> torch.Tensor:
        sampled, scores = forced_step(logits, self.slots, self.idx_mapping, self.top_k, self.score)
        self.steps.append((scores, sampled))
        self.counts.append(torch.ones(len(self.wave), dtype=torch.int32, device=sampled.device))
        self.context = _context(self.wave, sampled)
        return sampled

    def _feed(self, last: torch.Tensor) -> None:
        """The next forward's tokens ``[B, k + 1]``: ``last``, then the drafts."""
        self._total_len = self.slots.total_len(self.idx_mapping)
        self._done = self.slots.steps_done(self.idx_mapping)
        if self.method == "trace":
            drafts = self.slots.trace_state.peek(self.idx_mapping, self.k)
        else:
            drafts = ngram_drafts(self.context, self._total_len, self.k)
        self.tokens = torch.cat([last[:, None], drafts], dim=1)
        self.positions = self._total_len[:, None] - 1 + self.offsets

    def _verify(self, logits: torch.Tensor) -> torch.Tensor:
        """Commit what ``logits`` verify of the tokens fed; returns each row's last token."""
        batch, offsets, total_len = len(self.wave), self.offsets, self._total_len
        verified = logits.argmax(dim=-1).view(batch, self.k + 1)
        num_sampled = torch.zeros(batch, dtype=torch.int32, device=logits.device)
        # the draft checked by logits row j is tokens.flatten()[j + 1]
        self.slots.trace_state.apply_trace_to_verified(
            verified, num_sampled, self.tokens.flatten(), self.cu_num_logits, self.idx_mapping
        )
        self.slots.advance(self.idx_mapping, num_sampled)
        keep = offsets[None, :] < num_sampled[:, None]
        self.backend.keep(keep)  # rejected drafts never attended again
        self.steps.append((self.score(logits, verified.flatten(), self.top_k), verified.flatten()))
        self.counts.append(num_sampled)
        active = self._done < self.trace_len
        self.drafted = (
            self.drafted
            + (
                torch.minimum(
                    self.trace_len - self._done - 1, torch.full_like(self._done, self.k)
                ).clamp(min=0)
                * active
            ).sum()
        )
        self.accepted = self.accepted + ((num_sampled.long() - 1).clamp(min=0) * active).sum()
        self.context.scatter_(
            1, torch.where(keep, total_len[:, None] + offsets, self.context.shape[1] - 1), verified
        )
        return verified.gather(1, (num_sampled.long() - 1).clamp(min=0)[:, None]).squeeze(1)


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
