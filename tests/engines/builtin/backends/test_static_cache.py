"""The static KV cache and its attention (trace_replay.engines.builtin.backends.static_cache): per-row cursors,
slots claimed and given back, the mask built from them, and grouped-query attention that
equals plain attention over repeated kv heads."""

from __future__ import annotations

import math

import pytest
import torch

from trace_replay.engines.builtin.backends.static_cache import (
    ATTENTION,
    StaticKVCache,
    grouped_attention,
    register_attention,
)

CPU = torch.device("cpu")


def new_cache(rows: int = 3, length: int = 8) -> StaticKVCache:
    """One layer, 2 kv heads of dimension 4, float32."""
    return StaticKVCache(1, rows, 2, length, 4, torch.float32, CPU)


def forward(cache: StaticKVCache, positions: list[list[int]]) -> None:
    """What a forward does to the bookkeeping: claim slots for ``positions``, then move on."""
    cache.begin(torch.tensor(positions))
    cache.finish()


def test_begin_claims_slots_at_each_cursor():
    """begin claims slots cursor .. cursor + q - 1 per row, marks them valid and records
    their positions; finish moves every cursor past them."""
    cache = new_cache()
    forward(cache, [[0, 1], [0, 1], [5, 6]])
    cache.begin(torch.tensor([[2], [2], [7]]))
    assert cache.slots.tolist() == [[2], [2], [2]]
    assert cache.cursor.tolist() == [2, 2, 2]  # not moved before finish
    cache.finish()
    assert cache.cursor.tolist() == [3, 3, 3]
    assert cache.valid[:, :3].all() and not cache.valid[:, 3:].any()
    assert cache.slot_pos[2, :3].tolist() == [5, 6, 7]


def test_slots_past_the_end_are_clamped_to_the_last():
    """A row whose cursor reaches the end writes its last slot again, never out of bounds."""
    cache = new_cache(rows=1, length=4)
    forward(cache, [[0, 1, 2]])
    cache.begin(torch.tensor([[3, 4, 5]]))
    assert cache.slots.tolist() == [[3, 3, 3]]


def test_keep_drops_tokens_and_gives_trailing_slots_back():
    """keep marks dropped tokens invalid; a row's trailing drops give their slots back (its
    cursor returns to just after its last kept token), a middle drop keeps its slot."""
    cache = new_cache()
    forward(cache, [[0, 1], [0, 1], [0, 1]])
    forward(cache, [[2, 3, 4]] * 3)
    cache.keep(torch.tensor([[True, False, False], [True, False, True], [False, False, False]]))
    assert cache.cursor.tolist() == [3, 5, 2]
    assert cache.valid[:, 2:5].tolist() == [
        [True, False, False],
        [True, False, True],
        [False, False, False],
    ]


def test_reset_forgets_every_row():
    """reset empties the cache for a new wave: cursors at 0, no slot in context."""
    cache = new_cache()
    forward(cache, [[0, 1]] * 3)
    cache.reset()
    assert cache.cursor.tolist() == [0, 0, 0] and not cache.valid.any()


def test_layer_update_writes_at_each_rows_slots():
    """A layer's update writes ``[B, H_kv, q, D]`` keys and values at each row's claimed
    slots and returns the whole layer buffers."""
    cache = new_cache(rows=2)
    forward(cache, [[0], [0]])
    forward(cache, [[1], [1]])
    cache.keep(torch.tensor([[True], [False]]))  # row 1 writes slot 1 again
    cache.begin(torch.tensor([[2, 3], [1, 2]]))
    keys = torch.arange(2 * 2 * 2 * 4, dtype=torch.float32).view(2, 2, 2, 4)
    k, v = cache.layer(0).update(keys, -keys, 0)
    assert k is cache.keys[0] and v is cache.values[0]
    torch.testing.assert_close(k[0, :, 2:4], keys[0])
    torch.testing.assert_close(k[1, :, 1:3], keys[1])
    torch.testing.assert_close(v[1, :, 1:3], -keys[1])
    assert not k[0, :, :2].any() and not k[1, :, 3:].any()


