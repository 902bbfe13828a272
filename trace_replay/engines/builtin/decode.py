"""The replay loop of the built-in engine, its one-token step, and free generation; the
slots its requests decode in.

A wave is up to ``num_slots`` requests decoded as one batch (:func:`waves`); slot ``b`` is
batch row ``b``. :class:`SlotTable` admits a wave: it stages each request's trace in
:class:`~trace_replay.engines.replay_state.TraceReplayState`, sets its lengths in
:class:`~trace_replay.engines.replay_state.RequestState` and releases the slots a larger
previous wave left.

:func:`replay_forwards` is the one replay loop: it hands each forward's logits to a
:class:`StepRunner` — :class:`ForcedSteps` here (one token per row, eager or captured in one
CUDA graph), :class:`~trace_replay.engines.builtin.verify.VerifySteps` (``k`` drafts per row)
— which forces, scores and commits, and feeds the backend the runner's next ``tokens`` and
``positions`` ``[B, q]``. A replay step is ``total_len - prompt_len``, counted from 0; forward
0 scores the prefill's logits. Nothing in a step reads back to the host.

:class:`ForcedSteps` runs the same ``_step`` eagerly or, when the backend's ``decode`` returns
the same static logits tensor every step (``StaticCacheBackend.static_logits``), captured once
and launched: one launch per step for the argmax, forcing, advance, scoring and next inputs.
Forward 0 of a later wave launches it too, on the prefill's logits copied into that tensor.
Each step's scores land in row ``cursor`` of buffers held for the wave (a device counter), so
nothing is overwritten and nothing is read back. A capture depends on every address it reads
and every host-side choice it made (the key: slot and trace-length tensors, rows, top-k,
scorer, whether any trace is staged, buffer capacity) and on the logits' memory; one capture
is kept per engine (``cache``), because capturing synchronizes and collects garbage. The trace
tokens are the exception: the trace state reallocates their storage as waves come and go, so
the steps read them from a buffer of their own, into which each wave's storage is copied (one
device copy per wave; a larger storage captures anew).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.backends.base import Backend
from trace_replay.engines.builtin.scoring import Steps, TokenScores, greedy_tokens, score_tokens
from trace_replay.engines.replay_state import RequestState, TraceReplayState

__all__ = [
    "Scorer",
    "Steps",
    "StepRunner",
    "ForcedSteps",
    "replay_forwards",
    "replay_steps",
    "forced_step",
    "generate_steps",
    "SlotTable",
    "waves",
]

# (logits [N, V], token_ids [N], top_k) -> scores; score_tokens, or a backend's own
Scorer = Callable[[torch.Tensor, torch.Tensor, int], TokenScores]


def waves(requests: Sequence[ReplayRequest], size: int) -> Iterator[list[int]]:
    """Indices of ``requests`` in waves of at most ``size``, shortest traces first.

    Waves of similar length waste fewer steps on rows that have finished.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].trace_len)
    for start in range(0, len(order), size):
        yield order[start : start + size]


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


class StepRunner(Protocol):
    """What the replay loop drives: one call per forward, then the next forward's feed."""

    tokens: torch.Tensor  # [B, q] int64, fed to the next forward
    positions: torch.Tensor  # [B, q] int64, their positions

    def step(self, logits: torch.Tensor, forward: int) -> bool:
        """Force, score and commit on forward ``forward``'s logits ``[B * q, V]``
        (forward 0: the prefill's ``[B, V]``); set ``tokens``/``positions``; return whether
        another forward is needed."""


def replay_forwards(
    backend: Backend,
    runner: StepRunner,
    logits: torch.Tensor,
    on_forward: Callable[[int], None] | None = None,
) -> int:
    """The replay loop: ``runner`` steps on each forward's logits, ``backend`` runs the next.

    ``logits``: the prefill's ``[B, V]``; each ``backend.decode`` output ``[B, q, V]`` is
    handed on as ``[B * q, V]`` (a view). ``on_forward(i)`` is called after forward ``i``
    (host only). Returns the number of forwards, prefill included.
    """
    forward = 0
    while True:
        more = runner.step(logits, forward)
        if on_forward is not None:
            on_forward(forward)
        if not more:
            return forward + 1
        logits = backend.decode(runner.tokens, runner.positions).flatten(0, 1)
        forward += 1


