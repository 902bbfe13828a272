"""A replay step's work around the forward — force, score, advance — in one CUDA graph.

Between two decode forwards a replay step runs about fifteen small launches from Python:
the argmax, the forcing kernel, the step advance, the top-k kernel and the compiled scoring
reductions, the next tokens and positions, each with its host dispatch and a gap on the
GPU. When the backend's ``decode`` returns the same static logits tensor every step
(:attr:`StaticCacheBackend.static_logits`), that work is captured once and replayed: one
launch per step. (On an H200 at bf16 batch 256, replay / greedy was 0.95 in the run before
it and in the run with it; see benchmarks/RESULTS.md.) Each step's scores land in row ``i``
of buffers held for the wave (a device counter picks the row), so nothing is overwritten
and nothing is read back.

Every tensor address and host-side choice the capture saw is part of its key (the logits,
the slot and trace-length tensors, the rows, the top-k, the scorer, whether any trace is
staged), so a wave whose key differs captures anew; one capture is kept per engine, because
capturing synchronizes and collects garbage. The trace tokens are the exception: the trace
state reallocates their storage as waves come and go (it compacts to stay at least half
live), so the steps read them from a buffer of their own — the state's, as it was at
capture — into which a later wave's storage is copied (one device copy per wave; a larger
storage captures anew).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trace_replay.engines.builtin.backends.captured_step import capture
from trace_replay.engines.builtin.decode import Scorer, Steps, forced_step
from trace_replay.engines.scoring import TokenScores
from trace_replay.engines.builtin.slots import SlotTable

__all__ = ["ForcedSteps", "replay_steps_captured"]


class ForcedSteps:
    """Forced steps over one logits tensor, writing each step's scores to row ``step``.

    Design contract: ``run()`` reads ``logits`` as it is at that moment (for a graph: the
    memory it was captured on), forces and scores it, commits one token per row, writes the
    row's next ``tokens``/``positions`` ``[B, 1]`` and the scores to row ``cursor`` of the
    buffers, then advances ``cursor``. ``start(idx_mapping)`` begins a wave of at most
    ``capacity`` steps (rows, trace tokens, cursor); ``steps(n)`` gives the first ``n`` rows as
    :data:`~trace_replay.engines.builtin.decode.Steps` views, valid until the next ``start``.
    With ``graph``, the first ``run`` after construction captures (CUDA only).
    """

    def __init__(self, logits: torch.Tensor, slots: SlotTable, idx_mapping: torch.Tensor,
                 top_k: int, score: Scorer, capacity: int, *, graph: bool,
                 key: tuple) -> None:
        self.logits, self.slots, self.top_k, self.score = logits, slots, top_k, score
        self.idx_mapping = idx_mapping.clone()
        self.capacity, self.graph = capacity, graph
        rows, device = len(idx_mapping), logits.device
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.sampled = torch.zeros((capacity, rows), dtype=torch.long, device=device)
        self.scores: list[torch.Tensor] | None = None  # allocated by the first step
        self.trace_tokens = slots.trace_state.trace_token_ids  # see the module docstring
        self._graph: torch.cuda.CUDAGraph | None = None
        self.key = key  # what the capture depends on (see _key)

    def fits(self, slots: SlotTable) -> bool:
        """Whether the trace storage now held fits this capture's own trace buffer."""
        return slots.trace_state.trace_token_ids.numel() <= self.trace_tokens.numel()

    def start(self, idx_mapping: torch.Tensor) -> None:
        """A new wave (the same key): its rows, its trace tokens, the first buffer row."""
        self.idx_mapping.copy_(idx_mapping)
        self.cursor.zero_()
        tokens = self.slots.trace_state.trace_token_ids
        if tokens is not self.trace_tokens:
            self.trace_tokens[: tokens.numel()].copy_(tokens)

    def run(self) -> None:
        if not self.graph:
            self._step()
            return
        if self._graph is None:
            state = (self.slots.req_states.total_len, self.cursor)
            self._graph, _ = capture(self._step, state)
        self._graph.replay()

    def steps(self, count: int) -> Steps:
        return [(TokenScores(*(values[i] for values in self.scores)), self.sampled[i])
                for i in range(count)]

    def _step(self) -> None:
        sampled, scores = forced_step(self.logits, self.slots, self.idx_mapping, self.top_k,
                                      self.score, trace_token_ids=self.trace_tokens)
        if self.scores is None:  # shapes and dtypes from the scorer, before any capture
            self.scores = [value.new_zeros((self.capacity, *value.shape)) for value in scores]
        self.sampled.index_copy_(0, self.cursor, sampled[None])
        for values, value in zip(self.scores, scores):
            values.index_copy_(0, self.cursor, value[None])
        self.tokens.copy_(sampled[:, None])
        self.positions.copy_((self.slots.total_len(self.idx_mapping) - 1)[:, None])
        self.cursor += 1


