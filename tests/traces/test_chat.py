"""Tests for trace_replay.traces.chat: conversations rendered with the model's chat template."""

from __future__ import annotations

import copy
import json

import pytest

from trace_replay.traces.sets import TraceError, load_traces

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": " Rome, of course."},
    {"role": "user", "content": "Thanks!"},  # after the last assistant turn: not rendered
]
LAST = 4
ASSISTANT_TURNS = [2, 4]


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)[
            "input_ids"
        ]
    )


def chat_trace(tokenizer, **fields):
    return load_traces([{"id": "c", "messages": CONVERSATION, **fields}], tokenizer=tokenizer)[0]


def test_last_turn_is_the_trace_by_default(tokenizer):
    """Default: the prompt is the template's rendering up to the last assistant turn with the
    generation prompt, and the trace is that turn's content and its end-of-turn token."""
    trace = chat_trace(tokenizer)
    assert list(trace.prompt_token_ids) == template_ids(
        tokenizer, CONVERSATION[:LAST], add_generation_prompt=True
    )
    assert tokenizer.decode(trace.trace_token_ids) == " Rome, of course.<|im_end|>"
    assert set(trace.trace_roles) == {"assistant"} and set(trace.trace_turns) == {LAST}


def test_trace_stops_before_the_template_formatting_after_the_turn(tokenizer):
    """prompt + trace is the template's token list for the conversation up to the last turn,
    without the template's "\\n" after the end-of-turn token."""
    trace = chat_trace(tokenizer)
    whole = template_ids(tokenizer, CONVERSATION[: LAST + 1])
    replayed = [*trace.prompt_token_ids, *trace.trace_token_ids]
    assert whole[: len(replayed)] == replayed
    assert tokenizer.decode(whole[len(replayed) :]) == "\n"


def test_all_turns_force_the_tokens_between_them(tokenizer):
    """turns="all": the trace runs from the first assistant turn to the end of the last one;
    its tokens are the template's, every assistant turn's tokens are labelled with its message
    index and decode to its content + <|im_end|>, and everything else is labelled otherwise."""
    trace = chat_trace(tokenizer, turns="all")
    whole = template_ids(tokenizer, CONVERSATION[: LAST + 1])
    assert list(trace.prompt_token_ids) == template_ids(
        tokenizer, CONVERSATION[: ASSISTANT_TURNS[0]], add_generation_prompt=True
    )
    assert [*trace.prompt_token_ids, *trace.trace_token_ids] == whole[:-1]
    labels = list(zip(trace.trace_turns, trace.trace_roles))
    for turn in ASSISTANT_TURNS:
        tokens = [
            t for t, label in zip(trace.trace_token_ids, labels) if label == (turn, "assistant")
        ]
        assert tokenizer.decode(tokens) == CONVERSATION[turn]["content"] + "<|im_end|>"
    assert set(labels) == {
        (2, "assistant"),
        (2, "template"),
        (3, "user"),
        (4, "template"),
        (4, "assistant"),
    }
    assert list(trace.trace_turns) == sorted(trace.trace_turns)


def test_turns_argument_overrides_the_records(tokenizer):
    """load_traces(turns=...) sets turns on every chat trace; a record's own turns otherwise."""
    records = [
        {"id": "a", "messages": CONVERSATION, "turns": "all"},
        {"id": "b", "messages": CONVERSATION},
    ]
    assert [t.turns for t in load_traces(records)] == ["all", None]
    assert [t.turns for t in load_traces(records, turns="last")] == ["last", "last"]


def test_messages_with_given_trace_ids_are_the_request(tokenizer):
    """messages + trace_token_ids: the messages, rendered with the generation prompt, are the
    prompt, and every trace token is the reply: role assistant, turn len(messages)."""
    reply = tokenizer.encode(" Rome.<|im_end|>", add_special_tokens=False)
    trace = load_traces(
        [{"id": "r", "messages": CONVERSATION[:4], "trace_token_ids": reply}], tokenizer=tokenizer
    )[0]
    assert list(trace.prompt_token_ids) == template_ids(
        tokenizer, CONVERSATION[:4], add_generation_prompt=True
    )
    assert trace.trace_roles == ("assistant",) * len(reply)
    assert trace.trace_turns == (4,) * len(reply)


