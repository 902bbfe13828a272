"""Slot admission for the built-in engine: which requests decode together, in which slots.

A wave is up to ``num_slots`` requests decoded as one batch; slot ``b`` is batch row ``b``.
Admission stages each request's trace in
:class:`~trace_replay.engines.replay_state.TraceReplayState` and sets its lengths in
:class:`~trace_replay.engines.replay_state.RequestState`; slots left over from a larger
previous wave are released.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.replay_state import RequestState, TraceReplayState

__all__ = ["SlotTable", "waves"]


def waves(requests: Sequence[ReplayRequest], size: int) -> Iterator[list[int]]:
    """Indices of ``requests`` in waves of at most ``size``, shortest traces first.

    Waves of similar length waste fewer steps on rows that have finished.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].trace_len)
    for start in range(0, len(order), size):
        yield order[start:start + size]


class SlotTable:
    """The per-slot replay state of one engine: request lengths and staged traces."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.req_states = RequestState(num_slots, device)
        self.trace_state = TraceReplayState(self.req_states)
        self._in_use = 0

    def admit(self, wave: Sequence[ReplayRequest]) -> torch.Tensor:
        """Place ``wave`` in slots ``0 .. len(wave) - 1``; returns their ``idx_mapping``."""
        if len(wave) > self.num_slots:
            raise ValueError(f"a wave of {len(wave)} requests for {self.num_slots} slots")
        for slot, request in enumerate(wave):
            self.trace_state.add_request(slot, request.trace_token_ids)
        for slot in range(len(wave), self._in_use):
            self.trace_state.remove_request(slot)
        self._in_use = len(wave)
        self.trace_state.apply_staged_writes()
        prompt_len = torch.tensor([r.prompt_len for r in wave], dtype=torch.int32)
        self.req_states.prompt_len[: len(wave)] = prompt_len.to(self.device)
        self.req_states.total_len[: len(wave)] = prompt_len.to(self.device)
        return torch.arange(len(wave), device=self.device)

    def total_len(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """Tokens committed per row (prompt + emitted), int64."""
        return self.req_states.total_len[idx_mapping].long()

    def steps_done(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """Replay steps committed per row: ``total_len - prompt_len``, int64."""
        return self.total_len(idx_mapping) - self.req_states.prompt_len[idx_mapping].long()

    def advance(self, idx_mapping: torch.Tensor, count: torch.Tensor | int = 1) -> None:
        """Commit ``count`` more tokens per row."""
        self.req_states.total_len[idx_mapping] += count