def replay_steps_captured(backend, slots: SlotTable, idx_mapping: torch.Tensor,
                          logits: torch.Tensor, num_steps: int, top_k: int, score: Scorer,
                          on_step: Callable[[int], None] | None = None, *,
                          cache: dict | None = None,
                          graph: bool = True) -> tuple[Steps, torch.Tensor]:
    """:func:`~trace_replay.engines.builtin.decode.replay_steps`, each step after the first one graph.

    The first step scores the prefill's logits eagerly (another tensor); the next ones run
    :class:`ForcedSteps` over the tensor ``backend.decode`` returns. ``cache`` (a dict the
    caller keeps) holds the last capture for the next wave. ``graph=False`` runs the same
    steps eagerly (CPU; what the tests compare).
    """
    steps: Steps = []
    sampled, scores = forced_step(logits, slots, idx_mapping, top_k, score)
    steps.append((scores, sampled))
    if on_step is not None:
        on_step(0)
    if num_steps > 1:
        positions = (slots.total_len(idx_mapping) - 1)[:, None]
        logits = backend.decode(sampled[:, None], positions)[:, -1]
        forced = _forced_steps(cache, logits, slots, idx_mapping, top_k, score, num_steps - 1,
                               graph)
        for step in range(1, num_steps):
            if not graph:  # a graph reads the memory it was captured on
                forced.logits = logits
            forced.run()
            if on_step is not None:
                on_step(step)
            if step == num_steps - 1:
                break
            logits = backend.decode(forced.tokens, forced.positions)[:, -1]
            if graph and not _same_memory(logits, forced.logits):
                raise RuntimeError("the backend's decode moved its logits within a wave; "
                                   "captured forcing needs a static logits tensor")
        steps += forced.steps(num_steps - 1)
    return steps, torch.ones((len(steps), len(idx_mapping)), dtype=torch.int32)


def _forced_steps(cache: dict | None, logits: torch.Tensor, slots: SlotTable,
                  idx_mapping: torch.Tensor, top_k: int, score: Scorer, count: int,
                  graph: bool) -> ForcedSteps:
    """The cached :class:`ForcedSteps` if its key matches this wave's, else a new one."""
    capacity = max(16, 1 << (count - 1).bit_length())  # waves of similar length share one
    key = _key(logits, slots, len(idx_mapping), top_k, score, capacity, graph)
    forced = None if cache is None else cache.get("forced")
    if forced is None or forced.key != key or not forced.fits(slots):
        forced = ForcedSteps(logits, slots, idx_mapping, top_k, score, capacity, graph=graph,
                             key=key)
        if cache is not None:
            cache["forced"] = forced
    forced.start(idx_mapping)
    return forced


def _key(logits: torch.Tensor, slots: SlotTable, rows: int, top_k: int, score: Scorer,
         capacity: int, graph: bool) -> tuple:
    """What a capture depends on: addresses it reads and host-side choices it made.

    Run eagerly, the steps read the logits they are handed, wherever they are.
    """
    trace, requests = slots.trace_state, slots.req_states
    tensors = ((logits,) if graph else ()) + (
        requests.total_len, requests.prompt_len, trace.trace_offsets, trace.trace_len)
    return (tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors),
            rows, top_k, id(score), capacity, trace.has_traces, graph)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
