"""A static KV cache with per-row write cursors, and the attention that reads it.

Plugged into a transformers model's own forward (see :mod:`trace_replay.engines.builtin.backends.static`):
every attention module of the model calls ``past_key_values.update(key, value, layer_idx)``;
here that writes the new keys of each row at its own cursor and returns the whole
``[B, H_kv, L, D]`` buffer, which :func:`grouped_attention` then reads under a mask built
once per forward from the cache's bookkeeping:

* ``valid[B, L]`` — which slots hold a token in context (left padding and dropped drafts
  are not);
* ``slot_pos[B, L]`` — the position each slot was written at (sliding windows count in
  positions, not slots, so a dropped draft never shrinks a window);
* ``cursor[B]`` — where each row writes next.

Every tensor has a fixed shape for a given (rows, length, tokens per row), so a forward is
capturable in a CUDA graph and compiles once per shape.
"""

from __future__ import annotations

import copy

import torch

from trace_replay.kernels.cache_attention import (
    MAX_QUERY_ROWS,
    cache_attention,
    cache_attention_reference,
    grouped_mask,
)

__all__ = ["ATTENTION", "LayerCache", "StaticKVCache", "grouped_attention", "register_attention"]

ATTENTION = "trace_replay_static"


def register_attention() -> None:
    """Make :func:`grouped_attention` selectable as ``config._attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, grouped_attention)


def grouped_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query [B, H, q, D]`` over the cache ``key, value [B, H_kv, L, D]``.

    The ``H / H_kv`` query heads that share a kv head are stacked as ``g * q`` query rows of
    that head, so the cache is read as it is (transformers' own sdpa path would repeat it
    ``H / H_kv`` times whenever a mask is given). ``attention_mask`` is additive,
    ``[B, 1, q, L]``. On CUDA, decode steps and verify forwards (``H / H_kv * q`` up to
    :data:`~trace_replay.kernels.cache_attention.MAX_QUERY_ROWS`) run
    :func:`~trace_replay.kernels.cache_attention.cache_attention`, which reads only the
    cache blocks some query can see; wider forwards and CPU run SDPA. With ``softcap``
    (Gemma-2) the scores are computed as transformers' eager attention does: scale,
    ``tanh`` soft-cap, mask, float32 softmax. A ``module`` with ``float32_dots = "tf32x3"``
    (set by the static backend's ``float32_matmul``) has the kernel take float32 products
    on tensor cores with the 3xTF32 split.

    Returns ``[B, q, H, D]`` and no weights, as transformers' attention functions do.
    """
    batch, heads, q, dim = query.shape
    groups = heads // key.shape[1]
    query = query.reshape(batch, key.shape[1], groups * q, dim)
    scale = dim**-0.5 if scaling is None else scaling
    if softcap is None:
        if query.is_cuda and groups * q <= MAX_QUERY_ROWS:
            out = cache_attention(
                query,
                key,
                value,
                attention_mask,
                scale,
                precision=getattr(module, "float32_dots", "ieee"),
            )
        else:
            out = cache_attention_reference(query, key, value, attention_mask, scale)
    else:
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap + grouped_mask(attention_mask, groups)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, value)
    # rows g * q + i of kv head h are query head h * g + (row // q), position row % q
    return out.reshape(batch, heads, q, dim).transpose(1, 2), None


class LayerCache:
    """One layer's view of :class:`StaticKVCache`: what an attention module's ``update`` sees."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.keys, self.values, self.rows, self.slots = keys, values, rows, slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H_kv, q, D]`` at each row's slots; return the whole layer cache."""
        self.keys[self.rows, :, self.slots] = key_states.transpose(1, 2)
        self.values[self.rows, :, self.slots] = value_states.transpose(1, 2)
        return self.keys, self.values


