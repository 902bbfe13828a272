"""Tests for trace_replay.traces.openai_logs: logs of OpenAI-compatible servers (vLLM's field shapes)."""

from __future__ import annotations

import copy
import json

import pytest

from trace_replay.traces.sets import TraceError, load_traces

CHAT_REQUEST = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "logprobs": True,
    "top_logprobs": 2,
    "max_tokens": 16,
    "temperature": 0.0,
}
# (token, logprob) as vLLM's chat endpoint logs them, EOS included
CHAT_TOKENS = [
    ("The", -0.713),
    (" capital", -0.0312),
    (" of", -0.0009),
    (" France", -0.0021),
    (" is", -0.0105),
    (" Paris", -0.2047),
    (".", -0.5391),
    ("<|im_end|>", -0.1124),
]
CHAT_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]
COMPLETION_REQUEST = {
    "model": "SmolLM2-135M-Instruct",
    "prompt": "The capital of France is",
    "max_tokens": 2,
    "logprobs": 2,
    "temperature": 0.0,
}
COMPLETION_TOKENS = [(" Paris", -0.4213), (".", -0.8741)]


def chat_entry(token: str, logprob: float, raw: bytes | None = None) -> dict:
    raw = token.encode() if raw is None else raw
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(raw),
        "top_logprobs": [
            {"token": token, "logprob": logprob, "bytes": list(raw)},
            {"token": " the", "logprob": logprob - 1.5, "bytes": [32, 116, 104, 101]},
        ],
    }


