"""Tests for trace_replay.runs.frame: engine results to the tidy replay DataFrame."""

from __future__ import annotations

import numpy as np
import pytest

from trace_replay.engines.base import TraceResult
from trace_replay.runs.frame import COLUMNS, TokenDecoder, to_frame, tokens_digest
from trace_replay.traces.sets import Trace


def result(trace_id: str, prompt_len: int, token_ids: list[int]) -> TraceResult:
    steps = len(token_ids)
    top = np.array([[token_ids[0], 13]] * steps)
    return TraceResult(
        trace_id=trace_id,
        prompt_len=prompt_len,
        token_ids=np.array(token_ids),
        logprob=-np.arange(1, steps + 1, dtype=np.float32) / 4,
        rank=np.arange(1, steps + 1),
        top_token_ids=top,
        top_logprobs=np.full((steps, 2), -0.5),
        entropy=np.full(steps, 1.5),
    )


@pytest.fixture(scope="module")
def traces():
    return {
        "a": Trace(
            "a",
            prompt_token_ids=(1, 2, 3),
            trace_token_ids=(3575, 282, 4649),
            ref_logprobs=(-0.25, -0.5, -0.75),
        ),
        "b": Trace("b", prompt_token_ids=(1,), trace_token_ids=(314, 1201)),
    }


@pytest.fixture(scope="module")
def frame(traces, tokenizer):
    results = [result("a", 3, [3575, 282, 4649]), result("b", 1, [314, 1201])]
    return to_frame(results, traces, TokenDecoder(tokenizer))


def test_one_row_per_step_with_its_position(frame):
    """Rows are (trace, step) in result order; step counts from 0, position = prompt_len + step."""
    assert list(frame.columns) == [*COLUMNS, "ref_logprob", "tokens_digest"]
    assert frame["trace_id"].tolist() == ["a", "a", "a", "b", "b"]
    assert frame["step"].tolist() == [0, 1, 2, 0, 1]
    assert frame["position"].tolist() == [3, 4, 5, 1, 2]
    for column in ("step", "position", "token_id", "rank"):
        assert frame[column].dtype == np.int64, column
    assert frame["logprob"].dtype == frame["entropy"].dtype == np.float64


def test_token_texts_are_the_tokenizer_decodes(frame, tokenizer):
    """token and top_tokens hold each id decoded alone by the model's tokenizer."""
    assert frame["token"].tolist() == [tokenizer.decode([t]) for t in frame["token_id"]]
    assert frame["top_tokens"][0] == [tokenizer.decode([3575]), tokenizer.decode([13])]


def test_ref_logprob_comes_from_the_trace(frame):
    """ref_logprob is the trace's recorded logprob per step, NaN for a trace without any."""
    assert frame["ref_logprob"][:3].tolist() == [-0.25, -0.5, -0.75]
    assert frame["ref_logprob"][3:].isna().all()


def test_a_cut_replay_keeps_the_matching_ref_logprobs(traces, tokenizer):
    """A result shorter than its trace (cut to the context) takes as many ref_logprobs."""
    df = to_frame([result("a", 3, [3575, 282])], traces, TokenDecoder(tokenizer))
    assert df["ref_logprob"].tolist() == [-0.25, -0.5]


def test_no_results_give_an_empty_frame_with_every_column(traces, tokenizer):
    """An empty run still has the frame's columns, so later code can select them."""
    df = to_frame([], traces, TokenDecoder(tokenizer))
    assert df.empty and list(df.columns) == [*COLUMNS, "ref_logprob", "tokens_digest"]


def test_decoder_decodes_each_id_once(tokenizer):
    """TokenDecoder memoizes: repeated ids cost one tokenizer call each, same text every time."""

    class Counting:
        def __init__(self):
            self.calls = 0

        def decode(self, ids):
            self.calls += 1
            return tokenizer.decode(ids)

    counting = Counting()
    decode = TokenDecoder(counting)
    texts = [decode(token_id) for token_id in (3575, 282, 3575, 3575, 282)]
    assert counting.calls == 2
    assert texts == [tokenizer.decode([t]) for t in (3575, 282, 3575, 3575, 282)]


