"""Tests for trace_replay.traces.tokenization: text traces tokenized as the model sees the joined text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_replay.traces.sets import TraceError, load_traces
from trace_replay.traces.tokenization import split_text


def pieces(tokenizer, ids):
    return [tokenizer.decode([i]) for i in ids]


def test_leading_spaces_are_scored_as_the_joined_text_tokenizes(tokenizer):
    """A completion starting with spaces gets the joined text's tokens ("\\n  ", " return"),
    not the "   " token that tokenizing it alone would give and the model never sees."""
    trace = load_traces(
        [{"id": "t", "prompt": "def f(x):\n", "completion": "   return x"}], tokenizer=tokenizer
    )[0]
    assert pieces(tokenizer, trace.trace_token_ids) == ["\n  ", " return", " x"]
    assert [*trace.prompt_token_ids, *trace.trace_token_ids] == tokenizer.encode(
        "def f(x):\n   return x", add_special_tokens=True
    )


def test_straddling_token_goes_to_the_trace_and_is_recorded(tokenizer):
    """A token that straddles the prompt's end belongs to the trace; the prompt characters it
    carries are recorded in meta["prompt_tail_in_trace"]."""
    trace = load_traces(
        [{"id": "t", "prompt": "Hello wor", "completion": "ld"}], tokenizer=tokenizer
    )[0]
    assert pieces(tokenizer, trace.prompt_token_ids) == ["Hello"]
    assert pieces(tokenizer, trace.trace_token_ids) == [" world"]
    assert trace.meta == {"prompt_tail_in_trace": " wor"}


def test_boundary_on_a_token_boundary_moves_nothing(tokenizer):
    """When the joined text has a token boundary at the prompt's end, the prompt keeps all its
    tokens (even a trailing space, unlike lm-eval's rule) and nothing is recorded."""
    prompt = "Q: What is 2+2?\nA: "
    trace = load_traces([{"id": "t", "prompt": prompt, "completion": "4"}], tokenizer=tokenizer)[0]
    assert list(trace.prompt_token_ids) == tokenizer.encode(prompt, add_special_tokens=True)
    assert pieces(tokenizer, trace.trace_token_ids) == ["4"]
    assert trace.meta == {}


def test_no_token_inside_the_prompt_is_an_error(tokenizer, tmp_path):
    """A prompt whose every token merges into the completion leaves no prompt: an error naming
    the line and the trace, pointing at the token-id escape hatch."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "w", "prompt": "wor", "completion": "ld"}) + "\n")
    with pytest.raises(
        TraceError,
        match=rf"^{path}:1: trace 'w': tokenized together .* no token "
        r"lies wholly inside the prompt; give prompt_token_ids",
    ):
        load_traces(path, tokenizer=tokenizer)


def test_token_ids_are_the_escape_hatch(tokenizer):
    """Given token ids are replayed as given, even where the joined text tokenizes otherwise."""
    alone = tokenizer.encode("   return x", add_special_tokens=False)
    trace = load_traces(
        [{"id": "t", "prompt": "def f(x):\n", "trace_token_ids": alone}], tokenizer=tokenizer
    )[0]
    assert list(trace.trace_token_ids) == alone
    assert list(trace.prompt_token_ids) == tokenizer.encode("def f(x):\n")


texts = st.text(st.sampled_from(list("ab \n\t.é:🦜(")), max_size=12)


@settings(max_examples=60, deadline=None)
@given(prompt=texts.filter(bool), completion=texts.filter(bool))
def test_split_is_the_joined_tokens_cut_inside_the_prompt(tokenizer, prompt, completion):
    """For any texts: prompt + trace ids are the joined text's ids, the prompt ids are the
    prompt's own leading ids, and the trace decodes to the recorded tail + the completion."""
    try:
        prompt_ids, trace_ids, tail = split_text(tokenizer, prompt, completion)
    except TraceError:
        return  # no token inside the prompt; tested above
    assert prompt_ids + trace_ids == tokenizer.encode(prompt + completion)
    assert tokenizer.encode(prompt)[: len(prompt_ids)] == prompt_ids
    if "🦜" not in prompt:  # a split inside a character's bytes decodes to U+FFFD
        assert tokenizer.decode(trace_ids) == tail + completion
        assert prompt.endswith(tail)


def test_special_token_text_in_a_completion_is_refused(tokenizer):
    """'<|im_end|>' written in completion text is refused, naming it, never silently turned
    into the control token; in a prompt it is the control token, and as ids it is forced."""
    with pytest.raises(
        TraceError,
        match=r"t.*completion holds the special token text "
        r"'<\|im_end\|>' at character 4.*trace_token_ids",
    ):
        load_traces(
            [{"id": "t", "prompt": "Say hi.", "completion": " Hi!<|im_end|> more"}],
            tokenizer=tokenizer,
        )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    [prompt, ids] = load_traces(
        [
            {"id": "p", "prompt": "<|im_start|>user\nHi<|im_end|>", "completion": " Hello"},
            {"id": "i", "prompt": "Say hi.", "trace_token_ids": [21041, 17, eos, 3875]},
        ],
        tokenizer=tokenizer,
    )
    assert eos in prompt.prompt_token_ids
    assert ids.trace_token_ids[2] == eos
