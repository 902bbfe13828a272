"""The prefill engine: teacher-forced scores, with the lm_head run in bounded chunks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from trace_replay.engines import make_engine
from trace_replay.runs.replay import replay

pytestmark = pytest.mark.slow


def test_lm_head_runs_in_bounded_chunks(lm, real_traces, assert_matches_reference):
    """Full-vocabulary logits exist for at most one chunk of positions, and scores stay exact."""
    engine = make_engine("prefill", lm, batch_size=6, top_k=3)
    vocab = lm.get_output_embeddings().weight.shape[0]
    engine.score_chunk_bytes = 4 * vocab * 20  # 4 positions a chunk
    rows_seen = []
    hook = lm.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows_seen.append(out.shape[:-1].numel())
    )
    try:
        df = replay(real_traces, engine=engine, progress=False)
    finally:
        hook.remove()
    assert len(df) == sum(len(t.trace_token_ids) for t in real_traces)
    assert max(rows_seen) <= 4
    assert sum(rows_seen) == len(df)  # no logits for prompt or padding positions
    assert_matches_reference(df)


def test_deterministic_scoring_runs_in_bounded_chunks_with_the_same_bits(
    lm, real_traces, assert_frames_bitwise_equal
):
    """Deterministic mode: logits exist for at most one chunk of whole scoring blocks, and
    chunking changes no bit (head and scoring are row-invariant)."""
    engine = make_engine("prefill", lm, batch_size=6, top_k=3, deterministic=True)
    head, rows_seen = engine.backend.lm_head, []
    engine.backend.lm_head = lambda hidden: rows_seen.append(len(hidden)) or head(hidden)
    engine.score_chunk_bytes = 2**62  # one chunk: the whole batch's logits at once
    whole = replay(real_traces, engine=engine, progress=False)
    assert rows_seen == [len(whole)]
    rows_seen.clear()
    engine.score_chunk_bytes = 1  # the smallest chunk: one scoring block
    chunked = replay(real_traces, engine=engine, progress=False)
    block = engine.backend.model.blocks.score
    assert max(rows_seen) == block and len(rows_seen) == -(-len(chunked) // block)
    assert_frames_bitwise_equal(chunked, whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_chunks_of_every_size_score_as_on_cpu(tiny_llama, tiny_requests):
    """On CUDA the prefill engine's chunks — full ones and each batch's shorter last one —
    share one dynamic-shape scoring graph and give the CPU engine's scores."""
    cpu = make_engine("prefill", tiny_llama, batch_size=2, top_k=3)
    gpu = make_engine("prefill", copy.deepcopy(tiny_llama).to("cuda"), batch_size=2, top_k=3)
    vocab = tiny_llama.config.vocab_size
    cpu.score_chunk_bytes = gpu.score_chunk_bytes = 3 * vocab * 20  # 3 positions a chunk
    for ours, theirs in zip(gpu.run(tiny_requests), cpu.run(tiny_requests)):
        np.testing.assert_array_equal(ours.token_ids, theirs.token_ids)
        np.testing.assert_allclose(ours.logprob, theirs.logprob, atol=1e-4)
        np.testing.assert_allclose(ours.top_logprobs, theirs.top_logprobs, atol=1e-4)
        np.testing.assert_allclose(ours.entropy, theirs.entropy, atol=1e-4)


def test_batches_hold_sequences_of_similar_length_and_results_keep_the_order(
    tiny_llama, tiny_requests
):
    """Requests go to forwards shortest prompt + trace first (less padding), and results come
    back in the order given, each the same trace's as when it is scored alone."""
    engine = make_engine("prefill", tiny_llama, batch_size=2, top_k=3)
    announced = []
    engine.on_batch = announced.append
    together = engine.run(tiny_requests)
    engine.on_batch = None
    lengths = [[r.prompt_len + r.trace_len for r in batch] for batch in announced]
    assert [n for batch in lengths for n in batch] == sorted(
        r.prompt_len + r.trace_len for r in tiny_requests
    )
    for request, ours in zip(tiny_requests, together):
        alone = engine.run([request])[0]
        assert ours.trace_id == request.trace_id
        np.testing.assert_array_equal(ours.token_ids, alone.token_ids)
        np.testing.assert_allclose(ours.logprob, alone.logprob, atol=1e-5)


def _body_shapes(lm, run):
    """``run()``'s result and the ``(rows, width)`` of each forward of ``lm``'s body in it."""
    shapes = []
    hook = lm.base_model.register_forward_hook(
        lambda module, args, out: shapes.append(tuple(out.last_hidden_state.shape[:2]))
    )
    try:
        return run(), shapes
    finally:
        hook.remove()


def _own_logprobs(lm, request):
    """The forced tokens' logprobs under ``lm``'s own forward of the sequence alone."""
    ids = torch.tensor([request.prompt_token_ids + request.trace_token_ids])
    with torch.inference_mode():
        logits = lm(input_ids=ids).logits[0, request.prompt_len - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(request.trace_len), list(request.trace_token_ids)].numpy()


def test_a_batch_runs_as_one_unpadded_row_and_scores_as_the_reference(
    tiny_llama, tiny_requests, assert_results_match
):
    """On the CPU a batch's sequences run back to back in one row (no padding: prompt + trace
    but its last token each), each attending only to itself: every trace scores as the
    float64 reference and as when scored alone, and the model's attention is its own after."""
    engine = make_engine("prefill", tiny_llama, batch_size=len(tiny_requests), top_k=3)
    together, shapes = _body_shapes(tiny_llama, lambda: engine.run(tiny_requests))
    assert shapes == [(1, sum(r.prompt_len + r.trace_len - 1 for r in tiny_requests))]
    assert tiny_llama.config._attn_implementation == "sdpa"
    assert_results_match(together)
    for request, ours in zip(tiny_requests, together):
        np.testing.assert_allclose(ours.logprob, engine.run([request])[0].logprob, atol=1e-5)


def test_packed_rows_keep_a_sliding_window(make_tiny_lm, tiny_requests):
    """A model with a sliding window shorter than the sequences runs packed and scores as its
    own forward of each sequence alone (its own windowed mask)."""
    lm = make_tiny_lm("MistralConfig", sliding_window=3)
    engine = make_engine("prefill", lm, batch_size=len(tiny_requests), top_k=3)
    results, shapes = _body_shapes(lm, lambda: engine.run(tiny_requests))
    assert shapes == [(1, sum(r.prompt_len + r.trace_len - 1 for r in tiny_requests))]
    for request, ours in zip(tiny_requests, results):
        np.testing.assert_allclose(ours.logprob, _own_logprobs(lm, request), atol=1e-5)


def test_a_model_packing_cannot_run_is_padded(make_tiny_lm, tiny_requests):
    """Attention scores soft-capped (Gemma-2), which SDPA cannot do: the batch runs padded
    through the model's own attention and scores as its own forward."""
    lm = make_tiny_lm("Gemma2Config", attn_implementation="eager", attn_logit_softcapping=1.0)
    engine = make_engine("prefill", lm, batch_size=len(tiny_requests), top_k=3)
    results, shapes = _body_shapes(lm, lambda: engine.run(tiny_requests))
    width = max(r.prompt_len + r.trace_len - 1 for r in tiny_requests)
    assert shapes == [(len(tiny_requests), width)]
    for request, ours in zip(tiny_requests, results):
        np.testing.assert_allclose(ours.logprob, _own_logprobs(lm, request), atol=1e-5)