def test_head_is_the_first_rows_and_slots_sharing_the_cache():
    """``head(rows, length)``: a wave of the first rows writes and advances through it into
    the whole cache (keys, cursors, slots in context), reads and masks only the first
    ``length`` slots, and the rows after it stay untouched."""
    cache = new_cache(rows=3)
    forward(cache, [[0], [0], [0]])
    head = cache.head(2, 3)
    assert head.shape == (2, 3) and cache.head(3) is cache and cache.head(3, 8) is cache
    head.begin(torch.tensor([[1, 2], [1, 2]]))
    assert head.mask(torch.tensor([[1, 2], [1, 2]]), None).shape == (2, 1, 2, 3)
    keys = torch.ones(2, 2, 2, 4)
    k, _ = head.layer(0).update(keys, -keys, 0)
    assert k.shape == (2, 2, 3, 4)
    head.finish()
    assert cache.cursor.tolist() == [3, 3, 1]
    assert cache.valid[:, :3].tolist() == [[True] * 3, [True] * 3, [True, False, False]]
    assert cache.keys[0][:2, :, 1:3].eq(1).all() and not cache.keys[0][2].any()
    assert cache.values[0][:2, :, 1:3].eq(-1).all() and not cache.values[0][2].any()


def allowed(cache: StaticKVCache, positions: list[list[int]], window: int | None):
    """The slots each query of the forward in progress may attend to."""
    mask = cache.mask(torch.tensor(positions), window)
    return [[torch.nonzero(row == 0).flatten().tolist() for row in query] for query in mask[:, 0]]


def test_mask_sees_valid_slots_up_to_its_own():
    """A query attends to the valid slots written at or before its own slot, and always its
    own (a left-padding query stays finite); the rest get the dtype's lowest value."""
    cache = new_cache(rows=2)
    forward(cache, [[0, 1, 2], [0, 1, 2]])
    cache.valid[1, :2] = False  # row 1: two slots of left padding
    cache.begin(torch.tensor([[3, 4], [1, 2]]))
    assert allowed(cache, [[3, 4], [1, 2]], None) == [
        [[0, 1, 2, 3], [0, 1, 2, 3, 4]],
        [[2, 3], [2, 3, 4]],
    ]
    cache.valid[1, 3] = False  # the query's own slot is always seen
    assert allowed(cache, [[3, 4], [1, 2]], None)[1][0] == [2, 3]
    mask = cache.mask(torch.tensor([[3, 4], [1, 2]]), None)
    assert mask.shape == (2, 1, 2, 8) and mask.min() == torch.finfo(torch.float32).min


def test_window_counts_positions_not_slots():
    """With a sliding window a query sees keys less than ``window`` positions back: a
    dropped draft in the middle narrows nothing (its slot is not a position)."""
    cache = new_cache(rows=1)
    forward(cache, [[0, 1, 2]])
    forward(cache, [[3, 4, 5]])
    cache.keep(torch.tensor([[True, False, True]]))  # slot 4 dropped, its slot kept
    cache.begin(torch.tensor([[5]]))  # slot 6: within 3 positions of slots 3 and 5
    assert allowed(cache, [[5]], window=3) == [[[3, 5, 6]]]
    assert allowed(cache, [[5]], window=None) == [[[0, 1, 2, 3, 5, 6]]]


def plain_attention(query, key, value, mask, scaling, softcap=None):
    """Attention of every query head over its kv head repeated, as transformers' eager does."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return (torch.softmax(scores + mask, dim=-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("q, softcap", [(1, None), (3, None), (3, 5.0)])
def test_grouped_attention_equals_attention_over_repeated_heads(q, softcap):
    """4 query heads over 2 kv heads, under an additive mask: the same output ``[B, q, H, D]``
    as attention with each kv head repeated for its query heads (soft-capped like Gemma-2
    when ``softcap`` is given); no weights are returned."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, q, 8, generator=gen)
    key, value = torch.randn(2, 2, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    mask = torch.zeros(2, 1, q, 6)
    mask[0, :, :, :2] = torch.finfo(torch.float32).min  # row 0: two padding slots
    scaling = 1 / math.sqrt(8)
    out, weights = grouped_attention(None, query, key, value, mask, scaling, softcap=softcap)
    assert weights is None and out.shape == (2, q, 4, 8)
    torch.testing.assert_close(
        out, plain_attention(query, key, value, mask, scaling, softcap), atol=1e-5, rtol=0
    )


def test_register_attention_makes_it_selectable():
    """After register_attention, transformers finds grouped_attention under ATTENTION."""
    from transformers import AttentionInterface

    register_attention()
    assert AttentionInterface()[ATTENTION] is grouped_attention
