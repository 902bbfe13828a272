"""Traces from the logs of OpenAI-compatible servers (``load_traces(..., format="openai")``).

A log record is a chat-completions or completions response, bare, as
``{"request": ..., "response": ...}``, or as a batch-API line (``custom_id``, ``response.body``).
Each choice with ``logprobs`` becomes one trace:

* the trace tokens are the logged tokens (chat: ``choices[i].logprobs.content[*]``, completions:
  ``choices[i].logprobs.tokens``) and ``ref_logprobs`` their logged logprobs;
* token ids come from the response's ``token_ids`` (vLLM ``return_token_ids``), from
  ``token_id:N`` strings (vLLM ``--return-tokens-as-token-ids``), or else from the tokenizer's
  vocabulary, looking each token up by its ``bytes`` (chat) or its text;
* the prompt is the response's ``prompt_token_ids`` (vLLM ``return_token_ids``), or the
  request's ``messages`` (and ``tools``), rendered later with the chat template and the
  generation prompt, or its ``prompt`` text or ids.

With a tokenizer, the ids must decode to the logged token texts joined together, so a log from
another model's tokenizer, or tokens that were looked up wrongly, is an error naming the record.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from trace_replay.traces.trace import TraceError

__all__ = ["import_openai", "openai_records"]

_TOKEN_ID = re.compile(r"token_id:(\d+)")  # vLLM --return-tokens-as-token-ids
# Chat request options that change the prompt in ways rendering `messages` would not repeat.
_CHAT_OPTIONS = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "add_special_tokens": False,
}


def import_openai(
    rows: Iterable[tuple[str, Any]], tokenizer: Any = None
) -> Iterable[tuple[str, Any]]:
    """Turn ``(location, log record)`` pairs into ``(location, trace record)`` pairs."""
    vocabulary = _Vocabulary(tokenizer)
    return (
        (location, record)
        for location, raw in rows
        for record in openai_records(raw, location, vocabulary)
    )


def openai_records(raw: Any, location: str, vocabulary: _Vocabulary) -> list[dict]:
    """The trace records (one per choice) of one logged response."""
    request, response, record_id = _unwrap(raw, location)
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TraceError("response has no choices", location=location)
    base_id = record_id or response.get("id")
    if not isinstance(base_id, str) or not base_id:
        raise TraceError("the response has no 'id' to name its traces", location=location)
    records = []
    for position, choice in enumerate(choices):
        index = choice.get("index", position)
        trace_id = base_id if len(choices) == 1 else f"{base_id}/{index}"
        try:
            record = _choice_record(choice, request, response, vocabulary)
        except TraceError as error:
            raise TraceError(error.problem, trace_id=trace_id, location=location) from None
        meta = {
            "format": "openai",
            "response_id": response.get("id"),
            "model": response.get("model"),
            "finish_reason": choice.get("finish_reason"),
        }
        records.append(
            {"id": trace_id, **record, "meta": {k: v for k, v in meta.items() if v is not None}}
        )
    return records


def _unwrap(raw: Any, location: str) -> tuple[Mapping, Mapping, str | None]:
    """(request or {}, response, the record's own id) of one log record."""
    if not isinstance(raw, Mapping):
        raise TraceError(f"expected a log record, got {type(raw).__name__}", location=location)
    if "choices" in raw:
        return {}, raw, None
    response = raw.get("response")
    if not isinstance(response, Mapping):
        raise TraceError(
            'expected an OpenAI response (with \'choices\') or {"request": ..., "response": ...}',
            location=location,
        )
    response = response.get("body", response)  # batch-API output line
    request = raw.get("request") or {}
    request = request.get("body", request)  # batch-API input line
    if response.get("object") in ("chat.completion.chunk", "text_completion.chunk"):
        raise TraceError(
            "streamed chunks are not supported: log the whole response", location=location
        )
    return request, response, raw.get("custom_id") or raw.get("id")


def _choice_record(
    choice: Mapping, request: Mapping, response: Mapping, vocabulary: _Vocabulary
) -> dict:
    logprobs = choice.get("logprobs")
    if not logprobs:
        raise TraceError("the choice has no logprobs (request them: logprobs=true/1)")
    chat = "message" in choice
    if chat:
        entries = logprobs.get("content") or []
        texts = [entry.get("token") for entry in entries]
        values = [entry.get("logprob") for entry in entries]
        keys = [
            bytes(entry["bytes"]) if entry.get("bytes") is not None else None for entry in entries
        ]
    else:
        texts, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        keys = [None] * len(texts)
        if request.get("echo"):
            raise TraceError("echo=true logs score the prompt too; log without echo")
    if not texts or len(texts) != len(values):
        raise TraceError(f"logprobs hold {len(texts)} tokens and {len(values)} logprobs")
    for i, (text, value) in enumerate(zip(texts, values)):
        if not isinstance(text, str):
            raise TraceError(f"token {i} is not a str: {text!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TraceError(f"logprob of token {i} ({text!r}) is {value!r}")
    keys = [key if key is not None else text.encode("utf-8") for key, text in zip(keys, texts)]
    token_ids = choice.get("token_ids") or vocabulary.token_ids(texts, keys)
    if len(token_ids) != len(texts):
        raise TraceError(f"token_ids has {len(token_ids)} ids for {len(texts)} logged tokens")
    vocabulary.check_round_trip(token_ids, texts, keys)
    record = {"trace_token_ids": list(token_ids), "ref_logprobs": [float(v) for v in values]}
    record.update(_chat_prompt(request, response) if chat else _completion_prompt(choice, request))
    return record


def _chat_prompt(request: Mapping, response: Mapping) -> dict:
    if response.get("prompt_token_ids"):
        prompt = {"prompt_token_ids": response["prompt_token_ids"]}
        return {**prompt, **({"messages": request["messages"]} if request.get("messages") else {})}
    if not request.get("messages"):
        raise TraceError(
            "no prompt: log the request with the response, or request "
            "return_token_ids so the response carries prompt_token_ids"
        )
    changed = sorted(
        name for name, default in _CHAT_OPTIONS.items() if request.get(name, default) != default
    )
    if changed:
        raise TraceError(
            f"the request sets {', '.join(changed)}, which rendering its messages "
            "would not repeat; request return_token_ids to log the prompt's ids"
        )
    prompt = {"messages": request["messages"]}
    return {**prompt, **({"tools": request["tools"]} if request.get("tools") else {})}


def _completion_prompt(choice: Mapping, request: Mapping) -> dict:
    if choice.get("prompt_token_ids"):
        return {"prompt_token_ids": choice["prompt_token_ids"]}
    prompt = request.get("prompt")
    if prompt is None:
        raise TraceError(
            "no prompt: log the request with the response, or request "
            "return_token_ids so the response carries prompt_token_ids"
        )
    if request.get("add_special_tokens") is False:
        raise TraceError(
            "the request sets add_special_tokens=false; request return_token_ids "
            "to log the prompt's ids"
        )
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        # A batch of prompts: choice index = prompt index * n + sample index.
        prompt = prompt[choice.get("index", 0) // (request.get("n") or 1)]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": prompt}


class _Vocabulary:
    """Maps logged tokens to ids with a tokenizer, built on first use."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[bytes, set[int]] | None = None

    def token_ids(self, texts: list[str], keys: list[bytes]) -> list[int]:
        """Ids of logged tokens: ``token_id:N`` strings, else looked up by their bytes."""
        placeholders = [_TOKEN_ID.fullmatch(text) for text in texts]
        if all(placeholders):
            return [int(match.group(1)) for match in placeholders]
        if self.tokenizer is None:
            raise TraceError(
                "the log has token texts, not ids: pass tokenizer= (the server's "
                "model's) to map them, or log with return_token_ids"
            )
        ids = []
        for i, (text, key, match) in enumerate(zip(texts, keys, placeholders)):
            if match:
                ids.append(int(match.group(1)))
                continue
            found = self._lookup().get(key, set())
            if len(found) != 1:
                what = (
                    "is not in the vocabulary"
                    if not found
                    else (f"matches {len(found)} vocabulary entries")
                )
                raise TraceError(
                    f"token {i} {text!r} {what}; log token ids instead "
                    "(vLLM: return_token_ids or --return-tokens-as-token-ids)"
                )
            ids.append(next(iter(found)))
        return ids

    def check_round_trip(self, ids: list[int], texts: list[str], keys: list[bytes]) -> None:
        """Raise unless ``ids`` decode to the logged tokens' bytes joined together."""
        if self.tokenizer is None or any(_TOKEN_ID.fullmatch(text) for text in texts):
            return
        logged = b"".join(keys).decode("utf-8", errors="replace")
        decoded = self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if decoded != logged:
            at = next(
                (i for i, (a, b) in enumerate(zip(logged, decoded)) if a != b),
                min(len(logged), len(decoded)),
            )
            raise TraceError(
                "the logged tokens do not round-trip through the tokenizer (is it the server's "
                f"model's?): from character {at} they read {logged[at : at + 30]!r}, "
                f"their ids decode to {decoded[at : at + 30]!r}"
            )

    def _lookup(self) -> dict[bytes, set[int]]:
        if self._ids is None:
            ids: dict[bytes, set[int]] = {}
            for token_id, key in _token_bytes(self.tokenizer):
                ids.setdefault(key, set()).add(token_id)
            self._ids = ids
        return self._ids


def _token_bytes(tokenizer: Any) -> Iterator[tuple[int, bytes]]:
    """(id, bytes) for every token: its decoded text's UTF-8 and, for byte-level BPE, the raw
    bytes (which differ for tokens holding part of a multi-byte character)."""
    token_ids = range(len(tokenizer))
    texts = tokenizer.batch_decode(
        [[i] for i in token_ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    for token_id, text in zip(token_ids, texts):
        yield token_id, text.encode("utf-8")
    byte_of = _byte_level_alphabet(tokenizer)
    if byte_of:
        for token_id, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids))):
            if piece is not None and all(char in byte_of for char in piece):
                yield token_id, bytes(byte_of[char] for char in piece)


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int]:
    """Byte-level BPE's character → byte map, or {} for other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return {}
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
