"""Tests for trace_replay.runs.recording on the embedded model (torch engine): recorded traces carry
what the generating engine reported, and replay through it gives the same logprobs back."""

from __future__ import annotations

import numpy as np
import pytest

from trace_replay.engines import make_engine
from trace_replay.runs.recording import record
from trace_replay.runs.replay import replay
from trace_replay.traces.chat import tokenize_chat_prompt
from trace_replay.traces.sets import Trace, load_traces

pytestmark = pytest.mark.slow

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine(lm):
    return make_engine("torch", lm, batch_size=2)


@pytest.fixture(scope="module")
def recorded(engine):
    prompts = [
        "The capital of France is",
        {"id": "code", "prompt": "def add(a, b):", "meta": {"task": "add"}},
        Trace("story", prompt="Once upon a", completion=" time", meta={"n": 1}),
    ]
    return record(prompts, engine=engine, max_tokens=MAX_TOKENS)


def test_one_trace_per_prompt_with_its_id(recorded):
    """Strings get ids p0, p1...; dicts and Traces keep theirs; order is the prompts' order."""
    assert recorded.ids == ["p0", "code", "story"]


def test_traces_carry_tokens_text_and_reported_logprobs(recorded, tokenizer):
    """Each trace has its prompt ids, at most max_tokens trace ids, their decoded text, and one
    finite logprob <= 0 per token."""
    for trace in recorded:
        assert trace.prompt_token_ids == tuple(tokenizer.encode(trace.prompt))
        assert 1 <= len(trace.trace_token_ids) <= MAX_TOKENS
        assert trace.completion == tokenizer.decode(list(trace.trace_token_ids))
        assert len(trace.ref_logprobs) == len(trace.trace_token_ids)
        assert all(np.isfinite(lp) and lp <= 0 for lp in trace.ref_logprobs)


def test_meta_records_the_generation_settings(recorded, engine):
    """meta keeps the prompt's own keys and adds recorded_with: model, engine, path, sampling."""
    assert recorded[1].meta["task"] == "add" and recorded[2].meta["n"] == 1
    assert recorded[0].meta["recorded_with"] == {
        "model": engine.settings()["model"],
        "engine": "torch",
        "engine_path": engine.settings()["engine_path"],
        "temperature": 0.0,
        "seed": 0,
        "max_tokens": MAX_TOKENS,
    }


def test_replay_gives_the_recorded_logprobs_back(recorded, engine):
    """Greedy traces replayed through the engine that wrote them: the same logprobs (float32
    decode both times) and rank 1 at every step, up to exact ties."""
    df = replay(recorded, engine=engine, progress=False)
    np.testing.assert_allclose(df["logprob"], df["ref_logprob"], atol=1e-4)
    top = df["top_logprobs"].map(lambda values: values[0])
    assert ((df["rank"] == 1) | (top - df["logprob"] < 1e-5)).all()


def test_an_engine_that_cannot_generate_is_refused(lm):
    """Prefill scoring cannot write traces: a TypeError names the engine; unknown names too."""
    with pytest.raises(TypeError, match="engine 'prefill' cannot generate"):
        record(["Hi"], engine=make_engine("prefill", lm), max_tokens=2)
    with pytest.raises(
        ValueError,
        match=r"record runs on an engine that generates "
        r"\(auto, torch, vllm\), not 'prefill'",
    ):
        record(["Hi"], engine="prefill", max_tokens=2)


@pytest.mark.parametrize("max_tokens", [0, -1, 1.5, True])
def test_max_tokens_below_one_is_named(engine, max_tokens):
    """max_tokens that is not an integer >= 1 is refused naming it and the value, before
    anything is generated (was torch's 'stack expects a non-empty TensorList')."""
    with pytest.raises(
        ValueError,
        match=rf"^max_tokens must be an integer >= 1, got "
        rf"{max_tokens!r}$",
    ):
        record(["Hi"], engine=engine, max_tokens=max_tokens)


@pytest.mark.parametrize("temperature", [-1.0, float("nan"), float("inf"), "0.7"])
def test_a_temperature_no_sampler_takes_is_named(engine, temperature):
    """A negative, NaN, infinite or non-number temperature is refused naming it (was
    recorded as given in meta while generating greedily, or from a uniform distribution)."""
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0"):
        record(["Hi"], engine=engine, max_tokens=2, temperature=temperature)


def test_a_bad_prompt_is_named_by_its_index(engine):
    """A prompt that is neither text, a record nor a Trace is refused with its index."""
    with pytest.raises(TypeError, match="prompt 1: expected str, dict or Trace, got int"):
        record(["Hi", 42], engine=engine, max_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0 \('x'\): needs 'prompt' text"):
        record([{"id": "x"}], engine=engine, max_tokens=2)


def test_chat_prompt_records_a_reply_that_replays(engine, tokenizer, tmp_path):
    """A prompt given as messages is rendered as a chat request is (template + generation
    prompt); the recorded reply keeps the messages, loads back as an assistant turn, and
    replays with its recorded logprobs."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    traces = record([{"id": "chat", "messages": messages}], engine=engine, max_tokens=6)
    trace = traces[0]
    assert list(trace.prompt_token_ids) == tokenize_chat_prompt(tokenizer, messages)
    assert trace.messages == messages and trace.completion == tokenizer.decode(
        list(trace.trace_token_ids)
    )
    traces.to_jsonl(tmp_path / "chat.jsonl")
    df = replay(load_traces(tmp_path / "chat.jsonl"), engine=engine, progress=False)
    assert set(df["role"]) == {"assistant"}
    assert (df["logprob"] - df["ref_logprob"]).abs().max() < 1e-4