def test_chat_and_plain_traces_in_one_call_keep_labels_and_nulls(traces, tokenizer):
    """A chat trace's rows carry its turns and roles; a plain trace's rows beside them get
    nulls (turn <NA>, role None); every other column is as for the plain traces alone."""
    ids = (3575, 282)
    chat = Trace(
        "c",
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Paris"}],
        prompt_token_ids=(1, 2),
        trace_token_ids=ids,
        trace_turns=(1, 1),
        trace_roles=("assistant", "template"),
    )
    both = {**traces, "c": chat}
    results = [result("a", 3, [3575, 282, 4649]), result("c", 2, list(ids))]
    df = to_frame(results, both, TokenDecoder(tokenizer))
    assert list(df.columns) == [*COLUMNS, "ref_logprob", "turn", "role", "tokens_digest"]
    assert df["turn"].dtype == "Int64" and df["turn"].isna().tolist() == [True] * 3 + [False] * 2
    assert df["role"].tolist() == [None, None, None, "assistant", "template"]
    plain = to_frame(results[:1], traces, TokenDecoder(tokenizer))
    assert df.iloc[:3][plain.columns].reset_index(drop=True).equals(plain)


def test_extra_columns_follow_entropy_and_are_checked_for_length(traces, tokenizer):
    """An engine's per-step extra arrays become columns after entropy; one of the wrong
    length is an error naming its trace, not a column shifted onto other traces' rows."""
    from dataclasses import replace

    exact = [
        replace(result("a", 3, [3575, 282, 4649]), extra={"rank_exact": np.ones(3, bool)}),
        replace(result("b", 1, [314, 1201]), extra={"rank_exact": np.array([True, False])}),
    ]
    df = to_frame(exact, traces, TokenDecoder(tokenizer))
    assert list(df.columns) == [*COLUMNS, "rank_exact", "ref_logprob", "tokens_digest"]
    assert df["rank_exact"].tolist() == [True, True, True, True, False]
    short = [exact[0], replace(exact[1], extra={"rank_exact": np.array([True])})]
    with pytest.raises(ValueError, match="trace 'b': rank_exact has 1 values for its 2 steps"):
        to_frame(short, traces, TokenDecoder(tokenizer))


def test_decoder_many_keeps_the_shape_and_decodes_each_id_once(tokenizer):
    """TokenDecoder.many: the texts of an id array of any shape, each distinct id decoded by
    the tokenizer once."""

    class Counting:
        calls = 0

        def decode(self, ids):
            Counting.calls += 1
            return tokenizer.decode(ids)

    ids = np.array([[3575, 282], [282, 3575], [13, 13]])
    texts = TokenDecoder(Counting()).many(ids)
    assert texts.shape == (3, 2) and Counting.calls == 3
    assert texts.tolist() == [[tokenizer.decode([t]) for t in row] for row in ids.tolist()]
    assert TokenDecoder(Counting()).many(np.zeros((4, 0), np.int64)).shape == (4, 0)


@pytest.mark.parametrize("text", [" שלום עולם", " 你好", "🙂🙂 👨‍👩‍👧", " naïve café"])
def test_token_texts_join_back_into_the_completion(text, tokenizer):
    """Each token's text is the text it completes: a character whose bytes several tokens
    share belongs to the token with its last byte (the others get ""), so the token column
    joins into the decoded completion, with no U+FFFD piece (it used to hold one per
    split token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text == " naïve café"
    traces = {
        "t": Trace("t", prompt_token_ids=(1,), trace_token_ids=tuple(ids)),
        "u": Trace("u", prompt_token_ids=(1,), trace_token_ids=tuple(ids[:-1])),
    }
    df = to_frame([result("t", 1, ids), result("u", 1, ids[:-1])], traces, TokenDecoder(tokenizer))
    tokens = df.groupby("trace_id")["token"].agg("".join)
    assert tokens["t"] == tokenizer.decode(ids) == text
    assert "\ufffd" not in tokens["t"]
    # a trace cut inside a character ends as its own decode does
    assert tokens["u"] == tokenizer.decode(ids[:-1])


def test_every_row_carries_its_traces_tokens_digest(frame, traces, tokenizer):
    """tokens_digest is one value per trace, of its prompt ids and its rows' token ids: the
    same trace under another prompt gets another digest (comparisons pair traces by it)."""
    assert frame.groupby("trace_id")["tokens_digest"].nunique().tolist() == [1, 1]
    first = frame.groupby("trace_id")["tokens_digest"].first()
    assert first["a"] == tokens_digest((1, 2, 3), (3575, 282, 4649)) != first["b"]
    moved = {"a": Trace("a", prompt_token_ids=(1, 2, 4), trace_token_ids=(3575, 282, 4649))}
    other = to_frame([result("a", 3, [3575, 282, 4649])], moved, TokenDecoder(tokenizer))
    assert other["tokens_digest"].iloc[0] != first["a"]
