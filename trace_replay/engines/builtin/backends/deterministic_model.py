"""The model's forward as row-wise, batch-invariant arithmetic (Llama family).

:class:`DeterministicLlama` runs the transformers model's own modules and weights — embedding,
per layer RMSNorm, q/k/v, rotary, attention, o_proj, MLP, final norm, lm_head — with every
token a *row* whose bits depend on that row alone: linear layers by a GEMM whose
configuration is fixed by the weight's shape (float32 on CUDA: 3xTF32 tensor cores) or in
fixed row blocks (:mod:`~trace_replay.engines.builtin.backends.deterministic_ops`,
:mod:`~trace_replay.kernels.deterministic_linear`),
norms and attention by row-invariant kernels, rotary cos/sin from one table indexed by
position. The KV cache belongs to the caller
(:class:`~trace_replay.engines.builtin.backends.deterministic.DeterministicBackend`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, cast

import torch

from trace_replay.engines.builtin.backends.base import DETERMINISTIC_ATTENTION
from trace_replay.engines.builtin.backends.deterministic_ops import (
    RowBlocks,
    probe_linear,
    score_rows,
    silu_mul,
    tail_rows,
)
from trace_replay.engines.builtin.scoring import TokenScores
from trace_replay.kernels._triton import HAS_TRITON
from trace_replay.kernels.deterministic_attention import (
    BLOCK_N,
    attention_rows_reference,
    attention_rows_triton,
)
from trace_replay.kernels.deterministic_epilogues import (
    residual_norm_triton,
    rotary_cache_triton,
    silu_mul_triton,
    sum_parts,
)
from trace_replay.kernels.deterministic_linear import (
    group_config_3xtf32,
    linear_parts_3xtf32,
    linear_rows_3xtf32,
    linear_rows_reference,
    linear_rows_triton,
)
from trace_replay.kernels.deterministic_rms_norm import (
    rms_norm_rows_reference,
    rms_norm_rows_triton,
)
from trace_replay.kernels.deterministic_score import score_rows_triton
from trace_replay.kernels.deterministic_score import supports as triton_scores
from trace_replay.kernels.deterministic_tiled_attention import (
    BLOCK_Q,
    attention_tiles_triton,
    tile_bounds,
)

__all__ = ["DeterministicLlama", "KVCache", "RowObserver", "unsupported_reason"]

MODEL_TYPES = ("llama", "mistral", "qwen2")
_LAYER = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


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
    if (act := getattr(config, "hidden_act", "silu")) != "silu":
        return f"activation {act!r} (only silu)"
    if any(hasattr(layer.self_attn, "q_norm") for layer in lm.model.layers):
        return "q/k norms"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(lm.model.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return "position-dependent RoPE scaling"
    return None


class RowObserver(Protocol):
    """Sees the rows of every :meth:`DeterministicLlama.forward` (layer attribution's hook).

    ``begin`` gets the forward's ``cache_row`` and ``positions`` ``[R]`` (padding rows
    included, in the scratch cache row); ``site`` gets each site's ``[R, hidden]`` values in
    forward order: ``(-1, "embeddings")``, per layer ``"input_norm"``, ``"attention"`` (after
    o_proj), ``"mlp"`` and ``"residual"`` (the stream after the layer), then
    ``(num_layers, "final_norm")``.
    """

    def begin(self, cache_row: torch.Tensor, positions: torch.Tensor) -> None: ...

    def site(self, layer: int, name: str, values: torch.Tensor) -> None: ...


class KVCache:
    """One key and value per (layer, cache row, slot), and which slots are in context.

    Row ``rows`` (the last) is scratch: padding rows write and read there, nobody else.
    """

    def __init__(
        self,
        layers: int,
        rows: int,
        kv_heads: int,
        slots: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, rows + 1, kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros((rows + 1, slots), dtype=torch.bool, device=device)
        self.scratch = rows


class DeterministicLlama:
    """Batch-invariant forward of a Llama-family causal LM over rows of tokens.

    Parameters
    ----------
    lm
        A transformers causal LM for which :func:`unsupported_reason` is None.
    triton
        Norms, attention and scoring by the Triton kernels (default: on CUDA with Triton;
        scoring of a ``top_k`` above the top-k kernel's 32 in torch row blocks).
    attention
        The Triton attention: ``"tiles"`` (default), a prefill's queries a tile of one trace
        at a time (:mod:`~trace_replay.kernels.deterministic_tiled_attention`, tensor-core
        products), or ``"rows"``, one program per query row
        (:mod:`~trace_replay.kernels.deterministic_attention`). With tiles, float32
        teacher-forced prefill on an H200 takes 0.70x the default path's time (RESULTS
        "Deterministic mode"); rows took 1.37x where tiles then took 0.92x (HISTORY.md,
        2026-12-03), with the same bitwise promises (bench_determinism.py). The two round
        differently: decode and prefill must share one.
    linear
        How linear layers run: ``"3xtf32"``, the 3xTF32 tensor-core GEMM at one
        configuration per weight shape, one launch per projection (q/k/v and gate/up
        grouped: :func:`~trace_replay.kernels.deterministic_linear.linear_parts_3xtf32`; float32
        only, with ``triton``); ``"blocks"``, the GEMM library
        in fixed row blocks where :func:`probe_linear` finds it row-invariant, else the
        Triton GEMM of fixed tiles (which needs ``triton``). Default: ``"3xtf32"`` for a
        float32 model on CUDA with ``triton``, else ``"blocks"``. One launch per layer
        instead of one per block of rows is what keeps a long prefill from being bound by
        launches (RESULTS, Deterministic mode).
    """

    def __init__(
        self, lm, *, triton: bool | None = None, linear: str | None = None, attention: str = "tiles"
    ) -> None:
        reason = unsupported_reason(lm)
        if reason is not None:
            raise ValueError(f"deterministic mode does not support {type(lm).__name__}: {reason}")
        self.lm, self.model = lm, lm.model
        weight = next(lm.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        on_cuda = self.device.type == "cuda"
        self.triton = (HAS_TRITON and on_cuda) if triton is None else triton
        self.blocks = RowBlocks.for_device(self.device)
        if attention not in DETERMINISTIC_ATTENTION:
            raise ValueError(
                f"attention={attention!r}; choose one of {', '.join(DETERMINISTIC_ATTENTION)}"
            )
        self.attention = attention
        if linear is None:
            linear = (
                "3xtf32" if self.triton and on_cuda and self.dtype == torch.float32 else "blocks"
            )
        if linear not in ("3xtf32", "blocks"):
            raise ValueError(f"linear={linear!r}; choose '3xtf32' or 'blocks'")
        if linear == "3xtf32" and (not self.triton or self.dtype != torch.float32):
            raise ValueError(
                "linear='3xtf32' needs a float32 model and the Triton kernels "
                f"(got {self.dtype}, triton={self.triton})"
            )
        self.linear_kind = linear  # "3xtf32", "blocks" or, below, "triton"
        if linear == "blocks":
            linears = [m.weight for m in lm.modules() if isinstance(m, torch.nn.Linear)]
            try:
                self.blocks = replace(self.blocks, linear=probe_linear(linears, self.blocks.linear))
            except RuntimeError:
                if not self.triton:
                    raise
                self.linear_kind = "triton"  # the Triton GEMM is row-invariant by construction
        # rows of a forward are padded to this once (CUDA: GEMM blocks need no copies)
        self.row_multiple = (
            min(self.blocks.linear) if on_cuda and self.linear_kind == "blocks" else 1
        )
        config = lm.config
        attn = self.model.layers[0].self_attn
        self.num_layers = len(self.model.layers)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        # each layer's projections as the fused path launches them: members side by side
        self._projections = [
            {
                "qkv": (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                "o": (layer.self_attn.o_proj,),
                "gate_up": (layer.mlp.gate_proj, layer.mlp.up_proj),
                "down": (layer.mlp.down_proj,),
            }
            for layer in self.model.layers
        ]
        self._grouped = [
            {
                which: len(group) == 1
                or group_config_3xtf32([m.weight.shape[0] for m in group], group[0].weight.shape[1])
                is not None
                for which, group in layer.items()
            }
            for layer in self._projections
        ]
        self._biases = [
            {which: _joint_bias(group) for which, group in layer.items()}
            for layer in self._projections
        ]
        self._cos = self._sin = torch.empty(0)  # the rotary table, grown by new_cache
        self.observer: RowObserver | None = None  # see RowObserver; None costs nothing

    def describe(self) -> dict:
        """The arithmetic choices, for ``settings()`` (results depend on them)."""
        torch_rows = "torch, {} rows per call".format
        linear = {
            "3xtf32": "triton 3xtf32, one configuration per weight shape",
            "triton": "triton",
        }.get(self.linear_kind)
        return {
            "linear": linear or torch_rows(list(self.blocks.linear)),
            "norm": "triton" if self.triton else torch_rows(self.blocks.rowwise),
            "attention": (
                ("triton" if self.attention == "rows" else f"triton, tiles of {BLOCK_Q} queries")
                if self.triton
                else torch_rows(self.blocks.attention)
            ),
            "key_block": BLOCK_N,
            "score": (
                f"triton (top_k <= 32; above, {torch_rows(self.blocks.score)})"
                if self.triton
                else torch_rows(self.blocks.score)
            ),
            "row_multiple": self.row_multiple,
        }

    def new_cache(self, rows: int, slots: int) -> KVCache:
        """A cache of ``rows`` rows (plus scratch) and ``slots`` slots (a multiple of the key
        block); the rotary table grows to cover it (a position is at most its slot)."""
        if self._cos.shape[0] < slots:
            self._cos, self._sin = self._rotary_table(slots)
        return KVCache(
            self.num_layers, rows, self.num_kv_heads, slots, self.head_dim, self.dtype, self.device
        )

    def score(self, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
        """Row-invariant scoring: one Triton program per row
        (:func:`~trace_replay.kernels.deterministic_score.score_rows_triton`) with ``triton``,
        else torch ops in fixed row blocks
        (:func:`~trace_replay.engines.builtin.backends.deterministic_ops.score_rows`). Which one
        runs depends on ``top_k`` and the vocabulary alone, never on the rows, so decode
        steps and prefill chunks score a row alike."""
        if self.triton and triton_scores(logits, top_k):
            logprob, rank, top_ids, top_logprobs, entropy = score_rows_triton(
                logits, token_ids, top_k
            )
            tail = tail_rows(logits, top_ids, self.blocks.score)
            return TokenScores(logprob, rank, top_ids, top_logprobs, entropy, tail)
        return score_rows(logits, token_ids, top_k, self.blocks.score)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.lm.lm_head)

    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        cache_row: torch.Tensor,
        slot: torch.Tensor,
        positions: torch.Tensor,
        runs: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[R + padding, hidden]``; writes K/V first.

        All rows' keys of a layer are in the cache before any row of that layer attends, so
        rows of one sequence may share a call (prefill) or come one per call (decode).
        Padding rows (token 0 at position 0) sit in the scratch cache row. ``runs``, the
        lengths of consecutive rows that share a cache row (a prefill's sequences), lets
        tiled attention take them a tile at a time; without it each row is its own tile.
        It changes no bits, only how many rows a program serves.
        """
        if runs is not None and sum(runs) != tokens.shape[0]:
            raise ValueError(f"runs cover {sum(runs)} rows; the forward has {tokens.shape[0]}")
        pad = -tokens.shape[0] % self.row_multiple
        if pad:
            tokens, slot, positions = (
                torch.cat([t, t.new_zeros(pad)]) for t in (tokens, slot, positions)
            )
            cache_row = torch.cat([cache_row, cache_row.new_full((pad,), cache.scratch)])
        rows = tokens.shape[0]
        tiles = None
        if self.triton and self.attention == "tiles":
            tiles = (
                torch.arange(rows + 1, device=self.device)
                if runs is None
                else torch.tensor(tile_bounds([*runs, *[1] * pad]), device=self.device)
            )
        see = self.observer
        if see is not None:
            see.begin(cache_row, positions)
        x = self.model.embed_tokens(tokens)
        if see is not None:
            see.site(-1, "embeddings", x)
        layers = self._fused_layers if self.triton else self._torch_layers
        x = layers(x, cache, cache_row, slot, positions, tiles)
        if see is not None:
            see.site(self.num_layers, "final_norm", x)
        return x

    def _fused_layers(self, x, cache, cache_row, slot, positions, tiles) -> torch.Tensor:
        """The layers with the Triton kernels, ending in the final norm: every linear
        layer's partials read by the kernel of what follows it
        (:mod:`~trace_replay.kernels.deterministic_epilogues`), nine launches a layer in all."""
        rows, see, dtype = x.shape[0], self.observer, self.dtype
        layers = self.model.layers
        h = self._norm(x, layers[0].input_layernorm)
        for i, layer in enumerate(layers):
            parts, bias = self._parts(h, i, "qkv")
            q = rotary_cache_triton(
                parts,
                bias,
                self._cos,
                self._sin,
                positions,
                cache.k[i],
                cache.v[i],
                cache_row,
                slot,
                self.num_heads,
                dtype,
            )
            out = self._attention(q, cache.k[i], cache.v[i], cache.valid, cache_row, slot, tiles)
            if see is not None:
                see.site(i, "input_norm", h)
            parts, bias = self._parts(out.view(rows, -1), i, "o")
            if see is not None:
                see.site(i, "attention", sum_parts(parts, bias, dtype))
            x, h = self._residual_norm(parts, bias, x, layer.post_attention_layernorm)
            parts, bias = self._parts(h, i, "gate_up")
            parts, bias = self._parts(silu_mul_triton(parts, bias, dtype), i, "down")
            if see is not None:
                see.site(i, "mlp", sum_parts(parts, bias, dtype))
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = self._residual_norm(parts, bias, x, norm)
            if see is not None:
                see.site(i, "residual", x)
        return h

    def _torch_layers(self, x, cache, cache_row, slot, positions, tiles) -> torch.Tensor:
        """The layers in torch ops (the CPU path), ending in the final norm."""
        rows, see = x.shape[0], self.observer
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rotary(positions)
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._norm(x, layer.input_layernorm)
            q = _rotate(self._linear(h, attn.q_proj).view(rows, heads, dim), cos, sin)
            k = _rotate(self._linear(h, attn.k_proj).view(rows, kv_heads, dim), cos, sin)
            v = self._linear(h, attn.v_proj).view(rows, kv_heads, dim)
            cache.k[i][cache_row, :, slot] = k
            cache.v[i][cache_row, :, slot] = v
            out = self._attention(q, cache.k[i], cache.v[i], cache.valid, cache_row, slot, tiles)
            attended = self._linear(out.view(rows, heads * dim), attn.o_proj)
            if see is not None:
                see.site(i, "input_norm", h)
                see.site(i, "attention", attended)
            x = x + attended
            h = self._norm(x, layer.post_attention_layernorm)
            mixed = self._linear(
                silu_mul(self._linear(h, mlp.gate_proj), self._linear(h, mlp.up_proj)),
                mlp.down_proj,
            )
            x = x + mixed
            if see is not None:
                see.site(i, "mlp", mixed)
                see.site(i, "residual", x)
        return self._norm(x, self.model.norm)

    def _parts(
        self, x: torch.Tensor, layer: int, which: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(parts, bias)`` of a layer's projection ``which`` (``"qkv"``, ``"o"``,
        ``"gate_up"``, ``"down"``) of ``x``, members side by side: the 3xTF32 GEMM's
        unsummed partials and the members' bias (None without one) for the epilogue kernel
        to add; else each member's output, bias included, as one ``S = 1`` part."""
        modules = self._projections[layer][which]
        if self.linear_kind == "3xtf32" and self._grouped[layer][which]:
            return (linear_parts_3xtf32(x, [m.weight for m in modules]), self._biases[layer][which])
        outs = [self._linear(x, m) for m in modules]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))[None], None

    def _residual_norm(
        self, parts: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        return residual_norm_triton(parts, bias, x, cast(torch.Tensor, norm.weight), eps)

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        weight = cast(torch.Tensor, norm.weight)
        if self.triton:
            return rms_norm_rows_triton(x, weight, eps)
        return rms_norm_rows_reference(x, weight, eps, self.blocks.rowwise)

    def _linear(self, x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
        if self.linear_kind == "3xtf32":
            out = linear_rows_3xtf32(x, module.weight)
        elif self.linear_kind == "triton":
            out = linear_rows_triton(x, module.weight)
        else:
            out = linear_rows_reference(x, module.weight, self.blocks.linear)
        return out if module.bias is None else out + module.bias

    def _attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        valid: torch.Tensor,
        cache_row: torch.Tensor,
        slot: torch.Tensor,
        tiles: torch.Tensor | None,
    ) -> torch.Tensor:
        if tiles is not None:
            return attention_tiles_triton(
                q, k_cache, v_cache, valid, cache_row, slot, self.scaling, tiles
            )
        if self.triton:
            return attention_rows_triton(q, k_cache, v_cache, valid, cache_row, slot, self.scaling)
        return attention_rows_reference(
            q, k_cache, v_cache, valid, cache_row, slot, self.scaling, self.blocks.attention
        )

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


def _joint_bias(modules) -> torch.Tensor | None:
    """The members' biases side by side (zeros for a member without one), or None."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in modules]
    ).detach()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as in transformers' Llama, x ``[R, H, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