def forced_step(
    logits: torch.Tensor,
    slots: SlotTable,
    idx_mapping: torch.Tensor,
    top_k: int,
    score: Scorer = score_tokens,
    *,
    trace_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenScores]:
    """Sample, force the trace token, score it on the unmodified logits, commit it.

    ``trace_token_ids``: see :meth:`~trace_replay.engines.replay_state.TraceReplayState.apply_trace`.
    """
    sampled = greedy_tokens(logits)
    slots.trace_state.apply_trace(sampled, idx_mapping, trace_token_ids=trace_token_ids)
    slots.advance(idx_mapping)
    return sampled, score(logits, sampled, top_k)


def replay_steps(
    backend: Backend,
    slots: SlotTable,
    idx_mapping: torch.Tensor,
    logits: torch.Tensor,
    num_steps: int,
    top_k: int,
    score: Scorer = score_tokens,
    on_step: Callable[[int], None] | None = None,
    *,
    cache: dict | None = None,
    graph: bool = False,
) -> tuple[Steps, torch.Tensor]:
    """Forced decoding for ``num_steps`` steps, one token per row per step.

    Returns the steps (views into :class:`ForcedSteps` buffers, valid until its next wave) and
    the ``[num_steps, B]`` int32 count of tokens each row committed per forward (all ones).
    ``graph``: every step launches one CUDA graph, captured at forward 1 of the first wave it
    fits (needs a backend whose ``decode`` returns static logits); else the same steps run
    eagerly. ``cache`` (a dict the
    caller keeps) holds the steps, and their capture, for the next wave.
    """
    forced = _forced_steps(cache, slots, idx_mapping, top_k, score, num_steps, graph)
    replay_forwards(backend, forced, logits, on_step)
    return forced.steps(), torch.ones((num_steps, len(idx_mapping)), dtype=torch.int32)


