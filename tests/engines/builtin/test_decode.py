"""The replay loop and free generation (trace_replay.engines.builtin.decode) on a tiny random
Llama, against teacher forcing: forced replay scores every trace token as one unpadded forward
would, its steps (eager, or captured in one CUDA graph) are those of forced_step taken one by
one, a cached capture is reused only while everything it read stays where it was, and free
generation emits and scores what the model's distribution says."""

from __future__ import annotations

import copy

import pytest
import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.backends.hf import HFBackend
from trace_replay.engines.builtin.backends.static import StaticCacheBackend
from trace_replay.engines.builtin.decode import (
    ForcedSteps,
    SlotTable,
    forced_step,
    generate_steps,
    replay_steps,
)
from trace_replay.engines.builtin.scoring import scorer_for, wave_results

TOP_K = 3
CPU = torch.device("cpu")
PROMPTS = [[50, 35, 28, 46], [1], [95, 30, 21]]


def start_wave(lm, wave: list[ReplayRequest], max_new_tokens: int):
    """Admit ``wave`` and prefill it: (backend, slots, idx_mapping, first logits)."""
    backend, slots = HFBackend(lm, 0), SlotTable(len(wave), CPU)
    idx_mapping = slots.admit(wave)
    logits = backend.prefill([r.prompt_token_ids for r in wave], max_new_tokens)
    return backend, slots, idx_mapping, logits


@pytest.fixture(scope="module")
def replayed(tiny_llama, tiny_requests):
    """Step-by-step replay of every tiny request in one wave: (backend, steps, counts, steps
    reported by on_step)."""
    longest = max(r.trace_len for r in tiny_requests)
    reported = []
    with torch.inference_mode():
        backend, slots, idx_mapping, logits = start_wave(tiny_llama, tiny_requests, longest)
        steps, counts = replay_steps(
            backend, slots, idx_mapping, logits, longest, TOP_K, on_step=reported.append
        )
    return backend, steps, counts, reported


def test_replay_scores_every_trace_token_as_teacher_forcing(
    replayed, tiny_requests, assert_results_match
):
    """Batched, left-padded replay emits exactly each trace, with the logprob, rank and top-k
    of a float64 teacher-forced forward over that trace alone."""
    _, steps, counts, _ = replayed
    results = wave_results(tiny_requests, steps, counts)
    for result, request in zip(results, tiny_requests):
        assert result.token_ids.tolist() == list(request.trace_token_ids)
    assert_results_match(results)


def test_replay_runs_one_forward_per_step(replayed, tiny_requests):
    """num_steps steps take one prefill and num_steps - 1 decodes, commit one token per row
    each ([num_steps, B] ones) and report every step to on_step in order."""
    backend, steps, counts, reported = replayed
    longest = max(r.trace_len for r in tiny_requests)
    assert len(steps) == longest and backend.forwards == longest
    assert torch.equal(counts, torch.ones((longest, len(tiny_requests)), dtype=torch.int32))
    assert reported == list(range(longest))


def test_forced_step_scores_the_unmodified_logits():
    """A forced step emits the trace token, not the argmax, scores it under the logits as
    given, and commits one token per row."""
    wave = [ReplayRequest("a", (1, 2), (7, 8)), ReplayRequest("b", (3,), (5,))]
    slots = SlotTable(2, CPU)
    idx_mapping = slots.admit(wave)
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    logits[:, 0] = 10.0  # the argmax, which neither trace has
    sampled, scores = forced_step(logits, slots, idx_mapping, TOP_K)
    assert sampled.tolist() == [7, 5]
    expected = torch.log_softmax(logits.double(), -1)[[0, 1], [7, 5]]
    torch.testing.assert_close(scores.logprob.double(), expected, atol=1e-6, rtol=0)
    assert (scores.rank >= 2).all()
    assert scores.top_token_ids[:, 0].tolist() == [0, 0]
    assert slots.steps_done(idx_mapping).tolist() == [1, 1]


