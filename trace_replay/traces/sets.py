"""Trace sets: load, validate, tokenize, shard and save the token traces to replay."""

from __future__ import annotations

import collections.abc
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_replay._io import write_atomic
from trace_replay.traces.chat import tokenize_chat_trace
from trace_replay.traces.openai_logs import import_openai
from trace_replay.traces.sources import open_text, parse_record, read_records
from trace_replay.traces.tokenization import tokenize_text_trace
from trace_replay.traces.trace import FIELDS, JSON_FIELDS, TURNS, Trace, TraceError
from trace_replay.wording import plural

if TYPE_CHECKING:
    import pandas

__all__ = ["Trace", "TraceError", "TraceSet", "load_traces"]

FORMATS = ("traces", "openai")  # what load_traces reads: trace records, OpenAI-compatible logs
_ID_FIELDS = ("prompt_token_ids", "trace_token_ids")
# one value per trace token: cut together
_PER_TOKEN = ("trace_token_ids", "ref_logprobs", "trace_turns", "trace_roles")


class TraceSet(collections.abc.Sequence):
    """An ordered sequence of traces with unique ids.

    Derived sets (slices, `select`, `exclude`, `shard`, `tokenize`) keep the traces' order and
    remember where each trace was loaded from, so later errors still name its file line or row.

    Parameters
    ----------
    traces : iterable of Trace
        The traces, in replay order; their ids must be unique.
    source : str, optional
        Where the traces came from, used in error messages.
    """

    def __init__(self, traces: Iterable[Trace], *, source: str = "<memory>") -> None:
        self._traces = tuple(traces)
        self.source = source
        for trace in self._traces:
            if not isinstance(trace, Trace):
                raise TypeError(f"TraceSet holds Trace objects, got {type(trace).__name__}")
        locations = [f"{source} row {i}" for i in range(len(self._traces))]
        _check_unique(self._traces, locations)
        self._locations = dict(zip(self.ids, locations))

    @property
    def ids(self) -> list[str]:
        """The trace ids, in order."""
        return [trace.id for trace in self._traces]

    def location(self, trace_id: str) -> str:
        """Where trace ``trace_id`` was read from: ``path:LINE``, ``path[INDEX]`` or a row."""
        return self._locations[trace_id]

    def __len__(self) -> int:
        return len(self._traces)

    def __getitem__(self, index: int | slice) -> Trace | TraceSet:
        if isinstance(index, slice):
            return self._derive(self._traces[index])
        return self._traces[index]

    def __iter__(self) -> Iterator[Trace]:
        return iter(self._traces)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceSet):
            return NotImplemented
        return self._traces == other._traces

    def __repr__(self) -> str:
        tokenized = ", tokenized" if all(trace.is_tokenized for trace in self) else ""
        return f"TraceSet({plural(len(self), 'trace')}{tokenized}, source={self.source!r})"

    def tokenize(self, tokenizer: Any, *, vocab_size: int | None = None) -> TraceSet:
        """Return a copy whose every trace has ``prompt_token_ids`` and ``trace_token_ids``.

        Existing ids are kept; text fields and messages are kept too.

        * Prompt and completion text: tokenized together, as the model sees the joined text,
          and split at the prompt's end (`trace_replay.traces.tokenization`). A token straddling the
          boundary belongs to the trace, and the prompt characters it carries are recorded
          in ``meta["prompt_tail_in_trace"]``.
        * Only one of them as text: a prompt is encoded with the tokenizer's special tokens
          (e.g. BOS), a completion without them.
        * ``messages``: rendered with the tokenizer's chat template (`trace_replay.traces.chat`);
          the trace is the last assistant turn, or every turn from the first assistant one
          when ``turns="all"``, and ``trace_turns``/``trace_roles`` label each trace token.
          With ``trace_token_ids`` given, the messages are the prompt, rendered with the
          generation prompt, and every trace token is labelled an assistant token.

        Parameters
        ----------
        tokenizer : transformers tokenizer
            With ``encode``, ``decode`` and ``len()``; chat traces need its chat template.
        vocab_size : int, optional
            Exclusive bound on token ids; defaults to ``len(tokenizer)``.

        Raises
        ------
        TraceError
            If a text tokenizes to nothing, a chat trace cannot be rendered, ``ref_logprobs``
            does not match the trace length, or an id is out of vocabulary.
        """
        traces = []
        for trace in self:
            if trace.is_tokenized and not trace.is_chat:  # nothing to fill in
                traces.append(trace)
                continue
            try:
                tokenize = tokenize_chat_trace if trace.is_chat else tokenize_text_trace
                traces.append(tokenize(trace, tokenizer))
            except TraceError as error:
                raise TraceError(
                    error.problem, trace_id=trace.id, location=self._locations[trace.id]
                ) from None
        tokenized = self._derive(traces)
        tokenized.validate_vocab(len(tokenizer) if vocab_size is None else vocab_size)
        return tokenized

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise `TraceError` at the first token id that is not below ``vocab_size``."""
        for trace in self:
            for name in _ID_FIELDS:
                for i, token_id in enumerate(getattr(trace, name) or ()):
                    if token_id >= vocab_size:
                        raise TraceError(
                            f"{name}[{i}] = {token_id} is out of vocab (vocab_size={vocab_size})",
                            trace_id=trace.id,
                            location=self._locations[trace.id],
                        )

    def shard(self, index: int, count: int) -> TraceSet:
        """Return shard ``index`` of ``count``: the traces whose id hashes to ``index``.

        A trace's shard depends only on its id, so shards agree across processes and machines,
        partition the set, and do not move when other traces are added or reordered.
        """
        if not 0 <= index < count:
            raise ValueError(f"shard needs 0 <= index < count, got index={index}, count={count}")
        return self._derive(trace for trace in self if _shard_of(trace.id, count) == index)

    def select(self, ids: str | Iterable[str]) -> TraceSet:
        """Return the traces with these ids, in this set's order; unknown ids raise `KeyError`."""
        wanted = _id_set(ids)
        unknown = wanted.difference(self.ids)
        if unknown:
            raise KeyError(f"{self.source}: no traces with ids {sorted(unknown)}")
        return self._derive(trace for trace in self if trace.id in wanted)

    def exclude(self, ids: str | Iterable[str]) -> TraceSet:
        """Return the traces without these ids, in this set's order; unknown ids are ignored."""
        unwanted = _id_set(ids)
        return self._derive(trace for trace in self if trace.id not in unwanted)

    def to_jsonl(self, path: str | os.PathLike) -> None:
        """Write one JSON record per line (gzip-compressed if ``path`` ends in ``.gz``)."""

        def write(temporary: Path) -> None:
            with open_text(temporary, "w", gzipped=str(path).lower().endswith(".gz")) as file:
                for trace in self:
                    file.write(json.dumps(_record(trace), ensure_ascii=False) + "\n")

        write_atomic(path, write)

    def to_parquet(self, path: str | os.PathLike) -> None:
        """Write a Parquet file: list columns for ids and logprobs, ``meta`` as a JSON string."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [
                ("id", pa.string()),
                ("prompt", pa.string()),
                ("prompt_token_ids", pa.list_(pa.int64())),
                ("completion", pa.string()),
                ("trace_token_ids", pa.list_(pa.int64())),
                ("ref_logprobs", pa.list_(pa.float64())),
                ("meta", pa.string()),
                ("messages", pa.string()),
                ("tools", pa.string()),
                ("turns", pa.string()),
                ("trace_turns", pa.list_(pa.int64())),
                ("trace_roles", pa.list_(pa.string())),
            ]
        )
        rows = [
            {
                **_record(trace),
                **{
                    name: json.dumps(getattr(trace, name))
                    for name in JSON_FIELDS
                    if getattr(trace, name) is not None
                },
            }
            for trace in self
        ]
        table = pa.Table.from_pylist(rows, schema=schema)
        write_atomic(path, lambda temporary: pq.write_table(table, temporary))

    def to_pandas(self) -> pandas.DataFrame:
        """Return one row per trace: the record fields plus ``n_prompt_tokens``/``n_trace_tokens``.

        Missing values are ``None`` (``<NA>`` for the counts); ``attrs["source"]`` names the source.
        """
        import pandas as pd

        counts = ("n_prompt_tokens", "n_trace_tokens")
        rows = [
            {
                **dict.fromkeys(FIELDS),
                **_record(trace),
                **{
                    count: None if getattr(trace, name) is None else len(getattr(trace, name))
                    for count, name in zip(counts, _ID_FIELDS)
                },
            }
            for trace in self
        ]
        frame = pd.DataFrame(rows, columns=[*FIELDS, *counts])
        frame[list(counts)] = frame[list(counts)].astype("Int64")
        frame.attrs["source"] = self.source
        return frame

    def truncate(self, max_tokens: int) -> TraceSet:
        """Return a copy whose every trace has at most ``max_tokens`` trace tokens.

        A longer trace keeps its first ``max_tokens`` token ids and as many ``ref_logprobs``
        (and chat labels ``trace_turns``, ``trace_roles``); its ``completion`` text is
        dropped, since it would no longer match the ids (a chat trace's ``messages`` stay:
        ids win over them). Shorter traces are kept as they are.

        Parameters
        ----------
        max_tokens : int
            Trace tokens kept per trace, at least 1.

        Raises
        ------
        TraceError
            If a trace has no ``trace_token_ids`` yet (text only): token counts depend on the
            model, so tokenize first, ``traces.tokenize(tokenizer).truncate(max_tokens)``.

        Examples
        --------
        >>> traces = load_traces([{"id": "a", "prompt_token_ids": [1], "trace_token_ids": [5, 6, 7],
        ...                        "ref_logprobs": [-0.1, -0.2, -0.3]}])
        >>> cut = traces.truncate(2)[0]
        >>> cut.trace_token_ids, cut.ref_logprobs
        ((5, 6), (-0.1, -0.2))
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        traces = []
        for trace in self:
            if trace.trace_token_ids is None:
                raise TraceError(
                    "has no trace_token_ids to truncate: token counts depend on "
                    "the model, so tokenize first "
                    "(traces.tokenize(tokenizer).truncate(max_tokens))",
                    trace_id=trace.id,
                    location=self._locations[trace.id],
                )
            if len(trace.trace_token_ids) > max_tokens:
                per_token = {
                    name: getattr(trace, name)[:max_tokens]
                    for name in _PER_TOKEN
                    if getattr(trace, name) is not None
                }
                trace = replace(trace, completion=None, **per_token)
            traces.append(trace)
        return self._derive(traces)

    def _derive(self, traces: Iterable[Trace]) -> TraceSet:
        derived = TraceSet(traces, source=self.source)
        derived._locations = self._locations  # read-only, and covers every id of a derived set
        return derived