class ForcedSteps:
    """Forced steps of one token per row, writing step ``i``'s scores to buffer row ``i``.

    Design contract: ``start(idx_mapping, num_steps)`` begins a wave of at most ``capacity``
    steps (rows, trace tokens, cursor). ``step(logits, forward)`` forces and scores
    ``logits`` ``[B, V]``, commits one token per row, writes the next ``tokens``/``positions``
    ``[B, 1]`` and the scores to row ``cursor``, then advances ``cursor`` — eagerly, or with
    ``graph`` (CUDA) by launching one graph captured on the decode logits' memory at forward
    1 (captured anew there if that memory moved since; moving later is an error); forward 0
    launches it on the prefill's logits copied into that memory once it exists.
    ``steps()`` gives the wave's steps as views, valid until the next ``start``.
    """

    def __init__(
        self,
        slots: SlotTable,
        idx_mapping: torch.Tensor,
        top_k: int,
        score: Scorer,
        capacity: int,
        *,
        graph: bool,
        key: tuple,
    ) -> None:
        self.slots, self.top_k, self.score = slots, top_k, score
        self.idx_mapping = idx_mapping.clone()
        self.capacity, self.graph, self.num_steps = capacity, graph, 0
        rows, device = len(idx_mapping), idx_mapping.device
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.sampled = torch.zeros((capacity, rows), dtype=torch.long, device=device)
        self.scores: list[torch.Tensor] | None = None  # allocated by the first (eager) step
        self.trace_tokens = slots.trace_state.trace_token_ids  # see the module docstring
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # what the graph reads
        self.key = key  # what the capture depends on besides the logits (see _key)

    def fits(self, slots: SlotTable) -> bool:
        """Whether the trace storage now held fits this capture's own trace buffer."""
        return slots.trace_state.trace_token_ids.numel() <= self.trace_tokens.numel()

    def start(self, idx_mapping: torch.Tensor, num_steps: int) -> None:
        """A new wave (the same key): its rows, its trace tokens, the first buffer row."""
        self.idx_mapping.copy_(idx_mapping)
        self.cursor.zero_()
        self.num_steps = num_steps
        tokens = self.slots.trace_state.trace_token_ids
        if tokens is not self.trace_tokens:
            self.trace_tokens[: tokens.numel()].copy_(tokens)

    def step(self, logits: torch.Tensor, forward: int) -> bool:
        if not self.graph:
            self._step(logits)
        elif forward == 0:
            self._first(logits)
        else:
            self._launch(logits, forward)
        return forward + 1 < self.num_steps

    def steps(self) -> Steps:
        return [
            (TokenScores(*(values[i] for values in self.scores or [])), self.sampled[i])
            for i in range(self.num_steps)
        ]

    def _first(self, logits: torch.Tensor) -> None:
        """Forward 0 scores the prefill's logits, another tensor than the decode's: once a
        capture exists they are copied into the memory it reads and it is launched (one copy
        of ``[B, V]`` instead of the step's launches); before that the step runs eagerly."""
        captured = self._logits
        if (
            self._graph is None
            or captured is None
            or captured.shape != logits.shape
            or captured.dtype != logits.dtype
        ):
            self._step(logits)
            return
        captured.copy_(logits)
        self._graph.replay()

    def _launch(self, logits: torch.Tensor, forward: int) -> None:
        if self._graph is None or self._logits is None or not _same_memory(logits, self._logits):
            if forward > 1:
                raise RuntimeError(
                    "the backend's decode moved its logits within a wave; "
                    "captured forcing needs a static logits tensor"
                )
            from trace_replay.engines.builtin.backends.captured_step import capture  # CUDA only

            state = (self.slots.req_states.total_len, self.cursor)
            self._graph, _ = capture(lambda: self._step(logits), state)
            self._logits = logits
        self._graph.replay()

    def _step(self, logits: torch.Tensor) -> None:
        sampled, scores = forced_step(
            logits,
            self.slots,
            self.idx_mapping,
            self.top_k,
            self.score,
            trace_token_ids=self.trace_tokens,
        )
        if self.scores is None:  # shapes and dtypes from the scorer, before any capture
            self.scores = [value.new_zeros((self.capacity, *value.shape)) for value in scores]
        self.sampled.index_copy_(0, self.cursor, sampled[None])
        for values, value in zip(self.scores, scores):
            values.index_copy_(0, self.cursor, value[None])
        self.tokens.copy_(sampled[:, None])
        self.positions.copy_((self.slots.total_len(self.idx_mapping) - 1)[:, None])
        self.cursor += 1


def _forced_steps(
    cache: dict | None,
    slots: SlotTable,
    idx_mapping: torch.Tensor,
    top_k: int,
    score: Scorer,
    num_steps: int,
    graph: bool,
) -> ForcedSteps:
    """The cached :class:`ForcedSteps`, started, if its key matches this wave's; else new ones."""
    capacity = max(16, 1 << (num_steps - 1).bit_length())  # waves of similar length share one
    key = _key(slots, len(idx_mapping), top_k, score, capacity, graph)
    forced = None if cache is None else cache.get("forced")
    if forced is None or forced.key != key or not forced.fits(slots):
        forced = ForcedSteps(slots, idx_mapping, top_k, score, capacity, graph=graph, key=key)
        if cache is not None:
            cache["forced"] = forced
    forced.start(idx_mapping, num_steps)
    return forced


def _key(
    slots: SlotTable, rows: int, top_k: int, score: Scorer, capacity: int, graph: bool
) -> tuple:
    """What a capture depends on besides the logits: addresses it reads, host-side choices."""
    trace, requests = slots.trace_state, slots.req_states
    tensors = (requests.total_len, requests.prompt_len, trace.trace_offsets, trace.trace_len)
    return (
        tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors),
        rows,
        top_k,
        id(score),
        capacity,
        trace.has_traces,
        graph,
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


def generate_steps(
    backend: Backend,
    slots: SlotTable,
    idx_mapping: torch.Tensor,
    logits: torch.Tensor,
    *,
    max_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_token_id: int | None,
    score: Scorer = score_tokens,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Free generation (no trace): ``([B, T] token ids, [B, T] raw logprobs)``, T <= ``max_tokens``.

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
