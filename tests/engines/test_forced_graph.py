"""The forced-step graph (trace_replay.engines.builtin.forced_graph): the same steps as the eager
replay loop, and a capture reused only while everything it read stays where it was."""

from __future__ import annotations

import copy

import pytest
import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.decode import replay_steps
from trace_replay.engines.builtin.forced_graph import replay_steps_captured
from trace_replay.engines.builtin.backends.hf import HFBackend
from trace_replay.engines.scoring import scorer_for
from trace_replay.engines.builtin.slots import SlotTable
from trace_replay.engines.builtin.backends.static import StaticCacheBackend

TOP_K = 3


def wave_of(lengths: list[int], seed: int) -> list[ReplayRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [ReplayRequest(f"w{seed}-{i}", tuple(torch.randint(3, 128, (3 + i,), generator=gen)
                                                .tolist()),
                          tuple(torch.randint(3, 128, (n,), generator=gen).tolist()))
            for i, n in enumerate(lengths)]


def replay_wave(backend, slots, wave, captured: bool, **kwargs):
    """Steps of one wave, through the captured loop or the plain one; tensors on the CPU."""
    idx_mapping = slots.admit(wave)
    longest = max(r.trace_len for r in wave)
    logits = backend.prefill([r.prompt_token_ids for r in wave], longest)
    score = scorer_for(logits.device)
    if captured:
        steps, counts = replay_steps_captured(backend, slots, idx_mapping, logits, longest,
                                              TOP_K, score, **kwargs)
    else:
        steps, counts = replay_steps(backend, slots, idx_mapping, logits, longest, TOP_K, score)
    return [(tuple(t.cpu() for t in scores), tokens.cpu()) for scores, tokens in steps], counts


def assert_same_steps(ours, theirs, atol=1e-6):
    assert len(ours) == len(theirs)
    for (scores, tokens), (ref_scores, ref_tokens) in zip(ours, theirs):
        assert torch.equal(tokens, ref_tokens)
        for value, ref in zip(scores, ref_scores):
            torch.testing.assert_close(value, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("lengths", [[9, 12, 5, 1], [1], [2, 2]])
def test_forced_steps_equal_the_plain_loop(tiny_llama, lengths):
    """Run eagerly (as on CPU), the buffered loop gives every step's tokens and scores as
    :func:`replay_steps` does, with one forward per step and one token per row per step."""
    wave = wave_of(lengths, seed=len(lengths))
    with torch.inference_mode():
        theirs, _ = replay_wave(HFBackend(tiny_llama, 0), SlotTable(4, torch.device("cpu")),
                                wave, captured=False)
        backend = HFBackend(tiny_llama, 0)
        ours, counts = replay_wave(backend, SlotTable(4, torch.device("cpu")), wave,
                                   captured=True, graph=False)
    assert_same_steps(ours, theirs)
    assert backend.forwards == max(lengths)
    assert torch.equal(counts, torch.ones((max(lengths), len(wave)), dtype=torch.int32))


def test_capture_is_reused_only_while_its_key_holds(tiny_llama):
    """A second wave of the same rows and similar length reuses the cached steps and is
    replayed right (its buffers restart at row 0; the trace storage, reallocated by the
    state, is copied into the steps' own); a wave of other rows or of another length bucket
    gets new steps, and so would trace storage larger than the steps' buffer."""
    slots, backend, cache = SlotTable(4, torch.device("cpu")), HFBackend(tiny_llama, 0), {}
    with torch.inference_mode():
        replay_wave(backend, slots, wave_of([9, 12, 5, 1], seed=1), True, cache=cache,
                    graph=False)
        first = cache["forced"]
        second_wave = wave_of([7, 11, 6, 3], seed=2)
        ours, _ = replay_wave(backend, slots, second_wave, True, cache=cache, graph=False)
        assert cache["forced"] is first
        assert slots.trace_state.trace_token_ids is not first.trace_tokens  # compacted
        theirs, _ = replay_wave(HFBackend(tiny_llama, 0), SlotTable(4, torch.device("cpu")),
                                second_wave, captured=False)
        assert_same_steps(ours, theirs)
        replay_wave(backend, slots, wave_of([9, 12], seed=4), True, cache=cache, graph=False)
        assert cache["forced"] is not first  # two rows, not four
        two_rows = cache["forced"]
        replay_wave(backend, slots, wave_of([40, 50], seed=5), True, cache=cache, graph=False)
        assert cache["forced"] is not two_rows  # 49 steps: a larger score buffer
    assert first.fits(slots)
    slots.trace_state.trace_token_ids = torch.zeros(2 * first.trace_tokens.numel(),
                                                    dtype=torch.int32)
    assert not first.fits(slots)  # storage larger than its own trace buffer: capture anew


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_captured_graph_equals_eager_steps(tiny_llama):
    """On CUDA, the forced steps replayed from one graph give what the same steps run
    eagerly give, for a wave, a smaller one, and the first wave again (a reused capture)."""
    lm = copy.deepcopy(tiny_llama).to("cuda")
    backend = StaticCacheBackend(lm, 0)
    assert backend.static_logits
    slots, cache = SlotTable(4, torch.device("cuda")), {}
    waves = [wave_of([9, 12, 5, 1], seed=1), wave_of([4, 2], seed=2), wave_of([9, 12, 5, 1],
                                                                              seed=1)]
    with torch.inference_mode():
        for wave in waves:
            ours, _ = replay_wave(backend, slots, wave, True, cache=cache)
            # the same compiled forward, the forced steps run op by op
            theirs, _ = replay_wave(StaticCacheBackend(lm, 0), SlotTable(4, torch.device("cuda")),
                                    wave, True, graph=False)
            assert_same_steps(ours, theirs)