def wave_of(lengths: list[int], seed: int, prompt_len: int = 3) -> list[ReplayRequest]:
    """Random requests with traces of ``lengths`` and prompts of ``prompt_len + i`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [
        ReplayRequest(
            f"w{seed}-{i}",
            tuple(torch.randint(3, 128, (prompt_len + i,), generator=gen).tolist()),
            tuple(torch.randint(3, 128, (n,), generator=gen).tolist()),
        )
        for i, n in enumerate(lengths)
    ]


def host_steps(steps):
    return [(tuple(t.cpu() for t in scores), tokens.cpu()) for scores, tokens in steps]


def replay_wave(backend, slots, wave, **kwargs):
    """:func:`replay_steps` over one wave: (steps on the CPU, counts)."""
    idx_mapping = slots.admit(wave)
    longest = max(r.trace_len for r in wave)
    logits = backend.prefill([r.prompt_token_ids for r in wave], longest)
    steps, counts = replay_steps(
        backend, slots, idx_mapping, logits, longest, TOP_K, scorer_for(logits.device), **kwargs
    )
    return host_steps(steps), counts


def step_by_step(backend, slots, wave):
    """The reference: :func:`forced_step` on each forward's logits, one decode per step."""
    idx_mapping = slots.admit(wave)
    longest = max(r.trace_len for r in wave)
    logits = backend.prefill([r.prompt_token_ids for r in wave], longest)
    steps = []
    for step in range(longest):
        sampled, scores = forced_step(logits, slots, idx_mapping, TOP_K, scorer_for(logits.device))
        steps.append((scores, sampled))
        positions = (slots.total_len(idx_mapping) - 1)[:, None]
        if step < longest - 1:
            logits = backend.decode(sampled[:, None], positions)[:, -1]
    return host_steps(steps)


