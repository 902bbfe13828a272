"""The decode loops (trace_replay.engines.builtin.decode) on a tiny random Llama, against teacher
forcing: forced replay scores every trace token as one unpadded forward would, and free
generation emits and scores what the model's distribution says."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.decode import forced_step, generate_steps, replay_steps
from trace_replay.engines.builtin.backends.hf import HFBackend
from trace_replay.engines.results import wave_results
from trace_replay.engines.builtin.slots import SlotTable

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
        steps, counts = replay_steps(backend, slots, idx_mapping, logits, longest, TOP_K,
                                     on_step=reported.append)
    return backend, steps, counts, reported


def test_replay_scores_every_trace_token_as_teacher_forcing(replayed, tiny_requests,
                                                            assert_results_match):
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


def generated(lm, *, max_tokens: int, temperature: float = 0.0, seed: int = 0,
              eos_token_id: int | None = None,
              prompts: list[list[int]] = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """``generate_steps`` over ``prompts`` in one wave."""
    wave = [ReplayRequest(str(i), tuple(p), ()) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        backend, slots, idx_mapping, logits = start_wave(lm, wave, max_tokens)
        return generate_steps(backend, slots, idx_mapping, logits, max_tokens=max_tokens,
                              temperature=temperature,
                              generator=torch.Generator().manual_seed(seed),
                              eos_token_id=eos_token_id)


def teacher_forced(lm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float64 log-softmax ``[len(tokens), V]`` predicting each of ``tokens`` after ``prompt``."""
    with torch.inference_mode():
        logits = lm(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


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
        torch.testing.assert_close(row_lps.double(), ref[torch.arange(len(row)), row],
                                   atol=1e-4, rtol=0)
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