def chat_response(tokens=CHAT_TOKENS, **choice) -> dict:
    return {
        "id": "chatcmpl-9d2f6c1e04a84b7b",
        "object": "chat.completion",
        "created": 1767225600,
        "model": "SmolLM2-135M-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "The capital of France is Paris.",
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": {"content": [chat_entry(t, lp) for t, lp in tokens]},
                "finish_reason": "stop",
                "stop_reason": None,
                **choice,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 37,
            "total_tokens": 45,
            "completion_tokens": 8,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def completion_response(tokens=COMPLETION_TOKENS, **choice) -> dict:
    offsets = [24 + sum(len(t) for t, _ in tokens[:i]) for i in range(len(tokens))]
    return {
        "id": "cmpl-1b7e0a3f5c2d4e69",
        "object": "text_completion",
        "created": 1767225601,
        "model": "SmolLM2-135M-Instruct",
        "choices": [
            {
                "index": 0,
                "text": "".join(t for t, _ in tokens),
                "logprobs": {
                    "text_offset": offsets,
                    "token_logprobs": [lp for _, lp in tokens],
                    "tokens": [t for t, _ in tokens],
                    "top_logprobs": [{t: lp, " the": lp - 2.0} for t, lp in tokens],
                },
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
                **choice,
            }
        ],
        "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2},
    }


def write_log(tmp_path, *records):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_chat_log_becomes_a_chat_trace(tokenizer, tmp_path):
    """A logged chat request + response is a chat trace: the request's messages rendered with
    the generation prompt, the logged tokens as ids, the logged logprobs as ref_logprobs."""
    path = write_log(tmp_path, {"request": CHAT_REQUEST, "response": chat_response()})
    trace = load_traces(path, format="openai", tokenizer=tokenizer)[0]
    assert trace.id == "chatcmpl-9d2f6c1e04a84b7b"
    assert trace.messages == CHAT_REQUEST["messages"]
    assert list(trace.trace_token_ids) == CHAT_IDS
    assert trace.ref_logprobs == tuple(lp for _, lp in CHAT_TOKENS)
    assert (
        list(trace.prompt_token_ids)
        == tokenizer.apply_chat_template(
            CHAT_REQUEST["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert trace.meta["finish_reason"] == "stop" and trace.meta["format"] == "openai"


def test_completions_log_becomes_a_text_prompt_trace(tokenizer, tmp_path):
    """A completions log gives the request's prompt text, encoded alone as the server did."""
    path = write_log(tmp_path, {"request": COMPLETION_REQUEST, "response": completion_response()})
    trace = load_traces(path, format="openai", tokenizer=tokenizer)[0]
    assert trace.prompt == COMPLETION_REQUEST["prompt"]
    assert list(trace.prompt_token_ids) == tokenizer.encode(COMPLETION_REQUEST["prompt"])
    assert list(trace.trace_token_ids) == [7042, 30]
    assert trace.ref_logprobs == (-0.4213, -0.8741)


def test_logged_token_ids_need_no_tokenizer(tmp_path):
    """A bare response carrying vLLM's token_ids and prompt_token_ids loads fully tokenized
    without a tokenizer."""
    response = completion_response(
        token_ids=[7042, 30], prompt_token_ids=[504, 3575, 282, 4649, 314]
    )
    trace = load_traces(write_log(tmp_path, response), format="openai")[0]
    assert trace.is_tokenized and trace.trace_token_ids == (7042, 30)
    assert trace.prompt_token_ids == (504, 3575, 282, 4649, 314)


def test_token_id_strings_are_ids(tmp_path):
    """Tokens logged as 'token_id:N' (vLLM --return-tokens-as-token-ids) are taken as ids."""
    response = chat_response([(f"token_id:{i}", lp) for i, (_, lp) in zip(CHAT_IDS, CHAT_TOKENS)])
    trace = load_traces(
        write_log(tmp_path, {"request": CHAT_REQUEST, "response": response}), format="openai"
    )[0]
    assert list(trace.trace_token_ids) == CHAT_IDS and trace.prompt_token_ids is None


def test_bytes_field_maps_tokens_inside_a_character(tokenizer, tmp_path):
    """Tokens holding part of a multi-byte character (text U+FFFD, ambiguous) are mapped by
    their raw bytes, as OpenAI logs them."""
    response = chat_response()
    response["choices"][0]["logprobs"]["content"] = [
        chat_entry("bytes:\\xf0\\x9f", -1.0, b"\xf0\x9f"),
        chat_entry("\\xa6", -0.1, b"\xa6"),
        chat_entry("\\x9c", -0.1, b"\x9c"),
        chat_entry(" ok", -0.5),
    ]
    trace = load_traces(
        write_log(tmp_path, {"request": CHAT_REQUEST, "response": response}),
        format="openai",
        tokenizer=tokenizer,
    )[0]
    assert list(trace.trace_token_ids) == tokenizer.encode("🦜 ok", add_special_tokens=False)


def test_tokens_that_do_not_round_trip_are_an_error(tokenizer, tmp_path):
    """Ids that decode to other text than the logged tokens (another model's log) are an error
    naming the record's line and trace."""
    wrong = chat_response(token_ids=[504, 3575, 282, 4649, 314, 7268, 30, 2])  # " Rome"
    path = write_log(
        tmp_path,
        {"request": CHAT_REQUEST, "response": chat_response()},
        {"request": CHAT_REQUEST, "response": {**wrong, "id": "chatcmpl-2"}},
    )
    with pytest.raises(
        TraceError,
        match=rf"^{path}:2: trace 'chatcmpl-2': the logged tokens do "
        r"not round-trip .* from character 25 they read "
        r"'Paris.<\|im_end\|>', their ids decode to 'Rome",
    ):
        load_traces(path, format="openai", tokenizer=tokenizer)


def test_token_outside_the_vocabulary_is_an_error(tokenizer, tmp_path):
    """A token the tokenizer does not have (a SentencePiece piece here) is named."""
    path = write_log(tmp_path, completion_response([("▁Paris", -0.4)]) | {"id": "cmpl-sp"})
    with pytest.raises(
        TraceError,
        match=rf"^{path}:1: trace 'cmpl-sp': token 0 '▁Paris' is not "
        "in the vocabulary",
    ):
        load_traces(path, format="openai", tokenizer=tokenizer)


def test_token_texts_without_a_tokenizer_are_an_error(tmp_path):
    """Token texts need the tokenizer to become ids; the error says how to give one."""
    path = write_log(tmp_path, {"request": CHAT_REQUEST, "response": chat_response()})
    with pytest.raises(
        TraceError,
        match=r":1: trace 'chatcmpl-9d2f6c1e04a84b7b': the log has "
        "token texts, not ids: pass tokenizer=",
    ):
        load_traces(path, format="openai")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            lambda record: record["response"]["choices"][0].update(logprobs=None),
            "the choice has no logprobs",
        ),
        (lambda record: record.pop("request"), "no prompt: log the request"),
        (
            lambda record: record["request"].update(continue_final_message=True),
            "the request sets continue_final_message",
        ),
        (
            lambda record: record["response"]["choices"][0]["logprobs"]["content"][3].update(
                logprob=None
            ),
            r"logprob of token 3 \(' France'\) is None",
        ),
    ],
)
def test_unusable_log_records_are_named(change, problem, tokenizer, tmp_path):
    """Records without logprobs or prompt, or with request options the importer cannot
    reproduce, are errors naming the line and the trace."""
    record = copy.deepcopy({"request": CHAT_REQUEST, "response": chat_response()})
    change(record)
    path = write_log(tmp_path, record)
    with pytest.raises(
        TraceError, match=rf"^{path}:1: trace 'chatcmpl-9d2f6c1e04a84b7b': {problem}"
    ):
        load_traces(path, format="openai", tokenizer=tokenizer)


def test_choices_and_batch_lines_become_traces(tokenizer, tmp_path):
    """Each choice of a response is a trace (id/INDEX); a batch-API output line is named by its
    custom_id and read from response.body."""
    two = completion_response()
    two["choices"].append({**two["choices"][0], "index": 1})
    batch = {
        "id": "batch_req_1",
        "custom_id": "paris-1",
        "error": None,
        "response": {"status_code": 200, "request_id": "r1", "body": completion_response()},
    }
    request = {**COMPLETION_REQUEST, "n": 2}
    path = write_log(
        tmp_path,
        {"request": request, "response": two},
        {
            **batch,
            "request": {
                "custom_id": "paris-1",
                "method": "POST",
                "url": "/v1/completions",
                "body": COMPLETION_REQUEST,
            },
        },
    )
    traces = load_traces(path, format="openai", tokenizer=tokenizer)
    assert traces.ids == ["cmpl-1b7e0a3f5c2d4e69/0", "cmpl-1b7e0a3f5c2d4e69/1", "paris-1"]
    assert {t.prompt for t in traces} == {COMPLETION_REQUEST["prompt"]}


def test_unknown_format_is_refused():
    """format names one of the known log formats."""
    with pytest.raises(ValueError, match="unknown format 'langchain'"):
        load_traces([], format="langchain")


@pytest.mark.slow
def test_imported_log_replays_with_its_logprobs(tokenizer, lm, tmp_path):
    """load → replay: the logged logprobs come back as ref_logprob beside the model's own."""
    from trace_replay.engines import make_engine
    from trace_replay.runs.replay import replay

    path = write_log(
        tmp_path,
        {"request": CHAT_REQUEST, "response": chat_response()},
        {"request": COMPLETION_REQUEST, "response": completion_response()},
    )
    traces = load_traces(path, format="openai", tokenizer=tokenizer)
    df = replay(traces, engine=make_engine("prefill", lm, top_k=2), progress=False)
    assert df["ref_logprob"].tolist() == [lp for _, lp in CHAT_TOKENS + COMPLETION_TOKENS]
    assert df.groupby("trace_id", sort=False)["token_id"].apply(list).tolist() == [
        CHAT_IDS,
        [7042, 30],
    ]
    assert df["role"].tolist() == ["assistant"] * len(CHAT_IDS) + [None, None]
