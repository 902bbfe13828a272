"""Trace records: reference logprobs and text that cannot be replayed are refused by name."""

from __future__ import annotations

import json

import pytest

from trace_replay.traces.sets import TraceError, load_traces

BASE = {"id": "t", "prompt_token_ids": [1], "trace_token_ids": [2, 3]}


@pytest.mark.parametrize(
    ("value", "problem"),
    [(float("nan"), "is NaN"), (float("inf"), "= inf is positive"), (0.5, "= 0.5 is positive")],
)
def test_ref_logprobs_must_be_log_probabilities(value, problem):
    """NaN (indistinguishable from "no reference"), +inf and positive values are refused."""
    with pytest.raises(TraceError, match=rf"row 0: trace 't': ref_logprobs\[1\] {problem}"):
        load_traces([{**BASE, "ref_logprobs": [-0.5, value]}])


def test_ref_logprobs_of_certainty_are_kept():
    """0.0 (p = 1) and rounding just above it are valid log-probabilities."""
    trace = load_traces([{**BASE, "ref_logprobs": [0.0, 1e-9]}])
    assert trace[0].ref_logprobs == (0.0, 1e-9)


def test_minus_infinity_ref_logprob_is_refused_by_file_line_trace_and_field(tmp_path):
    """-Infinity (JSON's spelling, p = 0: no recorded token has it) is refused like NaN and
    +inf, the error naming the file, the line, the trace id and the field with its index."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(BASE) + "\n" + '{"id": "m", "prompt_token_ids": [1], "trace_token_ids": [2, 3], '
        '"ref_logprobs": [-0.5, -Infinity]}\n'
    )
    with pytest.raises(
        TraceError,
        match=rf"^{path}:2: trace 'm': ref_logprobs\[1\] = -inf "
        r"is infinite",
    ):
        load_traces(path)


def test_vllms_stand_in_for_minus_infinity_is_refused(tokenizer):
    """-9999.0 is how a vLLM server writes a -inf logprob in JSON: in a trace file or an
    OpenAI-format log it is -inf by another spelling, refused naming the trace and the field
    (it was kept as a logprob of -9999, making every delta of the trace about 9999)."""
    with pytest.raises(
        TraceError,
        match=r"trace 't': ref_logprobs\[1\] = -9999.0 is vLLM's "
        r"stand-in for -inf",
    ):
        load_traces([{**BASE, "ref_logprobs": [-0.5, -9999.0]}])
    logged = {
        "request": {"prompt": "The capital is"},
        "response": {
            "id": "cmpl-1",
            "choices": [
                {"text": " Paris", "logprobs": {"tokens": [" Paris"], "token_logprobs": [-9999.0]}}
            ],
        },
    }
    with pytest.raises(TraceError, match=r"trace 'cmpl-1': ref_logprobs\[0\] = -9999.0"):
        load_traces([logged], format="openai", tokenizer=tokenizer)


def test_lone_surrogate_is_named(tmp_path):
    """JSON "\\ud800" parses to a str no tokenizer can encode: an error naming line and field."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(BASE) + "\n" + '{"id": "s", "prompt": "a\\ud800b", "completion": " x"}\n'
    )
    with pytest.raises(
        TraceError,
        match=rf"{path}:2: trace 's': prompt holds a lone "
        r"surrogate '\\ud800' \(character 1\)",
    ):
        load_traces(path)
