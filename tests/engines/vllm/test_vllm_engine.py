"""vLLM replay (the CPU build's logits-processor forcing path) on the embedded model."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[cpu]')")

from trace_replay.engines import make_engine  # noqa: E402
from trace_replay.runs.replay import replay  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def engine():
    # small batch: slots get reused across the six traces. deterministic=True: on a GPU
    # vLLM runs batch-invariant; the CPU build cannot, and must say so (below)
    from trace_replay.engines.vllm.deterministic import deterministic_unavailable

    unavailable = deterministic_unavailable()
    with (
        pytest.warns(RuntimeWarning, match="NOT batch-invariant")
        if unavailable
        else contextlib.nullcontext()
    ):
        engine = make_engine(
            "vllm",
            None,
            batch_size=4,
            top_k=5,
            deterministic=True,
            engine_args={"max_model_len": 1024, "max_num_batched_tokens": 1024},
        )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def result(engine, real_traces):
    return replay(real_traces, engine=engine, progress=False)


def test_fidelity_float32(result, assert_matches_reference):
    """float32 vLLM replay: |Δlogprob| <= 2e-3 per token vs float64, ranks equal up to ties."""
    assert_matches_reference(result)


def test_forcing_path_is_recorded(result):
    """The CPU build has no Model Runner V2: the forcing path is used and says so."""
    assert result.attrs["engine_path"] == "vllm-logits-processor-forcing"
    assert result.attrs["logprobs_mode"] == "raw_logprobs"


def _output_token_lists(worker):
    batch = worker.model_runner.input_batch
    return batch.logitsprocs_need_output_token_ids, batch.sampling_metadata.output_token_ids


def test_vllm_hands_the_processor_no_output_tokens(engine, result, real_traces, tokenizer):
    """The forcing processor reads output lengths only; vLLM is told so, and while requests
    are decoding its sampling metadata carries no output-token lists (the replays in the
    other tests run this way and emit exactly their traces)."""
    from trace_replay.runs.replay import prepare_requests

    assert result.attrs["output_tokens_to_processors"] is False
    requests, _ = prepare_requests(real_traces.tokenize(tokenizer), engine.max_model_len)
    seen = []
    engine.run(
        requests[:2],
        on_tokens=lambda _: seen.append(engine.llm.collective_rpc(_output_token_lists)),
    )
    assert seen and all(s == [(False, [])] for s in seen)


def test_a_request_trace_is_not_deep_copied(engine):
    """Each request's SamplingParams is built once and never reused, so vLLM is told not to
    deep-copy it: its copy shares the trace list instead of copying every id."""
    from trace_replay.engines.base import ReplayRequest
    from trace_replay.engines.vllm.engine import TRACE_KEY

    params = engine._params(ReplayRequest("t", (1, 2), tuple(range(3, 200))))
    copy = params.clone()
    assert copy is not params
    assert copy.extra_args[TRACE_KEY] is params.extra_args[TRACE_KEY]
    assert params.extra_args[TRACE_KEY] == list(range(3, 200))


def test_deterministic_is_not_claimed_where_vllm_cannot(result):
    """attrs say whether vLLM ran batch-invariant, and why not where it could not."""
    from trace_replay.engines.vllm.deterministic import deterministic_unavailable

    reason = deterministic_unavailable()
    assert result.attrs["deterministic"] is True
    assert result.attrs["deterministic_active"] is (reason is None)
    assert result.attrs.get("deterministic_unavailable") == reason


def test_emits_exactly_the_trace(result, real_traces):
    """EOS inside a trace does not stop replay; each trace ends exactly at its last token."""
    for trace in real_traces:
        assert result[result.trace_id == trace.id]["token_id"].tolist() == list(
            trace.trace_token_ids
        )


def test_off_trace_token_gets_its_true_rank(engine, tokenizer):
    """A planted improbable token is forced, reported with its low rank and logprob."""
    prompt = tokenizer.encode("The capital of France is")
    traces = [{"id": "planted", "prompt_token_ids": prompt, "trace_token_ids": [7042, 40000]}]
    df = replay(traces, engine=engine, progress=False)
    assert df["rank"].iloc[1] > 1000 and df["logprob"].iloc[1] < -10


def test_agrees_with_torch_engine(result, lm, real_traces):
    """The two decode engines agree per token within the fidelity tolerance."""

    torch_df = replay(real_traces, engine=make_engine("torch", lm, batch_size=4), progress=False)
    np.testing.assert_allclose(result["logprob"], torch_df["logprob"], atol=2e-3)
    assert (
        result["top_token_ids"].map(lambda v: v[0]) == torch_df["top_token_ids"].map(lambda v: v[0])
    ).mean() > 0.95


def test_greedy_record_replays_at_rank_1(engine):
    """Traces recorded greedily by vLLM replay through vLLM at rank 1 with their own logprobs."""
    from trace_replay.runs.recording import record

    traces = record(["The capital of France is", "def square(x):"], engine=engine, max_tokens=10)
    df = replay(traces, engine=engine, progress=False)
    top = df["top_logprobs"].map(lambda v: v[0])
    assert ((df["rank"] == 1) | (top - df["logprob"] < 1e-5)).all()
    np.testing.assert_allclose(df["logprob"], df["ref_logprob"], atol=1e-4)


def test_progress_counts_tokens_as_they_are_decoded(engine, real_traces, tokenizer):
    """run(on_tokens=) reports every trace token once, step by step (not per request)."""
    from trace_replay.runs.replay import prepare_requests

    requests, _ = prepare_requests(real_traces.tokenize(tokenizer), engine.max_model_len)
    reported = []
    engine.run(requests, on_tokens=reported.append)
    assert sum(reported) == sum(r.trace_len for r in requests)
    assert len(reported) >= max(r.trace_len for r in requests)  # at least one per step


def test_runner_and_why_not_native_are_recorded(result):
    """attrs name the model runner and why the native path was not taken (CPU: no CUDA)."""
    assert result.attrs["model_runner"] == "v1"
    assert "no CUDA device" in result.attrs["native_unavailable"]


def test_parallel_sizes_are_recorded(result):
    """attrs (and so the checkpoint's settings key) record the tensor and pipeline parallel
    sizes the engine ran with: 1 and 1 when none were given."""
    assert result.attrs["tensor_parallel_size"] == 1
    assert result.attrs["pipeline_parallel_size"] == 1


def test_quantization_is_recorded(result):
    """attrs say which quantization vLLM ran (none for the embedded model's float weights),
    so an FP8 run's frame is never mistaken for a bfloat16 one."""
    assert result.attrs["quantization"] == "none"


def test_a_trace_past_max_model_len_is_refused_naming_it(engine):
    """An engine given a request longer than its context refuses it by the trace's id
    (vLLM would reject it without naming it, or silently cut a native trace)."""
    from trace_replay.engines.base import ReplayRequest
    from trace_replay.traces.trace import TraceError

    trace = (7,) * engine.max_model_len
    with pytest.raises(TraceError, match="'too-long'.*max_model_len"):
        engine.run([ReplayRequest("too-long", (1, 2), trace)])


def test_a_second_engine_starts_beside_the_first(engine, real_traces):
    """A second vLLM engine in the same process starts and replays while the first is
    alive: each KV cache is sized to its work (max_num_seqs x max_model_len), not to a
    share of the machine's memory."""
    from trace_replay.engines.vllm.engine import kv_cache_bytes

    second = make_engine(
        "vllm",
        None,
        batch_size=2,
        top_k=5,
        engine_args={"max_model_len": 512, "max_num_batched_tokens": 512},
    )
    try:
        df = replay(real_traces, engine=second, progress=False)
        cache = second.llm.llm_engine.vllm_config.cache_config
        assert cache.kv_cache_memory_bytes == kv_cache_bytes(
            second.llm_args["model"], torch.float32, 2, 512
        )
    finally:
        second.close()
    assert len(df) == sum(len(t.trace_token_ids) for t in real_traces)


def test_logprobs_keep_vllm_ranks_and_top_k_order():
    """The result arrays hold, per position, the emitted token's rank as vLLM's logprobs give
    it (its top-k place where vLLM listed it there, so a token tied with a better one stays
    rank 1, as vLLM's greedy output says) and the top-k in vLLM's order; slots vLLM did not
    fill are id 0 and NaN."""
    from vllm.logprobs import Logprob

    from trace_replay.engines.vllm.engine import _Logprobs

    tied = {5: Logprob(-0.2, 1, None), 8: Logprob(-0.2, 2, None), 1: Logprob(-3.0, 3, None)}
    off = {
        7: Logprob(-9.0, 40, None),
        3: Logprob(-0.1, 1, None),
        9: Logprob(-2.0, 2, None),
        4: Logprob(-2.5, 3, None),
    }
    logprobs = _Logprobs()
    logprobs.extend([tied])
    logprobs.extend([off])
    emitted, logprob, rank, top_ids, top_lps = logprobs.arrays(4)
    assert emitted.tolist() == [5, 7] and logprob.tolist() == [-0.2, -9.0]
    assert rank.tolist() == [1, 40]
    assert top_ids.tolist() == [[5, 8, 1, 0], [3, 9, 4, 0]]
    assert np.isnan(top_lps[:, 3]).all() and top_lps[1, :3].tolist() == [-0.1, -2.0, -2.5]


@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_flat_and_dict_logprobs_give_the_same_arrays(top_k):
    """vLLM's flat logprobs (asked for: no object per entry) are read to the very arrays its
    dicts give, each container filled by vLLM's own per-position append from the same
    sampler numbers: a tied emitted token reported by vLLM at rank 2 but listed first in the
    top-k is rank 1 in both, an emitted token outside the top-k keeps vLLM's rank."""
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    from trace_replay.engines.vllm.engine import _Logprobs

    # (emitted and top-k ids, their logprobs, the emitted token's rank as vLLM computed it)
    positions = [
        ([5, 5, 8, 1], [-0.2, -0.2, -0.2, -3.0], 2),  # tie, listed first
        ([8, 5, 8, 1], [-0.2, -0.2, -0.2, -3.0], 2),  # tie, listed second
        ([7, 3, 9, 4], [-9.0, -0.1, -2.0, -2.5], 40),  # off the top-k
        ([4, 3, 9, 4], [-2.5, -0.1, -2.0, -2.5], 3),
    ]  # third
    arrays = []
    for flat in (True, False):
        container = create_sample_logprobs(flat)
        for ids, lps, rank in positions:
            append_logprobs_for_next_position(
                container, ids[: top_k + 1], lps[: top_k + 1], [None] * (top_k + 1), rank, top_k
            )
        logprobs = _Logprobs()
        logprobs.extend(container)
        arrays.append(logprobs.arrays(top_k))
    for flat, dicts in zip(*arrays):
        np.testing.assert_array_equal(flat, dicts)
    emitted, _, rank, top_ids, _ = arrays[0]
    assert emitted.tolist() == [5, 8, 7, 4]
    assert rank.tolist() == {0: [2, 2, 40, 3], 1: [1, 2, 40, 3], 3: [1, 2, 40, 3]}[top_k]
    assert top_ids.tolist() == [
        [5, 8, 1][:top_k],
        [5, 8, 1][:top_k],
        [3, 9, 4][:top_k],
        [3, 9, 4][:top_k],
    ]


def test_step_progress_counts_running_requests_and_is_exact_at_the_end():
    """Between finishes each step counts one token per running request, never reaching a
    request's length before it finishes; a finish counts what it emitted, so a replay
    (every request emits its whole trace) ends exactly at the tokens done; the count never
    goes back, even for a request that ends shorter than counted."""
    from trace_replay.engines.vllm.engine import _StepProgress

    progress = _StepProgress([3, 5, 4])
    counts = [
        progress.step([]),
        progress.step([]),
        progress.step([(0, 3)]),
        progress.step([]),
        progress.step([(2, 4)]),
        progress.step([(1, 5)]),
    ]
    assert counts == [3, 3, 3, 1, 1, 1]
    assert sum(counts) == 3 + 5 + 4
    assert progress.step([]) == 0

    short = _StepProgress([3, 5])
    counts = [short.step([]), short.step([]), short.step([(0, 3), (1, 1)])]
    assert counts == [2, 2, 0] and short.reported == 4  # counted past the 1 it emitted
