"""Tests for trace_replay.kernels.cache_attention: the kernel against SDPA under the static
cache's own masks, and that it never reads what the mask hides from every query."""

import pytest
import torch

from trace_replay.engines.builtin.backends.static_cache import StaticKVCache, grouped_attention
from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.cache_attention import (
    MAX_QUERY_ROWS,
    cache_attention,
    cache_attention_reference,
)

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def cache_mask(
    rows: int, length: int, q: int, window: int | None, device: str, dtype: torch.dtype
) -> torch.Tensor:
    """The mask a forward of ``q`` tokens per row sees after a wave with left padding,
    rows at different cursors and a verify step whose drafts were partly dropped."""
    cache = StaticKVCache(1, rows, 1, length, 16, dtype, "cpu")
    gen = torch.Generator().manual_seed(rows * 100 + q)
    prompt = 12
    pad = torch.randint(0, prompt - 1, (rows,), generator=gen)
    cache.valid[:, :prompt] = torch.arange(prompt) >= pad[:, None]
    cache.slot_pos[:, :prompt] = (torch.arange(prompt) - pad[:, None]).clamp(min=0)
    cache.cursor.fill_(prompt)
    # a verify of 5 tokens per row, each row keeping a different number
    positions = cache.cursor[:, None] - pad[:, None] + torch.arange(5)
    cache.begin(positions)
    cache.finish()
    kept = torch.randint(0, 6, (rows,), generator=gen)
    cache.keep(torch.arange(5) < kept[:, None])
    # then rows advance by different amounts, so some reach blocks others never do
    cache.cursor += torch.randint(0, length - prompt - 5 - q, (rows,), generator=gen)
    positions = cache.cursor[:, None] - pad[:, None] + torch.arange(q)
    cache.begin(positions)
    return cache.mask(positions, window).to(device)


@pytest.mark.parametrize(
    "dtype, precision",
    [(torch.float32, "ieee"), (torch.float32, "tf32x3"), (torch.bfloat16, "ieee")],
)
@pytest.mark.parametrize(
    "groups, q, dim, length, window",
    [
        (3, 1, 64, 256, None),  # SmolLM2's heads, a decode step
        (4, 9, 128, 144, None),  # Llama-3's heads, a k = 8 verify, a length not of whole blocks
        (7, 9, 80, 64, 20),  # Qwen2's 7 groups, a head size off the power of two, a window
        (1, 1, 256, 96, None),  # Gemma's head size (32-slot blocks), no grouping
    ],
)
def test_kernel_equals_sdpa_under_cache_masks(
    device, dtype, precision, groups, q, dim, length, window
):
    """Under the masks the static cache builds (left padding, dropped drafts, cursors far
    apart, a sliding window), the kernel gives SDPA's output within rounding — float32
    within 2e-6 with float32 FMAs and with the 3xTF32 split on tensor cores."""
    gen = torch.Generator().manual_seed(groups * q + dim)
    rows, kv_heads = 3, 2
    query = torch.randn(rows, kv_heads, groups * q, dim, generator=gen).to(device, dtype)
    key, value = (
        torch.randn(rows, kv_heads, length, dim, generator=gen).to(device, dtype) for _ in range(2)
    )
    mask = cache_mask(rows, length, q, window, device, dtype)
    out = cache_attention(query, key, value, mask, dim**-0.5, precision=precision)
    expected = cache_attention_reference(
        query.float(), key.float(), value.float(), mask.float().clamp(min=-1e30), dim**-0.5
    )
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_hidden_blocks_are_never_read(device):
    """Keys and values in blocks the mask hides from every query of a row do not reach the
    output: NaN there gives the output of zeros there (SDPA would return NaN)."""
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the torch reference reads every slot")
    gen = torch.Generator().manual_seed(0)
    rows, length, dim = 2, 256, 64
    query = torch.randn(rows, 3, 3, dim, generator=gen).to(device)
    key, value = (torch.randn(rows, 3, length, dim, generator=gen).to(device) for _ in range(2))
    mask = cache_mask(rows, length, 1, None, device, torch.float32)
    visible = (mask[:, 0, 0] == 0).cpu()
    last = [int(row.nonzero().max()) for row in visible]
    assert min(last) < length - 64  # some block is hidden from a row
    poisoned_key, poisoned_value = key.clone(), value.clone()
    for row, end in enumerate(last):
        hidden_from = (end // 64 + 1) * 64  # the first block past the row's last visible slot
        poisoned_key[row, :, hidden_from:] = float("nan")
        poisoned_value[row, :, hidden_from:] = float("nan")
        key[row, :, hidden_from:] = 0
        value[row, :, hidden_from:] = 0
    out = cache_attention(query, poisoned_key, poisoned_value, mask, dim**-0.5)
    torch.testing.assert_close(
        out, cache_attention_reference(query, key, value, mask, dim**-0.5), atol=2e-6, rtol=0
    )


def test_compiled_call_is_one_operator():
    """Inside ``torch.compile(fullgraph=True)`` the kernel is one operator whose fake
    implementation gives the output's shape and dtype: no graph break, the same result."""
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 1, 4, 16, generator=gen)
    key, value = torch.randn(2, 1, 32, 16, generator=gen), torch.randn(2, 1, 32, 16, generator=gen)
    mask = cache_mask(2, 32, 2, None, "cpu", torch.float32)
    compiled = torch.compile(cache_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(
        compiled(query, key, value, mask, 0.25), cache_attention(query, key, value, mask, 0.25)
    )


def test_unknown_precision_is_refused():
    """Only float32 FMAs or the 3xTF32 split: plain TF32 would move float32 results ~1e-3."""
    query = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="precision"):
        cache_attention(query, query, query, torch.zeros(1, 1, 1, 1), 1.0, precision="tf32")


def test_too_many_query_rows_is_refused():
    """More than MAX_QUERY_ROWS query rows per kv head (a prefill) is the caller's SDPA."""
    query = torch.zeros(1, 1, MAX_QUERY_ROWS + 1, 16)
    key = torch.zeros(1, 1, 16, 16)
    with pytest.raises(ValueError, match="query rows"):
        cache_attention(query, key, key, torch.zeros(1, 1, 1, 16), 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("q", [1, 9, 40])
def test_grouped_attention_on_cuda_matches_cpu(q):
    """The static backend's attention on CUDA (the kernel up to MAX_QUERY_ROWS, SDPA past it)
    gives what it gives on CPU, ``[B, q, H, D]``."""
    gen = torch.Generator().manual_seed(q)
    query = torch.randn(3, 6, q, 64, generator=gen)
    key, value = (
        torch.randn(3, 2, 128, 64, generator=gen),
        torch.randn(3, 2, 128, 64, generator=gen),
    )
    mask = cache_mask(3, 128, q, None, "cpu", torch.float32)
    expected, _ = grouped_attention(None, query, key, value, mask, 0.125)
    out, _ = grouped_attention(None, *(t.cuda() for t in (query, key, value, mask)), 0.125)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-6, rtol=0)
