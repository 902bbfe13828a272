"""The deterministic forward pass: every token's numbers depend on its own trace alone.

A :class:`~trace_replay.engines.builtin.backends.base.Backend` (and, for the prefill engine,
``teacher_forced`` / ``teacher_forced_states`` and ``lm_head``), computed by
:class:`~trace_replay.engines.builtin.backends.deterministic_model.DeterministicLlama`; it scores
with that model's row-invariant scoring.

Design contract:

* Every token is a *row* whose arithmetic never looks at another row, so batch size, wave,
  padding, the other traces and their order never reach a trace's numbers.
* A trace owns one cache row and its token at position ``p`` sits at slot ``p`` (no left
  padding), so its keys and its attention are the same in every batch. Rejected drafts of
  the verify path are always trailing, so their slots are given back and reused: verify
  gives the bits of step-by-step replay.
* Prompt prefill, a decode step and teacher forcing run the same row arithmetic, so decode
  replay and teacher-forced prefill (``teacher_forced``) give the same bits.
* On CUDA, decode steps are captured in CUDA graphs per tokens-per-row; nothing in
  ``decode`` or ``keep`` reads back to the host. While ``model.observer`` is set (layer
  attribution) steps run eagerly, so the observer sees each one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trace_replay.engines.base import Activations
from trace_replay.engines.builtin.backends.captured_step import StepGraph, capture_step
from trace_replay.engines.builtin.backends.deterministic_model import DeterministicLlama, KVCache
from trace_replay.engines.builtin.scoring import TokenScores

__all__ = ["DeterministicBackend"]


class DeterministicBackend:
    """Batch-invariant forward over a per-trace KV cache (see the module docstring).

    Parameters
    ----------
    lm
        A Llama-family transformers causal LM. Rows need no padding token.
    max_query_len
        Most tokens per row a ``decode`` will feed (``k + 1`` for verify).
    cuda_graphs
        Capture decode steps (default: on CUDA).
    triton, attention
        Passed to :class:`~trace_replay.engines.builtin.backends.deterministic_model.DeterministicLlama`
        (``attention``: its Triton attention, ``"tiles"`` or ``"rows"``).
    """

    # the forced step is not captured over its logits: observed or CPU steps run eagerly and
    # return new tensors
    static_logits = False

    def __init__(
        self,
        lm,
        *,
        max_query_len: int = 1,
        cuda_graphs: bool | None = None,
        triton: bool | None = None,
        attention: str = "tiles",
    ) -> None:
        self.model = DeterministicLlama(lm, triton=triton, attention=attention)
        self.device = self.model.device
        self.max_query_len = max_query_len
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.name = "deterministic" + ("+cudagraph" if self.cuda_graphs else "")
        self.forwards = 0
        self.cache: KVCache | None = None
        self.shape: tuple[int, int] | None = None  # (rows, slots) of the cache
        self._graphs: dict[int, StepGraph] = {}

    def settings(self) -> dict:
        """The arithmetic choices, under ``"arithmetic"`` (results depend on them)."""
        return {"arithmetic": self.model.describe()}

    def activations(self) -> Activations:
        """The row-wise model's rows (its ``observer``), over the model's weights."""
        return Activations(self.model.lm, self.model)

    def score(self, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
        """Row-invariant scoring of ``token_ids`` under ``logits``."""
        return self.model.score(logits, token_ids, top_k)

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
        """Start a wave: each prompt in its own cache row; ``[B, V]`` next-token logits."""
        lengths = [len(p) for p in prompts]
        self._start(lengths, max(lengths) + max_new_tokens + self.max_query_len)
        hidden = self._forward_sequences(prompts)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        self.forwards += 1
        return self.model.lm_head(hidden[last])

    @torch.inference_mode()
    def teacher_forced(
        self, sequences: Sequence[Sequence[int]], scored: Sequence[range]
    ) -> torch.Tensor:
        """Logits ``[sum(len(s) for s in scored), V]`` at the ``scored`` positions.

        ``sequences[i]`` is fed whole (prompt and trace but its last token); position ``p``
        of it gives the logits predicting token ``p + 1``, exactly as a decode step would.
        """
        return self.lm_head(self.teacher_forced_states(sequences, scored))

    @torch.inference_mode()
    def teacher_forced_states(
        self, sequences: Sequence[Sequence[int]], scored: Sequence[range]
    ) -> torch.Tensor:
        """:meth:`teacher_forced` before the head: final hidden states ``[N, hidden]``.

        :meth:`lm_head` of any slice of them gives the bits of the same rows of
        :meth:`teacher_forced` (rows are independent), so a caller can score in chunks.
        """
        lengths = [len(s) for s in sequences]
        self._start(lengths, max(lengths))
        hidden = self._forward_sequences(sequences)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows = [start + p for start, positions in zip(starts, scored) for p in positions]
        self.forwards += 1
        return hidden[torch.tensor(rows, device=self.device)]

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[R, V]`` of hidden states ``[R, hidden]``, row-invariantly."""
        return self.model.lm_head(hidden)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B, q]`` at ``positions`` ``[B, q]``; return ``[B, q, V]`` logits."""
        batch, q = tokens.shape
        if q > self.max_query_len:
            raise ValueError(
                f"decode of {q} tokens per row; the cache was sized for "
                f"max_query_len={self.max_query_len}"
            )
        self.forwards += 1
        # an observer (layer attribution) sees Python calls: a graph launch would skip it
        if not self.cuda_graphs or self.model.observer is not None:
            return self._decode_step(tokens, positions).view(batch, q, -1)
        graph = self._graphs.get(q) or self._capture(q)
        return graph.launch(tokens, positions).view(self._cache()[1][0], q, -1)[:batch]

    @torch.inference_mode()
    def keep(self, keep: torch.Tensor) -> None:
        """``keep`` ``[B, q]`` bool: which tokens of the last ``decode`` stay in context."""
        batch, q = keep.shape
        cursor = self.cursor[:batch]
        offsets = self._arange[:q]
        cache, (_, width) = self._cache()
        slots = (cursor[:, None] - q + offsets).clamp(0, width - 1)
        cache.valid[:batch].scatter_(1, slots, keep)
        # trailing drops are given back: the next decode writes over them
        kept_until = torch.where(keep, offsets + 1, 0).amax(dim=1)
        cursor -= q - kept_until

    def _start(self, lengths: Sequence[int], slots: int) -> None:
        """Cache rows ``0 .. len(lengths) - 1`` hold these lengths, nothing else."""
        self._allocate(len(lengths), slots)
        lens = torch.tensor(lengths, device=self.device)
        cache, (_, width) = self._cache()
        cache.valid.zero_()
        cache.valid[: len(lengths)] = self._arange[None, :width] < lens[:, None]
        self.cursor.zero_()
        self.cursor[: len(lengths)] = lens

    def _forward_sequences(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rows for whole sequences: row ``b``'s token ``i`` at slot and position ``i``."""
        tokens = torch.tensor([t for seq in ids for t in seq], device=self.device)
        cache_row = torch.cat(
            [torch.full((len(s),), b, dtype=torch.long) for b, s in enumerate(ids)]
        ).to(self.device)
        slot = torch.cat([torch.arange(len(s)) for s in ids]).to(self.device)
        return self.model.forward(
            self._cache()[0], tokens, cache_row, slot, slot, runs=[len(s) for s in ids]
        )

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B * q, V]`` logits; marks the new slots valid and advances the cursor. Capturable."""
        batch, q = tokens.shape
        cache, (_, width) = self._cache()
        slot = (self.cursor[:batch, None] + self._arange[:q]).clamp(max=width - 1)
        cache_row = self._arange[:batch, None].expand(batch, q)
        cache.valid[:batch].scatter_(1, slot, True)
        hidden = self.model.forward(
            cache, tokens.flatten(), cache_row.flatten(), slot.flatten(), positions.flatten()
        )
        self.cursor[:batch] += q
        return self.model.lm_head(hidden)[: batch * q]

    def _allocate(self, rows: int, slots: int) -> None:
        """A cache of at least ``rows`` rows and ``slots`` slots; reuse it when it fits."""
        slots = _bucket(slots)
        if self.shape is not None:
            if rows <= self.shape[0] and slots <= self.shape[1]:
                return
            rows, slots = max(rows, self.shape[0]), max(slots, self.shape[1])
        self._graphs.clear()
        self.cache = None  # free before allocating the new one
        self.cache = self.model.new_cache(rows, slots)
        self.cursor = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._arange = torch.arange(max(rows, slots), device=self.device)
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.shape = (rows, slots)

    def _cache(self) -> tuple[KVCache, tuple[int, int]]:
        """The cache and its ``(rows, slots)``; a RuntimeError before the first batch."""
        if self.cache is None or self.shape is None:
            raise RuntimeError("the deterministic backend has no cache before its first prefill")
        return self.cache, self.shape

    def _capture(self, q: int) -> StepGraph:
        # warm-up compiles the kernels; the keys it wrote sit at the cursor, where the
        # next decode writes anyway
        cache, (rows, _) = self._cache()
        self._graphs[q] = capture_step(
            self._decode_step, rows, q, (self.cursor, cache.valid), pool=self._pool
        )
        return self._graphs[q]


def _bucket(slots: int) -> int:
    """Cache slots: a power of two from 64 up to 256, then a multiple of 256 (whole key
    blocks either way)."""
    if slots <= 256:
        return max(64, 1 << (slots - 1).bit_length())
    return -(-slots // 256) * 256