def assert_same_steps(ours, theirs, atol=1e-6):
    assert len(ours) == len(theirs)
    for (scores, tokens), (ref_scores, ref_tokens) in zip(ours, theirs):
        assert torch.equal(tokens, ref_tokens)
        for value, ref in zip(scores, ref_scores):
            torch.testing.assert_close(value, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("lengths", [[9, 12, 5, 1], [1], [2, 2]])
def test_buffered_steps_equal_forced_steps_one_by_one(tiny_llama, lengths):
    """The loop's buffered steps (run eagerly, as on CPU) give every step's tokens and scores
    as forced_step does on each forward's logits, with one forward per step and one token per
    row per step."""
    wave = wave_of(lengths, seed=len(lengths))
    with torch.inference_mode():
        theirs = step_by_step(HFBackend(tiny_llama, 0), SlotTable(4, CPU), wave)
        backend = HFBackend(tiny_llama, 0)
        ours, counts = replay_wave(backend, SlotTable(4, CPU), wave)
    assert_same_steps(ours, theirs)
    assert backend.forwards == max(lengths)
    assert torch.equal(counts, torch.ones((max(lengths), len(wave)), dtype=torch.int32))


def test_cached_steps_are_reused_only_while_their_key_holds(tiny_llama):
    """A second wave of the same rows and similar length reuses the cached steps and is
    replayed right (its buffers restart at row 0; the trace storage, reallocated by the
    state, is copied into the steps' own); a wave of other rows or of another length bucket
    gets new steps, and so would trace storage larger than the steps' buffer."""
    slots, backend, cache = SlotTable(4, CPU), HFBackend(tiny_llama, 0), {}
    with torch.inference_mode():
        replay_wave(backend, slots, wave_of([9, 12, 5, 1], seed=1), cache=cache)
        first = cache["forced"]
        second_wave = wave_of([7, 11, 6, 3], seed=2)
        ours, _ = replay_wave(backend, slots, second_wave, cache=cache)
        assert cache["forced"] is first
        assert slots.trace_state.trace_token_ids is not first.trace_tokens  # compacted
        theirs, _ = replay_wave(HFBackend(tiny_llama, 0), SlotTable(4, CPU), second_wave)
        assert_same_steps(ours, theirs)
        replay_wave(backend, slots, wave_of([9, 12], seed=4), cache=cache)
        assert cache["forced"] is not first  # two rows, not four
        two_rows = cache["forced"]
        replay_wave(backend, slots, wave_of([40, 50], seed=5), cache=cache)
        assert cache["forced"] is not two_rows  # 50 steps: a larger score buffer
    assert first.fits(slots)
    slots.trace_state.trace_token_ids = torch.zeros(
        2 * first.trace_tokens.numel(), dtype=torch.int32
    )
    assert not first.fits(slots)  # storage larger than its own trace buffer: capture anew


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_captured_graph_equals_eager_steps(tiny_llama, monkeypatch):
    """On CUDA, the forced steps replayed from one graph give what the same steps run
    eagerly give, for a wave, a smaller one, the first wave again (a new capture of the first
    key), a wave of longer prompts (the backend's cache, so its logits, moved: forward 0
    replays the cached capture on its own memory, forward 1 captures anew) and that wave's
    like (every step replayed: none runs eagerly, forward 0 included)."""
    lm = copy.deepcopy(tiny_llama).to("cuda")
    backend = StaticCacheBackend(lm, 0)
    assert backend.static_logits
    slots, cache = SlotTable(4, torch.device("cuda")), {}
    waves = [
        wave_of([9, 12, 5, 1], seed=1),
        wave_of([4, 2], seed=2),
        wave_of([9, 12, 5, 1], seed=1),
        wave_of([9, 12, 5, 1], seed=3, prompt_len=60),
        wave_of([11, 3, 12, 7], seed=4, prompt_len=60),
    ]
    eager = []  # steps run by ForcedSteps._step (eagerly, or while capturing)
    step = ForcedSteps._step
    monkeypatch.setattr(
        ForcedSteps, "_step", lambda self, logits: (eager.append(1), step(self, logits))[1]
    )
    with torch.inference_mode():
        for i, wave in enumerate(waves):
            eager.clear()
            ours, _ = replay_wave(backend, slots, wave, cache=cache, graph=True)
            assert (len(eager) == 0) == (i == 4), (i, len(eager))
            if i == 2:
                reused, logits = cache["forced"], cache["forced"]._logits
            # the same compiled forward, the forced steps run op by op
            theirs, _ = replay_wave(
                StaticCacheBackend(lm, 0), SlotTable(4, torch.device("cuda")), wave
            )
            assert_same_steps(ours, theirs)
    assert cache["forced"] is reused and cache["forced"]._logits is not logits


def generated(
    lm,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    prompts: list[list[int]] = PROMPTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``generate_steps`` over ``prompts`` in one wave."""
    wave = [ReplayRequest(str(i), tuple(p), ()) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        backend, slots, idx_mapping, logits = start_wave(lm, wave, max_tokens)
        return generate_steps(
            backend,
            slots,
            idx_mapping,
            logits,
            max_tokens=max_tokens,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
            eos_token_id=eos_token_id,
        )


def teacher_forced(lm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float64 log-softmax ``[len(tokens), V]`` predicting each of ``tokens`` after ``prompt``."""
    with torch.inference_mode():
        logits = lm(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def test_greedy_generation_follows_the_argmax(tiny_llama):
    """At temperature 0 each row emits its argmax continuation (up to near-ties) and each
    logprob is that token's under the teacher-forced distribution."""
    tokens, logprobs = generated(tiny_llama, max_tokens=6)
    assert tokens.shape == logprobs.shape == (len(PROMPTS), 6)
    for prompt, row, row_lps in zip(PROMPTS, tokens.tolist(), logprobs):
        ref = teacher_forced(tiny_llama, prompt, row)
        chosen = ref[torch.arange(len(row)), row]
        assert (chosen >= ref.max(dim=1).values - 1e-5).all()
        torch.testing.assert_close(row_lps.double(), chosen, atol=1e-4, rtol=0)


def test_sampling_reports_raw_logprobs_and_follows_the_seed(tiny_llama):
    """With temperature > 0 the logprobs are the sampled tokens' under the untempered
    distribution; one seed gives the same tokens again (same machine, same ops)."""
    tokens, logprobs = generated(tiny_llama, max_tokens=6, temperature=1.5, seed=3)
    for prompt, row, row_lps in zip(PROMPTS, tokens.tolist(), logprobs):
        ref = teacher_forced(tiny_llama, prompt, row)
        torch.testing.assert_close(
            row_lps.double(), ref[torch.arange(len(row)), row], atol=1e-4, rtol=0
        )
    again, _ = generated(tiny_llama, max_tokens=6, temperature=1.5, seed=3)
    assert torch.equal(tokens, again)


def test_generation_stops_at_the_check_after_every_row_emitted_eos(tiny_llama):
    """With an EOS id, generation runs on until the first 16-step check at which every row
    has emitted it (else to max_tokens); the tokens are those of the run without EOS."""
    # runs compared token for token have the same batch (same arithmetic, same process)
    free_alone, _ = generated(tiny_llama, max_tokens=40, prompts=PROMPTS[:1])
    eos = free_alone[0, 0].item()
    alone, _ = generated(tiny_llama, max_tokens=40, eos_token_id=eos, prompts=PROMPTS[:1])
    assert torch.equal(alone, free_alone[:, :16])  # done at step 0: stopped at the first check
    free, _ = generated(tiny_llama, max_tokens=40)
    firsts = [row.index(eos) if eos in row else None for row in free.tolist()]
    expected = 40 if None in firsts else min(40, (max(firsts) // 16 + 1) * 16)
    tokens, _ = generated(tiny_llama, max_tokens=40, eos_token_id=eos)
    assert torch.equal(tokens, free[:, :expected])