def test_tools_reach_the_template(tokenizer):
    """A record's tools are passed to the chat template, as a chat request's tools are."""
    tooled = copy.deepcopy(tokenizer)
    tooled.chat_template = (
        "{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}" + tokenizer.chat_template
    )
    tools = [{"type": "function", "function": {"name": "get_capital", "parameters": {}}}]
    trace = load_traces([{"id": "t", "messages": CONVERSATION, "tools": tools}], tokenizer=tooled)[
        0
    ]
    assert tooled.decode(trace.prompt_token_ids).startswith("[get_capital]<|im_start|>system")


def test_no_chat_template_is_an_error_naming_line_and_trace(tokenizer, tmp_path):
    """A tokenizer without a chat template cannot render messages: the error says so."""
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "c1", "messages": CONVERSATION}) + "\n")
    with pytest.raises(
        TraceError,
        match=rf"^{path}:1: trace 'c1': the model's tokenizer has no "
        "chat template",
    ):
        load_traces(path, tokenizer=bare)


def test_conversation_without_assistant_turn_is_an_error(tmp_path):
    """A conversation with nothing to replay is refused at load time, naming line and trace."""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "q", "messages": CONVERSATION[:2]}) + "\n")
    with pytest.raises(TraceError, match=rf"^{path}:1: trace 'q': messages has no assistant turn"):
        load_traces(path)


def test_template_that_rewrites_earlier_turns_is_an_error(tokenizer):
    """A template whose rendering of a prefix does not start the whole conversation's text
    (here: it counts the messages up front) cannot be split into turns."""
    counting = copy.deepcopy(tokenizer)
    counting.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    with pytest.raises(
        TraceError,
        match=r"trace 'c': the chat template renders messages\[:4\] "
        r"with the generation prompt as text that does not",
    ):
        chat_trace(counting)


def test_tokenized_chat_traces_round_trip_through_files(tokenizer, tmp_path):
    """A tokenized chat trace (messages, tools, turns, per-token labels) survives JSONL and
    Parquet unchanged."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    traces = load_traces(
        [{"id": "a", "messages": CONVERSATION, "tools": tools, "turns": "all"}], tokenizer=tokenizer
    )
    traces.to_jsonl(tmp_path / "c.jsonl")
    traces.to_parquet(tmp_path / "c.parquet")
    assert load_traces(tmp_path / "c.jsonl") == traces
    assert load_traces(tmp_path / "c.parquet") == traces


@pytest.mark.slow
def test_chat_jsonl_replays_on_the_embedded_model(tokenizer, lm, tmp_path):
    """A multi-turn chat JSONL replays through the decode loop; the rows labelled assistant
    are exactly the assistant tokens of apply_chat_template on the conversation, and every
    row names its turn and role."""
    from trace_replay.engines import make_engine
    from trace_replay.runs.replay import replay

    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"id": "all", "messages": CONVERSATION, "turns": "all"})
        + "\n"
        + json.dumps({"id": "last", "messages": CONVERSATION})
        + "\n"
    )
    df = replay(path, engine=make_engine("torch", lm, batch_size=2, top_k=3), progress=False)
    assert df[["turn", "role"]].notna().all().all()
    whole = template_ids(tokenizer, CONVERSATION[: LAST + 1])
    expected = {}
    for turn in ASSISTANT_TURNS:  # the template's tokens from the generation prompt on
        start = len(template_ids(tokenizer, CONVERSATION[:turn], add_generation_prompt=True))
        end = len(template_ids(tokenizer, CONVERSATION[: turn + 1])) - 1  # before the "\n"
        expected[turn] = whole[start:end]
    rows = df[df["role"] == "assistant"]
    for trace_id, turns in (("all", ASSISTANT_TURNS), ("last", [LAST])):
        mine = rows[rows["trace_id"] == trace_id]
        assert [mine[mine["turn"] == t]["token_id"].tolist() for t in turns] == [
            expected[t] for t in turns
        ]
    assert df["logprob"].lt(0).all() and df["rank"].ge(1).all()


def test_traceset_keeps_chat_fields_in_to_pandas():
    """to_pandas has the chat columns, so a DataFrame round trip keeps chat traces."""
    traces = load_traces([{"id": "a", "messages": CONVERSATION, "turns": "all"}])
    assert load_traces(traces.to_pandas()) == traces
