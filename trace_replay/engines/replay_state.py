"""The replay state of an engine's request slots: lengths, and the traces to force.

:class:`RequestState` holds per-slot lengths the engine advances; :class:`TraceReplayState`
stages and stores the traces and launches the kernels that force them
(:mod:`~trace_replay.kernels.trace_tokens`, :mod:`~trace_replay.kernels.trace_tokens_verified`,
:mod:`~trace_replay.kernels.force_logits`). Shared by the built-in engine (its slot table,
:func:`~trace_replay.engines.builtin.decode.waves`) and vLLM's forcing logits processors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.force_logits import force_trace_logits
from trace_replay.kernels.trace_tokens import apply_trace_tokens, apply_trace_tokens_reference
from trace_replay.kernels.trace_tokens_verified import apply_trace_tokens_to_verified

__all__ = ["RequestState", "SlotLengths", "TraceReplayState"]


class SlotLengths(Protocol):
    """What :class:`TraceReplayState` reads of its slots' lengths: a :class:`RequestState`,
    or a view of an engine's own (vLLM Model Runner V2's, read at each use)."""

    max_num_reqs: int
    device: torch.device

    @property
    def prompt_len(self) -> torch.Tensor: ...

    @property
    def total_len(self) -> torch.Tensor: ...


class RequestState:
    """Per-slot lengths that the engine owns and advances.

    Parameters
    ----------
    max_num_reqs : int
        Number of request slots.
    device : torch.device or str
        Where the lengths live.

    Attributes
    ----------
    prompt_len : torch.Tensor
        ``[max_num_reqs]`` int32 prompt length of each slot.
    total_len : torch.Tensor
        ``[max_num_reqs]`` int32 tokens committed so far (prompt plus emitted). The replay
        step of slot ``r`` is ``total_len[r] - prompt_len[r]``, counted from 0.
    """

    def __init__(self, max_num_reqs: int, device: torch.device | str) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        self.prompt_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.total_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)


class TraceReplayState:
    """Traces of the requests in flight, stored ragged on the device.

    Design contract:

    * The replay step is derived entirely from device state (``total_len - prompt_len``),
      so replaying a step needs no CPU synchronization.
    * ``add_request``/``remove_request`` only stage on the host; ``apply_staged_writes``,
      called once per step, sends everything staged in one host-to-device copy and does
      nothing at all when nothing was staged.
    * Storage is proportional to the trace tokens held, not ``max_num_reqs x
      max_model_len``: one flat int32 buffer with a per-slot int64 offset and int32
      length. New traces are appended (capacity grows geometrically); when holes left by
      removed traces outnumber the live tokens, the buffer is compacted on the device
      with one gather. Growth and compaction reallocate ``trace_token_ids``, so a CUDA
      graph that captured :meth:`apply_trace` must be captured again after them.
    * ``apply_trace`` skips the launch when no slot holds a trace (tracked on the host).

    Parameters
    ----------
    req_states : RequestState
        The engine's per-slot lengths; read, never written.
    min_capacity : int, default 256
        Smallest token buffer kept once any trace has been stored.

    Examples
    --------
    >>> req_states = RequestState(max_num_reqs=4, device="cpu")
    >>> state = TraceReplayState(req_states)
    >>> state.add_request(2, [11, 12, 13])
    >>> req_states.prompt_len[2] = req_states.total_len[2] = 5
    >>> state.apply_staged_writes()
    >>> sampled = torch.zeros(1, dtype=torch.int64)
    >>> state.apply_trace(sampled, idx_mapping=torch.tensor([2], dtype=torch.int32))
    >>> sampled.tolist()
    [11]
    """

    def __init__(self, req_states: SlotLengths, *, min_capacity: int = 256) -> None:
        self.req_states = req_states
        self.device = req_states.device
        self.min_capacity = min_capacity
        max_num_reqs = req_states.max_num_reqs
        self.trace_token_ids = torch.empty(0, dtype=torch.int32, device=self.device)
        self.trace_offsets = torch.zeros(max_num_reqs, dtype=torch.int64, device=self.device)
        self.trace_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.num_staged_copies = 0  # host-to-device copies made, for tests and benchmarks

        self._pin = self.device.type == "cuda"
        # the launcher's choice, made once for the state's device: on a CPU without Triton's
        # interpreter every step runs the torch reference directly
        self._apply_trace = (
            apply_trace_tokens if use_triton(self.trace_len) else apply_trace_tokens_reference
        )
        self._staged: dict[int, torch.Tensor | None] = {}
        self._host_len = [0] * max_num_reqs  # lengths as of the last apply_staged_writes
        self._num_traced = 0  # slots whose length is > 0
        self._num_held = 0  # live tokens in the buffer
        self._num_used = 0  # buffer prefix written so far: live tokens plus holes

    @property
    def num_trace_tokens(self) -> int:
        """Trace tokens held on the device (staged traces count once applied)."""
        return self._num_held

    @property
    def has_traces(self) -> bool:
        """Whether any slot holds a non-empty trace (the kernels launch only then)."""
        return self._num_traced > 0

    @property
    def storage_bytes(self) -> int:
        """Device bytes of this state: token buffer, offsets and lengths."""
        tensors = (self.trace_token_ids, self.trace_offsets, self.trace_len)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_trace_token(self) -> float:
        """``storage_bytes / num_trace_tokens``; infinite when no token is held."""
        return self.storage_bytes / self._num_held if self._num_held else math.inf

    def add_request(
        self, req_idx: int, trace_token_ids: Sequence[int] | torch.Tensor | None
    ) -> None:
        """Stage slot ``req_idx``'s trace, replacing any previous one; host-side only.

        ``None`` or an empty trace leaves the slot without a trace.
        """
        self._check_slot(req_idx)
        tokens = None
        if isinstance(trace_token_ids, torch.Tensor):
            tokens = trace_token_ids.to("cpu", torch.int64).reshape(-1).clone()
        elif trace_token_ids is not None:  # numpy reads a list of ints faster than torch
            tokens = torch.from_numpy(np.array(trace_token_ids, dtype=np.int64).reshape(-1))
        self._staged[req_idx] = tokens if tokens is not None and tokens.numel() else None

    def remove_request(self, req_idx: int) -> None:
        """Stage slot ``req_idx`` to stop replaying; its tokens are freed when applied."""
        self._check_slot(req_idx)
        self._staged[req_idx] = None

    def apply_staged_writes(self) -> None:
        """Apply everything staged since the last call in one host-to-device copy.

        Does nothing (no copy, no kernel) when nothing was staged.
        """
        if not self._staged:
            return
        staged, self._staged = self._staged, {}
        for req_idx in staged:
            self._num_held -= self._host_len[req_idx]
            self._num_traced -= self._host_len[req_idx] > 0
            self._host_len[req_idx] = 0
        new_traces = [t for t in staged.values() if t is not None]
        lens = torch.tensor(
            [0 if t is None else t.numel() for t in staged.values()], dtype=torch.int64
        )
        num_new = int(lens.sum())
        # compact once holes outnumber live tokens: the buffer stays at least half live
        compact = self._num_used - self._num_held > self._num_held
        append_at = self._num_held if compact else self._num_used
        offsets = append_at + torch.cumsum(lens, 0) - lens

        slots, lens_dev, offsets, tokens = self._copy_to_device(
            [torch.tensor(list(staged), dtype=torch.int64), lens, offsets, *new_traces], len(staged)
        )
        if compact:
            self._compact(self.trace_len.index_fill(0, slots, 0), num_new)
        elif self._num_used + num_new > self.trace_token_ids.numel():
            self._grow(self._num_used + num_new)
        self.trace_token_ids[append_at : append_at + num_new] = tokens
        self.trace_offsets.index_copy_(0, slots, offsets)
        self.trace_len.index_copy_(0, slots, lens_dev.to(torch.int32))

        for req_idx, length in zip(staged, lens.tolist()):
            self._host_len[req_idx] = length
            self._num_traced += length > 0
        self._num_held += num_new
        self._num_used = append_at + num_new

    @property
    def _trace_args(self) -> tuple[torch.Tensor, ...]:
        """What every trace kernel reads: tokens, trace lengths, total and prompt lengths."""
        return (
            self.trace_token_ids,
            self.trace_len,
            self.req_states.total_len,
            self.req_states.prompt_len,
        )

    def apply_trace(
        self,
        sampled: torch.Tensor,
        idx_mapping: torch.Tensor,
        *,
        trace_token_ids: torch.Tensor | None = None,
    ) -> None:
        """Force ``sampled`` to each request's trace token; see :func:`apply_trace_tokens`.

        ``trace_token_ids``: read the tokens from this copy of the storage (at least as long,
        same offsets) instead; a CUDA graph that outlives a reallocation keeps its own.
        """
        if self._num_traced == 0:
            return
        tokens, *lengths = self._trace_args
        self._apply_trace(
            sampled,
            idx_mapping,
            tokens if trace_token_ids is None else trace_token_ids,
            *lengths,
            trace_offsets=self.trace_offsets,
        )

    def force_logits(
        self,
        logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        *,
        value: float = 1e30,
        advance: bool = False,
    ) -> None:
        """Raise each row's trace-token logit to ``value``; see :func:`force_trace_logits`."""
        if self._num_traced == 0 and not advance:
            return
        force_trace_logits(
            logits,
            idx_mapping,
            *self._trace_args,
            trace_offsets=self.trace_offsets,
            value=value,
            advance=advance,
        )

    def apply_trace_to_verified(
        self,
        sampled: torch.Tensor,
        num_sampled: torch.Tensor,
        draft_sampled: torch.Tensor,
        cu_num_logits: torch.Tensor,
        idx_mapping: torch.Tensor,
    ) -> None:
        """Force verified tokens to the trace; see :func:`apply_trace_tokens_to_verified`."""
        if self._num_traced == 0:
            return
        apply_trace_tokens_to_verified(
            sampled,
            num_sampled,
            draft_sampled,
            cu_num_logits,
            idx_mapping,
            *self._trace_args,
            trace_offsets=self.trace_offsets,
        )

    def peek(self, idx_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The next ``num_tokens`` trace tokens of each batch row, as drafts to verify.

        Row ``b`` holds ``trace[r][step : step + num_tokens]`` for ``r = idx_mapping[b]``;
        positions past the trace (or rows without one) hold token 0, which verification
        never accepts there. Reads device state only: no host synchronization.

        Returns
        -------
        torch.Tensor
            ``[num_reqs, num_tokens]`` int64 on the state's device.
        """
        shape = (idx_mapping.shape[0], num_tokens)
        drafts = torch.zeros(shape, dtype=torch.int64, device=self.device)
        if self._num_traced == 0:
            return drafts
        req_idx = idx_mapping.long().clamp(min=0)
        req_states = self.req_states
        step = (req_states.total_len[req_idx] - req_states.prompt_len[req_idx]).long()
        pos = step[:, None] + torch.arange(num_tokens, device=self.device)
        inside = (idx_mapping >= 0)[:, None] & (pos >= 0) & (pos < self.trace_len[req_idx, None])
        flat_pos = torch.where(inside, self.trace_offsets[req_idx, None] + pos, 0)
        return torch.where(inside, self.trace_token_ids[flat_pos].long(), drafts)

    def _check_slot(self, req_idx: int) -> None:
        if not 0 <= req_idx < self.req_states.max_num_reqs:
            raise IndexError(f"req_idx {req_idx} outside [0, {self.req_states.max_num_reqs})")

    def _copy_to_device(self, parts: list[torch.Tensor], num_slots: int) -> list[torch.Tensor]:
        """Send ``[slots, lens, offsets, *traces]`` in one copy; split into those four."""
        host = torch.cat(parts).pin_memory() if self._pin else torch.cat(parts)
        # the caching host allocator keeps a pinned block alive until its copy completes
        dev = host.to(self.device, non_blocking=True)
        self.num_staged_copies += 1
        return dev.split([num_slots, num_slots, num_slots, dev.numel() - 3 * num_slots])

    def _grow(self, num_needed: int) -> None:
        capacity = max(
            self.min_capacity, 2 * self.trace_token_ids.numel(), _next_power_of_2(num_needed)
        )
        buffer = torch.empty(capacity, dtype=torch.int32, device=self.device)
        buffer[: self._num_used] = self.trace_token_ids[: self._num_used]
        self.trace_token_ids = buffer

    def _compact(self, live_len: torch.Tensor, num_new: int) -> None:
        """Gather the live traces to the front of a right-sized buffer, in slot order."""
        live_len = live_len.long()
        new_offsets = torch.cumsum(live_len, 0) - live_len
        # output_size keeps repeat_interleave from reading the total back from the device
        shift = torch.repeat_interleave(
            self.trace_offsets - new_offsets, live_len, output_size=self._num_held
        )
        gather_idx = shift + torch.arange(self._num_held, device=self.device)
        capacity = max(self.min_capacity, _next_power_of_2(self._num_held + num_new))
        buffer = torch.empty(capacity, dtype=torch.int32, device=self.device)
        buffer[: self._num_held] = self.trace_token_ids[gather_idx]
        self.trace_token_ids = buffer
        self.trace_offsets.copy_(new_offsets)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
