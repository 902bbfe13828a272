"""The deterministic forward pass: every token's numbers depend on its own trace alone.

Same calls as :class:`~trace_replay.engines.hf_backend.HFBackend` (``prefill``, ``decode``,
``keep``; plus ``teacher_forced`` for the prefill engine and ``score``), computed over the
transformers model's own modules and weights, for Llama-family models.

Design contract:

* Every token is a *row*: embedding, norms, projections, rotary, attention, MLP and lm_head
  are row-wise, and each is computed so that a row's bits do not depend on the other rows
  (:mod:`~trace_replay.engines.invariant_ops`, :mod:`~trace_replay.kernels.invariant_linear`,
  :mod:`~trace_replay.kernels.invariant_attention`). Batch size, wave, padding, the other
  traces and their order therefore never reach a trace's numbers.
* A trace owns one cache row and its token at position ``p`` sits at slot ``p`` (no left
  padding), so its keys and its attention are the same in every batch. Attention visits
  its own keys from slot 0 in fixed blocks.
* Prompt prefill, a decode step and teacher forcing run the same row arithmetic, so
  decode replay and teacher-forced prefill give the same bits (``teacher_forced``).
* Rotary cos/sin come from one table indexed by position.
* On CUDA, norms and attention are Triton kernels and decode steps are captured in CUDA
  graphs per (rows, tokens per row); rows are padded to a multiple of the smallest GEMM
  block once per forward (padding rows live in a scratch cache row, never read by others).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch

from trace_replay._triton import HAS_TRITON
from trace_replay.engines.invariant_ops import RowBlocks, probe_linear, score_rows, silu_mul
from trace_replay.engines.scoring import TokenScores
from trace_replay.kernels.invariant_attention import (
    BLOCK_N, attention_rows_reference, attention_rows_triton)
from trace_replay.kernels.invariant_linear import linear_rows_reference, linear_rows_triton
from trace_replay.kernels.invariant_rms_norm import rms_norm_rows_reference, rms_norm_rows_triton

__all__ = ["InvariantBackend", "unsupported_reason"]

MODEL_TYPES = ("llama", "mistral", "qwen2")
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
          "mlp.down_proj")


def unsupported_reason(lm) -> str | None:
    """Why deterministic mode cannot run ``lm`` (None when it can)."""
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} is not Llama-family ({', '.join(MODEL_TYPES)})"
    try:
        for name in ("model.embed_tokens", "model.norm", "lm_head", "model.rotary_emb"):
            lm.get_submodule(name)
        for layer in lm.model.layers:
            for name in _LAYER:
                layer.get_submodule(name)
    except AttributeError as exc:
        return f"unexpected module layout ({exc})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    if any(hasattr(layer.self_attn, "q_norm") for layer in lm.model.layers):
        return "q/k norms"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(lm.model.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return "position-dependent RoPE scaling"
    return None


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B, q] int64, static input
    positions: torch.Tensor  # [B, q] int64, static input
    logits: torch.Tensor  # [B * q, V], static output


class InvariantBackend:
    """Batch-invariant forward over a per-trace KV cache (see the module docstring).

    Parameters
    ----------
    lm
        A Llama-family transformers causal LM (:func:`unsupported_reason` is None).
    pad_id
        Unused (rows need no padding token); kept for the backend interface.
    max_query_len
        Most tokens per row a ``decode`` will feed (``k + 1`` for verify).
    cuda_graphs
        Capture decode steps (default: on CUDA).
    triton
        Norms and attention by the Triton kernels (default: on CUDA with Triton). Linear
        layers use the GEMM library in fixed row blocks where :func:`probe_linear` finds it
        row-invariant, else the Triton GEMM (which needs ``triton``).
    """

    def __init__(self, lm, pad_id: int = 0, *, max_query_len: int = 1,
                 cuda_graphs: bool | None = None, triton: bool | None = None) -> None:
        reason = unsupported_reason(lm)
        if reason is not None:
            raise ValueError(f"deterministic mode does not support {type(lm).__name__}: {reason}")
        self.lm, self.model = lm, lm.model
        self.max_query_len = max_query_len
        weight = next(lm.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        on_cuda = self.device.type == "cuda"
        self.triton = (HAS_TRITON and on_cuda) if triton is None else triton
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.blocks = RowBlocks.for_device(self.device)
        linears = [m.weight for m in lm.modules() if isinstance(m, torch.nn.Linear)]
        self.triton_linear = False
        try:
            self.blocks = replace(self.blocks, linear=probe_linear(linears, self.blocks.linear))
        except RuntimeError:
            if not self.triton:
                raise
            self.triton_linear = True  # the Triton GEMM is row-invariant by construction
        # rows of a forward are padded to this once (CUDA: GEMM blocks need no copies)
        self.row_multiple = 1 if not on_cuda or self.triton_linear else min(self.blocks.linear)
        self.name = "invariant" + ("+cudagraph" if self.cuda_graphs else "")
        self.forwards = 0
        config = lm.config
        attn = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self._cos = self._sin = None
        self.shape: tuple[int, int] | None = None  # (rows, slots) of the allocated cache
        self._graphs: dict[int, _Graph] = {}

    def describe(self) -> dict:
        """The arithmetic choices, for ``settings()`` (results depend on them)."""
        torch_rows = "torch, {} rows per call".format
        return {"linear": "triton" if self.triton_linear else torch_rows(list(self.blocks.linear)),
                "norm": "triton" if self.triton else torch_rows(self.blocks.rowwise),
                "attention": "triton" if self.triton else torch_rows(self.blocks.attention),
                "key_block": BLOCK_N, "score": torch_rows(self.blocks.score),
                "row_multiple": self.row_multiple}

    # ---- the interface -------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
        """Start a wave: each prompt in its own cache row; ``[B, V]`` next-token logits."""
        lengths = [len(p) for p in prompts]
        self._allocate(len(prompts), max(lengths) + max_new_tokens + self.max_query_len)
        self._start_rows(lengths)
        ids = [list(p) for p in prompts]
        hidden = self._forward_sequences(ids)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        self.forwards += 1
        return self._lm_head(hidden[last])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B, q]`` at ``positions`` ``[B, q]``; return ``[B, q, V]`` logits."""
        batch, q = tokens.shape
        if q > self.max_query_len:
            raise ValueError(f"decode of {q} tokens per row; the cache was sized for "
                             f"max_query_len={self.max_query_len}")
        self.forwards += 1
        if not self.cuda_graphs:
            return self._decode_step(tokens, positions).view(batch, q, -1)
        graph = self._graphs.get(q) or self._capture(q)
        graph.tokens[:batch].copy_(tokens)
        graph.positions[:batch].copy_(positions)
        graph.graph.replay()
        return graph.logits.view(self.shape[0], q, -1)[:batch]

    @torch.inference_mode()
    def keep(self, keep: torch.Tensor) -> None:
        """``keep`` ``[B, q]`` bool: which tokens of the last ``decode`` stay in context."""
        batch, q = keep.shape
        cursor = self.cursor[:batch]
        offsets = self._arange[:q]
        slots = (cursor[:, None] - q + offsets).clamp(0, self.shape[1] - 1)
        self.valid[:batch].scatter_(1, slots, keep)
        # trailing drops are given back: the next decode writes over them
        kept_until = torch.where(keep, offsets + 1, 0).amax(dim=1)
        cursor -= q - kept_until

    @torch.inference_mode()
    def teacher_forced(self, sequences: Sequence[Sequence[int]],
                       scored: Sequence[range]) -> torch.Tensor:
        """Logits ``[sum(len(s) for s in scored), V]`` at the ``scored`` positions.

        ``sequences[i]`` is fed whole (prompt and trace but its last token); position ``p``
        of it gives the logits predicting token ``p + 1``, exactly as a decode step would.
        """
        lengths = [len(s) for s in sequences]
        self._allocate(len(sequences), max(lengths))
        self._start_rows(lengths)
        hidden = self._forward_sequences([list(s) for s in sequences])
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows = [start + p for start, positions in zip(starts, scored) for p in positions]
        self.forwards += 1
        return self._lm_head(hidden[torch.tensor(rows, device=self.device)])

    def score(self, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
        """Row-invariant scoring (:func:`~trace_replay.engines.invariant_ops.score_rows`)."""
        return score_rows(logits, token_ids, top_k, self.blocks.score)

    # ---- the forward ---------------------------------------------------------------------
    def _start_rows(self, lengths: Sequence[int]) -> None:
        """Cache rows ``0 .. len(lengths) - 1`` hold these lengths, nothing else."""
        lens = torch.tensor(lengths, device=self.device)
        self.valid.zero_()
        self.valid[: len(lengths)] = self._arange[None, : self.shape[1]] < lens[:, None]
        self.cursor.zero_()
        self.cursor[: len(lengths)] = lens

    def _forward_sequences(self, ids: list[list[int]]) -> torch.Tensor:
        """Rows for whole sequences: row ``b``'s token ``i`` at slot and position ``i``."""
        tokens = torch.tensor([t for seq in ids for t in seq], device=self.device)
        cache_row = torch.cat([torch.full((len(s),), b, dtype=torch.long)
                               for b, s in enumerate(ids)]).to(self.device)
        slot = torch.cat([torch.arange(len(s)) for s in ids]).to(self.device)
        return self._forward(tokens, cache_row, slot, slot)

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B * q, V]`` logits; marks the new slots valid and advances the cursor. Capturable."""
        batch, q = tokens.shape
        slot = (self.cursor[:batch, None] + self._arange[:q]).clamp(max=self.shape[1] - 1)
        cache_row = self._arange[:batch, None].expand(batch, q)
        self.valid[:batch].scatter_(1, slot, True)
        hidden = self._forward(tokens.flatten(), cache_row.flatten(), slot.flatten(),
                               positions.flatten())
        self.cursor[:batch] += q
        return self._lm_head(hidden)[: batch * q]

    def _forward(self, tokens: torch.Tensor, cache_row: torch.Tensor, slot: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, ``[R + padding, hidden]``; writes K/V first.

        All rows' keys of a layer are in the cache before any row of that layer attends, so
        rows of one sequence may share a call (prefill) or come one per call (decode).
        Padding rows (token 0 at position 0) sit in the scratch cache row.
        """
        pad = -tokens.shape[0] % self.row_multiple
        if pad:
            tokens, slot, positions = (torch.cat([t, t.new_zeros(pad)])
                                       for t in (tokens, slot, positions))
            cache_row = torch.cat([cache_row, cache_row.new_full((pad,), self.shape[0])])
        rows = tokens.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rotary(positions)
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._norm(x, layer.input_layernorm)
            q = _rotate(self._linear(h, attn.q_proj).view(rows, heads, dim), cos, sin)
            k = _rotate(self._linear(h, attn.k_proj).view(rows, kv_heads, dim), cos, sin)
            v = self._linear(h, attn.v_proj).view(rows, kv_heads, dim)
            self.k_cache[i][cache_row, :, slot] = k
            self.v_cache[i][cache_row, :, slot] = v
            out = self._attention(q, self.k_cache[i], self.v_cache[i], cache_row, slot)
            x = x + self._linear(out.view(rows, heads * dim), attn.o_proj)
            h = self._norm(x, layer.post_attention_layernorm)
            x = x + self._linear(silu_mul(self._linear(h, mlp.gate_proj),
                                          self._linear(h, mlp.up_proj)), mlp.down_proj)
        return self._norm(x, self.model.norm)

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        if self.triton:
            return rms_norm_rows_triton(x, norm.weight, eps)
        return rms_norm_rows_reference(x, norm.weight, eps, self.blocks.rowwise)

    def _linear(self, x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
        if self.triton_linear:
            out = linear_rows_triton(x, module.weight)
        else:
            out = linear_rows_reference(x, module.weight, self.blocks.linear)
        return out if module.bias is None else out + module.bias

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        if self.triton:
            return attention_rows_triton(q, k_cache, v_cache, self.valid, cache_row, slot,
                                         self.scaling)
        return attention_rows_reference(q, k_cache, v_cache, self.valid, cache_row, slot,
                                        self.scaling, self.blocks.attention)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.lm.lm_head)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[R, 1, D]`` looked up in the table (positions never exceed slots)."""
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def _rotary_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # each entry is inv_freq * position (one rounding) through cos/sin: the same bits
        # whatever the table's length
        rotary = self.model.rotary_emb
        inv_freq = rotary.inv_freq.float().to(self.device)
        freqs = torch.arange(length, device=self.device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        scaling = getattr(rotary, "attention_scaling", 1.0)
        return (emb.cos() * scaling).to(self.dtype), (emb.sin() * scaling).to(self.dtype)

    # ---- cache and graphs ----------------------------------------------------------------
    def _allocate(self, batch: int, length: int) -> None:
        """Cache for ``batch`` rows of at least ``length`` slots; reuse it when it fits."""
        length = _bucket(length)
        if self.shape is not None and batch <= self.shape[0] and length <= self.shape[1]:
            return
        if self.shape is not None:
            batch, length = max(batch, self.shape[0]), max(length, self.shape[1])
        self._graphs.clear()
        self.k_cache = self.v_cache = None  # free before allocating the new ones
        # one more row than asked: the scratch row of padding rows (never valid)
        shape = (len(self.model.layers), batch + 1, self.num_kv_heads, length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cursor = torch.zeros(batch + 1, dtype=torch.long, device=self.device)
        self.valid = torch.zeros((batch + 1, length), dtype=torch.bool, device=self.device)
        self._arange = torch.arange(max(batch, length), device=self.device)
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.shape = (batch, length)
        if self._cos is None or self._cos.shape[0] < length:  # a position is at most its slot
            self._cos, self._sin = self._rotary_table(length)

    def _capture(self, q: int) -> _Graph:
        rows = self.shape[0]
        tokens = torch.zeros((rows, q), dtype=torch.long, device=self.device)
        positions = torch.zeros((rows, q), dtype=torch.long, device=self.device)
        # warm-up runs the step for real (compiles the kernels): put cursor and valid back
        cursor, valid = self.cursor.clone(), self.valid.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_step(tokens, positions)
                self.cursor.copy_(cursor)
                self.valid.copy_(valid)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._decode_step(tokens, positions)
        self.cursor.copy_(cursor)
        self.valid.copy_(valid)
        self._graphs[q] = _Graph(graph, tokens, positions, logits)
        return self._graphs[q]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as in transformers' Llama, x ``[R, H, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _bucket(length: int) -> int:
    """Cache slots: a power of two from 64 up to 256, then a multiple of 256."""
    if length <= 256:
        return max(64, 1 << (length - 1).bit_length())
    return -(-length // 256) * 256
