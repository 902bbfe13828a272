"""The step-by-step decode loops of the built-in engine: forced replay and free generation.

Both run one wave already admitted to a :class:`~trace_replay.engines.builtin.slots.SlotTable`,
starting from the prefill's next-token logits. A step feeds each row's last token at its
position ``total_len - 1``; nothing in a step reads back to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trace_replay.engines.scoring import TokenScores, greedy_tokens, score_tokens
from trace_replay.engines.builtin.slots import SlotTable

__all__ = ["Scorer", "Steps", "replay_steps", "forced_step", "generate_steps"]

# per forward: the scores of its rows (flattened [B * q]) and the tokens they committed
Steps = list[tuple[TokenScores, torch.Tensor]]
# (logits [N, V], token_ids [N], top_k) -> scores; score_tokens, or a backend's own
Scorer = Callable[[torch.Tensor, torch.Tensor, int], TokenScores]


def forced_step(logits: torch.Tensor, slots: SlotTable, idx_mapping: torch.Tensor,
                top_k: int, score: Scorer = score_tokens, *,
                trace_token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, TokenScores]:
    """Sample, force the trace token, score it on the unmodified logits, commit it.

    ``trace_token_ids``: see :meth:`~trace_replay.kernels.state.TraceReplayState.apply_trace`.
    """
    sampled = greedy_tokens(logits)
    slots.trace_state.apply_trace(sampled, idx_mapping, trace_token_ids=trace_token_ids)
    slots.advance(idx_mapping)
    return sampled, score(logits, sampled, top_k)


def replay_steps(backend, slots: SlotTable, idx_mapping: torch.Tensor, logits: torch.Tensor,
                 num_steps: int, top_k: int,
                 score: Scorer = score_tokens,
                 on_step: Callable[[int], None] | None = None) -> tuple[Steps, torch.Tensor]:
    """Forced decoding for ``num_steps`` steps; one token per row per step.

    Returns the steps and the ``[num_steps, B]`` count of tokens each row committed per
    forward (all ones here; the verify loop commits a variable number). ``on_step(step)``
    is called after each step (host only: it reads nothing back).
    """
    steps: Steps = []
    for step in range(num_steps):
        sampled, scores = forced_step(logits, slots, idx_mapping, top_k, score)
        steps.append((scores, sampled))
        if on_step is not None:
            on_step(step)
        if step == num_steps - 1:
            break
        positions = (slots.total_len(idx_mapping) - 1)[:, None]
        logits = backend.decode(sampled[:, None], positions)[:, -1]
    return steps, torch.ones((len(steps), len(idx_mapping)), dtype=torch.int32)


def generate_steps(backend, slots: SlotTable, idx_mapping: torch.Tensor, logits: torch.Tensor,
                   *, max_tokens: int, temperature: float, generator: torch.Generator,
                   eos_token_id: int | None,
                   score: Scorer = score_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """Free generation: ``([B, T] token ids, [B, T] raw logprobs)``, T <= ``max_tokens``.

    Greedy at ``temperature == 0``, else sampling with ``generator``. Generation stops early
    only when every row has emitted EOS (checked every 16 steps: one host read each).
    """
    tokens, logprobs = [], []
    finished = torch.zeros(len(idx_mapping), dtype=torch.bool, device=logits.device)
    for step in range(max_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            sampled = greedy_tokens(logits)
        tokens.append(sampled)
        logprobs.append(score(logits, sampled, 0).logprob)
        if eos_token_id is not None:
            finished |= sampled == eos_token_id
        if step == max_tokens - 1 or (step % 16 == 15 and bool(finished.all())):
            break
        slots.advance(idx_mapping)
        positions = (slots.total_len(idx_mapping) - 1)[:, None]
        logits = backend.decode(sampled[:, None], positions)[:, -1]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)