class StaticKVCache:
    """Keys and values of ``rows`` sequences in ``length`` slots, per layer.

    Design contract: ``begin`` (before a forward of ``q`` tokens per row) claims slots
    ``cursor + i``, marks them valid and records their positions; ``finish`` moves the
    cursor past them; ``keep`` takes back dropped tokens (they leave ``valid``; trailing
    ones give their slots back to the next forward). Slots past the end are clamped to
    the last one, which the caller's sizing keeps unused.
    """

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (rows, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.cursor = torch.zeros(rows, dtype=torch.long, device=device)
        self.valid = torch.zeros((rows, length), dtype=torch.bool, device=device)
        self.slot_pos = torch.zeros((rows, length), dtype=torch.long, device=device)
        self.rows = torch.arange(rows, device=device)[:, None]
        self.arange = torch.arange(length, device=device)
        self.shape = (rows, length)
        self.dtype = dtype
        self.slots = self.rows  # [rows, q] of the forward in progress, set by begin()

    def head(self, rows: int, length: int | None = None) -> StaticKVCache:
        """The first ``rows`` rows and ``length`` slots (default: all) as a cache of their
        own, sharing this one's tensors: what a wave of ``rows`` sequences reads and writes,
        without computing the other rows, and with ``length`` at least every cursor plus
        the tokens of the next forward, without reading slots no row has reached."""
        length = self.shape[1] if length is None else length
        if (rows, length) == self.shape:
            return self
        view = copy.copy(self)
        view.keys = [keys[:rows, :, :length] for keys in self.keys]
        view.values = [values[:rows, :, :length] for values in self.values]
        view.cursor, view.rows = self.cursor[:rows], self.rows[:rows]
        view.valid, view.slot_pos = self.valid[:rows, :length], self.slot_pos[:rows, :length]
        view.arange, view.shape, view.slots = self.arange[:length], (rows, length), view.rows
        return view

    def row(self, index: int, length: int) -> StaticKVCache:
        """Row ``index`` and its first ``length`` slots as a cache of their own (sharing this
        one's tensors): what a prompt of ``length`` tokens, run alone, writes and reads."""
        view = self.head(self.shape[0], length)
        if view is self:
            view = copy.copy(self)
        rows = slice(index, index + 1)
        view.keys = [keys[rows] for keys in view.keys]
        view.values = [values[rows] for values in view.values]
        view.cursor, view.rows = view.cursor[rows], self.rows[:1]
        view.valid, view.slot_pos = view.valid[rows], view.slot_pos[rows]
        view.shape, view.slots = (1, length), view.rows
        return view

    def reset(self) -> None:
        """Forget every row's context (a new wave)."""
        self.cursor.zero_()
        self.valid.zero_()

    def begin(self, positions: torch.Tensor) -> None:
        """Claim ``q`` slots per row for tokens at ``positions [rows, q]``."""
        q = positions.shape[1]
        self.slots = (self.cursor[:, None] + self.arange[:q]).clamp(max=self.shape[1] - 1)
        self.valid.scatter_(1, self.slots, True)
        self.slot_pos.scatter_(1, self.slots, positions)

    def finish(self) -> None:
        """Move every cursor past the slots claimed by ``begin``."""
        self.cursor += self.slots.shape[1]

    def layer(self, index: int) -> LayerCache:
        """What layer ``index``'s attention writes to and reads from."""
        return LayerCache(self.keys[index], self.values[index], self.rows, self.slots)

    def mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Additive ``[rows, 1, q, L]`` mask for the tokens of the forward in progress.

        A query sees valid slots written at or before its own and always its own slot (so
        a left-padding query stays finite); with ``window`` only keys less than ``window``
        positions back, as transformers' sliding-window masks do.
        """
        keys, own = self.arange[None, None, :], self.slots[:, :, None]
        allowed = self.valid[:, None, :] & (keys <= own)
        if window is not None:
            allowed &= positions[:, :, None] - self.slot_pos[:, None, :] < window
        allowed |= keys == own
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[:, None]

    def keep(self, keep: torch.Tensor) -> None:
        """``keep [B, q]`` bool: which tokens of the last forward stay in context."""
        batch, q = keep.shape
        cursor = self.cursor[:batch]
        offsets = self.arange[:q]
        slots = (cursor[:, None] - q + offsets).clamp(0, self.shape[1] - 1)
        self.valid[:batch].scatter_(1, slots, keep)
        # trailing drops are given back: the next forward writes over them
        kept_until = torch.where(keep, offsets + 1, 0).amax(dim=1)
        cursor -= q - kept_until
