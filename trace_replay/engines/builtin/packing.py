"""Several sequences packed into one row, each attending only to itself: no padding.

A padded batch computes every linear over ``rows × longest`` positions; packed, the model's
linears, norms and MLPs run once over the sum of the real lengths, and attention runs per
sequence with SDPA's causal kernel (no mask to build or read). Positions restart at 0 for
each sequence, so rotary embeddings see what an unpacked forward sees.

The model's own forward does this unchanged: its attention modules call the function named
by ``config._attn_implementation``, which for the forward is :func:`packed_attention`
(transformers builds no mask for a name it has no mask function for), and the sequences'
bounds reach it as a keyword argument through the model's ``**kwargs``.
:func:`packing_is_exact` checks once per model that this holds; a model that fails it is
run padded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trace_replay.engines.base import ReplayRequest

__all__ = [
    "PACKED_ATTENTION",
    "PackedBatch",
    "pack",
    "packed_attention",
    "packed_states",
    "packing_is_exact",
]

PACKED_ATTENTION = "trace_replay_packed"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    packed_bounds: Sequence[tuple[int, int]],
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention over each ``[start, end)`` of ``packed_bounds`` alone
    (``query [1, H, N, D]``, ``key, value [1, H_kv, N, D]``): causal, and with
    ``sliding_window`` a query sees the keys less than that many positions back (as
    transformers' own sliding mask). Score soft-capping is refused (SDPA has none).

    Returns ``[1, N, H, D]`` and no weights, as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if softcap is not None:
        raise ValueError("packed attention has no score soft-capping")
    kwargs.pop("is_causal", None)
    parts = []
    for start, end in packed_bounds:
        mask = None
        if sliding_window is not None and end - start > sliding_window:
            pos = torch.arange(end - start, device=query.device)
            back = pos[:, None] - pos[None, :]
            mask = (back >= 0) & (back < sliding_window)
        q, k, v = (x[:, :, start:end] for x in (query, key, value))
        parts.append(
            sdpa_attention_forward(module, q, k, v, mask, is_causal=mask is None, **kwargs)[0]
        )
    return torch.cat(parts, dim=1), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


@dataclass
class PackedBatch:
    """Requests fed as one row: prompt + trace but its last token, back to back."""

    input_ids: torch.Tensor  # [1, N] int64, N = sum of the fed lengths
    position_ids: torch.Tensor  # [1, N] int64, from 0 in each sequence
    bounds: list[tuple[int, int]]  # each sequence's [start, end) in the row
    scored: torch.Tensor  # [T] int64: positions whose logits predict a trace token, in order
    targets: torch.Tensor  # [T] int64: the trace tokens they predict


def pack(batch: Sequence[ReplayRequest], device: torch.device | str = "cpu") -> PackedBatch:
    """``batch`` as one packed row; scored positions and targets in request order."""
    ids: list[int] = []
    positions: list[int] = []
    bounds: list[tuple[int, int]] = []
    scored: list[int] = []
    targets: list[int] = []
    for r in batch:
        start = len(ids)
        fed = r.prompt_token_ids + r.trace_token_ids[:-1]  # the last trace token is never fed
        ids += fed
        positions += range(len(fed))
        bounds.append((start, len(ids)))
        # logits at position p predict the token at p + 1
        scored += range(start + r.prompt_len - 1, start + r.prompt_len - 1 + r.trace_len)
        targets += r.trace_token_ids
    return PackedBatch(
        torch.tensor([ids], device=device),
        torch.tensor([positions], device=device),
        bounds,
        torch.tensor(scored, device=device),
        torch.tensor(targets, device=device),
    )


@contextlib.contextmanager
def _packed_attention_of(lm: Any) -> Iterator[None]:
    """``lm``'s attention is :func:`packed_attention` inside the block (``lm`` must not run
    elsewhere meanwhile: its config is shared by every module)."""
    _register()
    config = lm.config
    before = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def packed_states(lm: Any, packed: PackedBatch) -> torch.Tensor:
    """Final hidden states ``[N, hidden]`` of ``lm``'s body over the packed row."""
    with _packed_attention_of(lm):
        out = lm.base_model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            packed_bounds=packed.bounds,
        )
    return out.last_hidden_state[0]


@torch.inference_mode()
def packing_is_exact(lm: Any, device: torch.device | str) -> bool:
    """Whether ``lm``'s body, packed, gives each sequence's states as run alone (checked on
    two short sequences, to float rounding). False where the model's layers do not reach
    :func:`packed_attention` with the bounds, place tokens by something else than
    ``position_ids``, or soft-cap attention scores."""
    if lm.base_model is lm:
        return False
    first, second = (1, 2, 3), (4, 5, 6, 7)
    packed = pack(
        [ReplayRequest("a", first[:1], first[1:]), ReplayRequest("b", second[:1], second[1:])],
        device,
    )
    try:
        together = packed_states(lm, packed).float()
    except (TypeError, ValueError, RuntimeError, KeyError):
        return False
    for (start, end), seq in zip(packed.bounds, (first, second)):
        ids = torch.tensor([seq[:-1]], device=device)
        alone = lm.base_model(input_ids=ids, use_cache=False).last_hidden_state[0].float()
        if not torch.allclose(together[start:end], alone, rtol=1e-3, atol=1e-3):
            return False
    return True
