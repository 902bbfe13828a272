"""trace_replay.record on the embedded model (torch engine)."""

from __future__ import annotations

import pytest

from trace_replay.chat import tokenize_chat_prompt
from trace_replay.engines import make_engine
from trace_replay.record import record
from trace_replay.replay import replay
from trace_replay.traces import load_traces


@pytest.mark.slow
def test_chat_prompt_records_a_reply_that_replays(lm, tokenizer, tmp_path):
    """A prompt given as messages is rendered as a chat request is (template + generation
    prompt); the recorded reply keeps the messages, loads back as an assistant turn, and
    replays with its recorded logprobs."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = make_engine("torch", lm, batch_size=1)
    traces = record([{"id": "chat", "messages": messages}], engine=engine, max_tokens=6)
    trace = traces[0]
    assert list(trace.prompt_token_ids) == tokenize_chat_prompt(tokenizer, messages)
    assert trace.messages == messages and trace.completion == tokenizer.decode(
        list(trace.trace_token_ids))
    traces.to_jsonl(tmp_path / "chat.jsonl")
    df = replay(load_traces(tmp_path / "chat.jsonl"), engine=engine, progress=False)
    assert set(df["role"]) == {"assistant"}
    assert (df["logprob"] - df["ref_logprob"]).abs().max() < 1e-4
