"""A static-KV-cache forward pass for Llama-family models, CUDA-graph captured on GPU.

The same three calls as :class:`~trace_replay.engines.hf_backend.HFBackend` (``prefill``,
``decode``, ``keep``), computed by a forward of its own over the transformers model's modules
and weights in place: embedding, per layer RMSNorm → q/k/v → rotary (cos/sin from the model's
own ``rotary_emb``) → attention over a static cache (GQA) → o_proj → MLP, final norm, lm_head.

Every tensor a decode step touches has a fixed shape, so on CUDA a step is captured once per
(batch, cache length, tokens per row) and replayed: one launch instead of ~1,000, and no host
synchronization anywhere in ``decode`` or ``keep``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["StaticLlamaBackend", "supports"]

MODEL_TYPES = ("llama", "mistral", "qwen2")
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "input_layernorm", "post_attention_layernorm",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MODEL_MODULES = ("model.norm", "lm_head", "model.embed_tokens", "model.rotary_emb")
# these rope types recompute inv_freq from the positions seen (data-dependent, host-synced)
_DYNAMIC_ROPE = ("dynamic", "longrope")


def supports(lm) -> bool:
    """Whether :class:`StaticLlamaBackend` computes exactly what ``lm``'s own forward does.

    True for Llama-family causal LMs (``config.model_type`` in ``MODEL_TYPES``) whose modules
    have LlamaDecoderLayer's structure, no q/k norms, no sliding window and a static RoPE.
    """
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return False
    try:
        layers = lm.model.layers
        for name in _MODEL_MODULES:
            lm.get_submodule(name)
        for layer in layers:
            for name in _LAYER_MODULES:
                layer.get_submodule(name)
    except AttributeError:
        return False
    if len(layers) == 0 or any(hasattr(layer.self_attn, "q_norm") for layer in layers):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return getattr(lm.model.rotary_emb, "rope_type", "default") not in _DYNAMIC_ROPE


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B, q] int64, static input
    positions: torch.Tensor  # [B, q] int64, static input
    logits: torch.Tensor  # [B, q, V], static output


class StaticLlamaBackend:
    """Llama-family forward over a static KV cache; CUDA graphs for decode on GPU.

    Design contract:

    * The cache is ``[num_layers, B, H_kv, L, D]`` with a per-row write cursor ``[B]`` and a
      valid-key mask ``[B, L]``, all on the device. ``decode`` writes its ``q`` keys at
      ``cursor + i``; ``keep`` clears the dropped ones and moves the cursor back over trailing
      drops (the next decode overwrites them). Positions come from the caller (rotary uses
      them) and are independent of cache slots.
    * ``L`` is bucketed (powers of two to 256, then multiples of 256) and a wave no larger
      than the allocated batch reuses cache and graphs (its rows are padded), so a run of
      waves captures once.
    * ``decode`` returns a view of the graph's static output: valid until the next ``decode``.

    Parameters
    ----------
    lm
        A transformers causal LM for which :func:`supports` is true.
    pad_id
        Token fed at left padding.
    max_query_len
        Most tokens per row a ``decode`` will feed (``k + 1`` for verify); sizes the slack.
    cuda_graphs
        Capture decode steps (default: on CUDA).
    """

    def __init__(self, lm, pad_id: int, *, max_query_len: int = 1,
                 cuda_graphs: bool | None = None) -> None:
        if not supports(lm):
            raise ValueError(f"{type(lm).__name__} is not a supported Llama-family model")
        self.lm = lm
        self.pad_id = pad_id
        self.max_query_len = max_query_len
        self.device = next(lm.parameters()).device
        self.dtype = next(lm.parameters()).dtype
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.name = "static+cudagraph" if self.cuda_graphs else "static"
        self.forwards = 0
        config = lm.config
        attn = lm.model.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.shape: tuple[int, int] | None = None  # (B, L) of the allocated cache
        self._graphs: dict[int, _Graph] = {}
        self._pool = None

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
        """Start a wave: left-pad ``prompts``, run them, return ``[B, V]`` next-token logits."""
        batch, width = len(prompts), max(len(p) for p in prompts)
        self._allocate(batch, width + max_new_tokens + self.max_query_len)
        rows = self.shape[0]
        tokens = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = True
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        self.valid.zero_()
        self.valid[:, :width] = mask
        self.cursor.zero_()
        hidden = self._forward(tokens, positions)
        self.forwards += 1
        return self.lm.lm_head(hidden[:batch, -1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B, q]`` at ``positions`` ``[B, q]``; return ``[B, q, V]`` logits."""
        batch, q = tokens.shape
        if q > self.max_query_len:
            raise ValueError(f"decode of {q} tokens per row; the cache was sized for "
                             f"max_query_len={self.max_query_len}")
        self.forwards += 1
        if not self.cuda_graphs:
            rows = self.shape[0]
            if batch < rows:
                tokens = torch.cat([tokens, tokens.new_full((rows - batch, q), self.pad_id)])
                positions = torch.cat([positions, positions.new_zeros((rows - batch, q))])
            return self._decode_step(tokens, positions)[:batch]
        graph = self._graphs.get(q) or self._capture(q)
        graph.tokens[:batch].copy_(tokens)
        graph.positions[:batch].copy_(positions)
        graph.graph.replay()
        return graph.logits[:batch]

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

    def _allocate(self, batch: int, length: int) -> None:
        """Cache for ``batch`` rows of ``length`` slots; reuse the current one when it fits."""
        length = _bucket(length)
        if self.shape is not None and self.shape[1] == length and batch <= self.shape[0]:
            return
        self._graphs.clear()
        self.k_cache = self.v_cache = None  # free before allocating the new ones
        shape = (len(self.lm.model.layers), batch, self.num_kv_heads, length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cursor = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.valid = torch.zeros((batch, length), dtype=torch.bool, device=self.device)
        self._arange = torch.arange(length, device=self.device)
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.shape = (batch, length)

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Full-batch decode: mark the new slots valid, run, advance the cursor. Capturable."""
        slots = (self.cursor[:, None] + self._arange[: tokens.shape[1]]).clamp(
            max=self.shape[1] - 1)
        self.valid.scatter_(1, slots, True)
        return self.lm.lm_head(self._forward(tokens, positions))

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, q, hidden]`` after the final norm; writes the cache at the cursor.

        A query attends to valid keys at or before its own slot, and always to its own slot
        (left padding stays finite; no row is fully masked).
        """
        model = self.lm.model
        batch, q = tokens.shape
        groups, length = self.num_heads // self.num_kv_heads, self.shape[1]
        slots = (self.cursor[:, None] + self._arange[:q]).clamp(max=length - 1)  # [B, q]
        keys, own = self._arange[None, None, :], slots[:, :, None]
        allowed = (self.valid[:, None, :] & (keys <= own)) | (keys == own)
        # queries of one kv head are grouped as rows g * q + i, so the mask repeats per group
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~allowed, float("-inf"))[:, None, None]
        mask = mask.expand(batch, 1, groups, q, length).reshape(batch, 1, groups * q, length)
        kv_index = slots[:, None, :, None].expand(batch, self.num_kv_heads, q, self.head_dim)

        x = model.embed_tokens(tokens)
        cos, sin = model.rotary_emb(x, positions)  # [B, q, D]
        cos, sin = cos[:, :, None], _signed_sin(sin)[:, :, None]
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            qs = _rotary(attn.q_proj(h).view(batch, q, self.num_heads, self.head_dim), cos, sin)
            ks = _rotary(attn.k_proj(h).view(batch, q, self.num_kv_heads, self.head_dim), cos, sin)
            vs = attn.v_proj(h).view(batch, q, self.num_kv_heads, self.head_dim)
            self.k_cache[i].scatter_(2, kv_index, ks.transpose(1, 2))
            self.v_cache[i].scatter_(2, kv_index, vs.transpose(1, 2))
            qs = qs.view(batch, q, self.num_kv_heads, groups, self.head_dim).permute(0, 2, 3, 1, 4)
            out = F.scaled_dot_product_attention(
                qs.reshape(batch, self.num_kv_heads, groups * q, self.head_dim),
                self.k_cache[i], self.v_cache[i], attn_mask=mask, scale=self.scaling)
            out = out.view(batch, self.num_kv_heads, groups, q, self.head_dim)
            out = out.permute(0, 3, 1, 2, 4).reshape(batch, q, self.num_heads * self.head_dim)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(_rms_norm(x, layer.post_attention_layernorm))
        self.cursor += q
        return _rms_norm(x, model.norm)

    def _capture(self, q: int) -> _Graph:
        rows = self.shape[0]
        tokens = torch.full((rows, q), self.pad_id, dtype=torch.long, device=self.device)
        positions = torch.zeros((rows, q), dtype=torch.long, device=self.device)
        # warm-up runs the step for real: put cursor and valid back afterwards (the keys it
        # wrote sit past every cursor, where the next decode writes anyway)
        cursor, valid = self.cursor.clone(), self.valid.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_step(tokens, positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.cursor.copy_(cursor)
        self.valid.copy_(valid)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._decode_step(tokens, positions)
        self._graphs[q] = _Graph(graph, tokens, positions, logits)
        return self._graphs[q]


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """LlamaRMSNorm: float32 statistics, cast back, then the weight (in the model dtype)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == swap_halves(x) * this``."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, x ``[B, q, H, D]``; ``signed_sin`` has the sign."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


def _bucket(length: int) -> int:
    """Cache length: a power of two from 16 up to 256, then a multiple of 256."""
    if length <= 256:
        return max(16, 1 << (length - 1).bit_length())
    return -(-length // 256) * 256