def load_traces(
    source: str | os.PathLike | TraceSet | Iterable[Mapping[str, Any]] | Any,
    *,
    format: str = "traces",
    tokenizer: Any = None,
    vocab_size: int | None = None,
    turns: str | None = None,
) -> TraceSet:
    """Load and validate trace records; return all of them or raise at the first bad one.

    Each record has an ``id`` (an int id becomes its decimal str), and either

    * a prompt as ``prompt`` text and/or ``prompt_token_ids``, and a trace as
      ``trace_token_ids`` and/or ``completion`` text (text is tokenized with prompt and
      completion together, see `TraceSet.tokenize`; ids win over text), or
    * ``messages``, a conversation in OpenAI chat format, optionally with ``tools`` and
      ``turns`` (``"last"``, the default, or ``"all"``): rendered with the model's chat
      template, its last assistant turn (or all of them) is the trace;

    and optionally ``ref_logprobs`` (one per trace token, finite and <= 0) and ``meta`` (a
    JSON object, or that object as a JSON string, as Parquet stores it). Other keys are
    ignored, each named once per source with an ``UnknownFieldWarning`` (its first location
    and the closest field name, e.g. ``trace_tokens_ids``: did you mean ``trace_token_ids``?).

    Parameters
    ----------
    source : path, TraceSet, DataFrame, Dataset or iterable of mappings
        A ``.jsonl``, ``.json`` (a list or ``{"traces": [...]}``) or ``.parquet`` path (JSON may
        be gzipped, ``.gz``); a pandas DataFrame; anything with ``.to_pandas()`` such as a Hugging
        Face ``datasets.Dataset``; an iterable of mappings; or a TraceSet, returned as is.
    format : {"traces", "openai"}
        ``"openai"`` reads logs of an OpenAI-compatible server (`trace_replay.traces.openai_logs`):
        chat-completions or completions responses with ``logprobs``, bare or as
        ``{"request": ..., "response": ...}``; the logged logprobs become ``ref_logprobs``.
        Mapping logged token texts to ids needs ``tokenizer`` (the server's model's).
    tokenizer : transformers tokenizer, optional
        If given, the result is ``.tokenize(tokenizer, vocab_size=vocab_size)``.
    vocab_size : int, optional
        Exclusive bound on token ids (checked on the ids present when there is no tokenizer).
    turns : {"last", "all"}, optional
        Sets ``turns`` on every chat trace (those with ``messages``), overriding the records.

    Returns
    -------
    TraceSet

    Raises
    ------
    TraceError
        Naming the location (``path:LINE``, ``path[INDEX]`` or ``SOURCE row INDEX``) and the
        trace id of the first invalid record.

    Examples
    --------
    >>> traces = load_traces([{"id": "a", "prompt_token_ids": [1, 2], "trace_token_ids": [3]}])
    >>> traces
    TraceSet(1 trace, tokenized, source='<list>')
    >>> traces[0].trace_token_ids
    (3,)
    >>> chat = load_traces([{"id": "c", "messages": [{"role": "user", "content": "Hi"},
    ...                                               {"role": "assistant", "content": "Hello!"}]}])
    >>> chat[0].is_chat
    True
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if turns is not None and turns not in TURNS:
        raise ValueError(f"turns must be one of {', '.join(map(repr, TURNS))}, got {turns!r}")
    if isinstance(source, TraceSet):
        traces = source
    else:
        name, rows = read_records(source)
        records = rows if format == "traces" else import_openai(rows, tokenizer)
        traces = _build(name, records, turns)
    if tokenizer is not None:
        return traces.tokenize(tokenizer, vocab_size=vocab_size)
    if vocab_size is not None:
        traces.validate_vocab(vocab_size)
    return traces


def _build(name: str, rows: Iterable[tuple[str, Any]], turns: str | None) -> TraceSet:
    traces, locations, reported = [], [], set()
    for location, record in rows:
        trace = parse_record(record, location, reported=reported)
        if turns is not None and trace.is_chat:
            trace = replace(trace, turns=turns)
        traces.append(trace)
        locations.append(location)
    _check_unique(traces, locations)
    trace_set = TraceSet(traces, source=name)
    trace_set._locations = dict(zip(trace_set.ids, locations))
    return trace_set


def _check_unique(traces: Iterable[Trace], locations: Iterable[str]) -> None:
    first_location: dict[str, str] = {}
    for trace, location in zip(traces, locations):
        if trace.id in first_location:
            raise TraceError(
                f"duplicate id (first at {first_location[trace.id]})",
                trace_id=trace.id,
                location=location,
            )
        first_location[trace.id] = location


def _shard_of(trace_id: str, count: int) -> int:
    # hashlib, not hash(): str hashes are salted per process, and shards must agree across jobs.
    digest = hashlib.sha256(trace_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def _id_set(ids: str | Iterable[str]) -> set[str]:
    return {ids} if isinstance(ids, str) else {str(trace_id) for trace_id in ids}


def _record(trace: Trace) -> dict[str, Any]:
    """The trace as a JSON-ready dict, without its missing fields."""
    values = {name: getattr(trace, name) for name in FIELDS}
    return {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in values.items()
        if value is not None
    }
