"""Trace records: load, validate, tokenize, shard and save the token traces to replay."""

from __future__ import annotations

import collections.abc
import gzip
import hashlib
import json
import numbers
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from trace_replay._io import write_atomic

if TYPE_CHECKING:
    import pandas

__all__ = ["Trace", "TraceError", "TraceSet", "load_traces"]

_ID_FIELDS = ("prompt_token_ids", "trace_token_ids")
_FIELDS = (
    "id", "prompt", "prompt_token_ids", "completion", "trace_token_ids", "ref_logprobs", "meta",
)


class TraceError(ValueError):
    """A trace record that cannot be replayed; ``str()`` reads ``LOCATION: trace 'ID': PROBLEM``.

    The location (``path:LINE``, ``path[INDEX]`` or ``SOURCE row INDEX``) and the trace id are
    left out of the message only when they are unknown.
    """

    def __init__(self, problem: str, *, trace_id: str | None = None, location: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.trace_id = trace_id
        self.location = location

    def __str__(self) -> str:
        trace = None if self.trace_id is None else f"trace {self.trace_id!r}"
        return ": ".join(part for part in (self.location, trace, self.problem) if part is not None)

    def at(self, location: str) -> TraceError:
        """Return the same error placed at ``location``."""
        return TraceError(self.problem, trace_id=self.trace_id, location=location)


@dataclass(frozen=True)
class Trace:
    """One record to replay: a prompt and the trace of tokens forced after it.

    Construction validates the record and normalizes the sequences to tuples of ``int`` and
    ``float``, so every ``Trace`` is well formed except for the vocabulary bound, which needs a
    model (`TraceSet.validate_vocab`). When both text and token ids are given, the ids win.
    """

    id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    completion: str | None = None
    trace_token_ids: tuple[int, ...] | None = None
    ref_logprobs: tuple[float, ...] | None = None  # one per trace token, as its producer reported
    meta: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise TraceError(f"id must be a non-empty str, got {self.id!r}")
        for name in ("prompt", "completion"):
            if not isinstance(getattr(self, name), (str, type(None))):
                self._fail(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name in _ID_FIELDS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, self._token_ids(name))
        if self.ref_logprobs is not None:
            object.__setattr__(self, "ref_logprobs", self._logprobs())
        if self.prompt is None and self.prompt_token_ids is None:
            self._fail("missing prompt: give 'prompt' or 'prompt_token_ids'")
        if self.completion is None and self.trace_token_ids is None:
            self._fail("missing trace: give 'trace_token_ids' or 'completion'")
        if self.trace_token_ids is None and self.completion == "":
            self._fail("completion is empty")
        if None not in (self.ref_logprobs, self.trace_token_ids):
            if len(self.ref_logprobs) != len(self.trace_token_ids):
                self._fail(f"ref_logprobs has {len(self.ref_logprobs)} values "
                           f"for {len(self.trace_token_ids)} trace tokens")
        if not isinstance(self.meta, dict):
            self._fail(f"meta must be a dict, got {type(self.meta).__name__}")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as error:
            self._fail(f"meta is not JSON-serializable: {error}")

    @property
    def is_tokenized(self) -> bool:
        """Whether both the prompt and the trace are token ids."""
        return self.prompt_token_ids is not None and self.trace_token_ids is not None

    def _fail(self, problem: str) -> NoReturn:
        raise TraceError(problem, trace_id=self.id)

    def _sequence(self, name: str, of: str) -> tuple:
        values = getattr(self, name)
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
            self._fail(f"{name} must be a list of {of}, got {type(values).__name__}")
        return tuple(values)

    def _token_ids(self, name: str) -> tuple[int, ...]:
        values = self._sequence(name, of="ints")
        if not values:
            self._fail(f"{name} is empty")
        for i, token_id in enumerate(values):
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                self._fail(f"{name}[{i}] = {token_id!r} is not an integer "
                           f"({type(token_id).__name__})")
            if token_id < 0:
                self._fail(f"{name}[{i}] = {token_id} is negative")
        return tuple(int(token_id) for token_id in values)

    def _logprobs(self) -> tuple[float, ...]:
        values = self._sequence("ref_logprobs", of="floats")
        for i, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                self._fail(f"ref_logprobs[{i}] = {value!r} is not a number")
        return tuple(float(value) for value in values)


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
        return f"TraceSet({len(self)} traces{tokenized}, source={self.source!r})"

    def tokenize(self, tokenizer: Any, *, vocab_size: int | None = None) -> TraceSet:
        """Return a copy whose every trace has ``prompt_token_ids`` and ``trace_token_ids``.

        Existing ids are kept. A prompt is encoded with the tokenizer's special tokens (e.g. BOS),
        a completion without them; the text fields are kept.

        Parameters
        ----------
        tokenizer : transformers tokenizer
            Anything with ``encode(text, add_special_tokens=...)`` and ``len()``.
        vocab_size : int, optional
            Exclusive bound on token ids; defaults to ``len(tokenizer)``.

        Raises
        ------
        TraceError
            If a text tokenizes to nothing, ``ref_logprobs`` does not match the trace length,
            or an id is out of vocabulary.
        """
        traces = []
        for trace in self:
            try:
                # Token ids are never empty, so `or` encodes exactly the missing ones.
                traces.append(replace(
                    trace,
                    prompt_token_ids=trace.prompt_token_ids or _encode(tokenizer, trace, "prompt"),
                    trace_token_ids=(trace.trace_token_ids
                                     or _encode(tokenizer, trace, "completion")),
                ))
            except TraceError as error:
                raise error.at(self._locations[trace.id]) from None
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
                            trace_id=trace.id, location=self._locations[trace.id],
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
            with _open_text(temporary, "w", gzipped=str(path).endswith(".gz")) as file:
                for trace in self:
                    file.write(json.dumps(_record(trace), ensure_ascii=False) + "\n")

        write_atomic(path, write)

    def to_parquet(self, path: str | os.PathLike) -> None:
        """Write a Parquet file: list columns for ids and logprobs, ``meta`` as a JSON string."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([
            ("id", pa.string()), ("prompt", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int64())), ("completion", pa.string()),
            ("trace_token_ids", pa.list_(pa.int64())), ("ref_logprobs", pa.list_(pa.float64())),
            ("meta", pa.string()),
        ])
        rows = [{**_record(trace), "meta": json.dumps(trace.meta)} for trace in self]
        table = pa.Table.from_pylist(rows, schema=schema)
        write_atomic(path, lambda temporary: pq.write_table(table, temporary))

    def to_pandas(self) -> pandas.DataFrame:
        """Return one row per trace: the record fields plus ``n_prompt_tokens``/``n_trace_tokens``.

        Missing values are ``None`` (``<NA>`` for the counts); ``attrs["source"]`` names the source.
        """
        import pandas as pd

        counts = ("n_prompt_tokens", "n_trace_tokens")
        rows = [
            {**dict.fromkeys(_FIELDS), **_record(trace),
             **{count: None if getattr(trace, name) is None else len(getattr(trace, name))
                for count, name in zip(counts, _ID_FIELDS)}}
            for trace in self
        ]
        frame = pd.DataFrame(rows, columns=[*_FIELDS, *counts])
        frame[list(counts)] = frame[list(counts)].astype("Int64")
        frame.attrs["source"] = self.source
        return frame

    def truncate(self, max_tokens: int) -> TraceSet:
        """Return a copy whose every trace has at most ``max_tokens`` trace tokens.

        A longer trace keeps its first ``max_tokens`` token ids and as many ``ref_logprobs``;
        its ``completion`` text is dropped, since it would no longer match the ids. Shorter
        traces are kept as they are.

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
                raise TraceError("has no trace_token_ids to truncate: token counts depend on "
                                 "the model, so tokenize first "
                                 "(traces.tokenize(tokenizer).truncate(max_tokens))",
                                 trace_id=trace.id, location=self._locations[trace.id])
            if len(trace.trace_token_ids) > max_tokens:
                ref = trace.ref_logprobs
                trace = replace(trace, completion=None,
                                trace_token_ids=trace.trace_token_ids[:max_tokens],
                                ref_logprobs=None if ref is None else ref[:max_tokens])
            traces.append(trace)
        return self._derive(traces)

    def _derive(self, traces: Iterable[Trace]) -> TraceSet:
        derived = TraceSet(traces, source=self.source)
        derived._locations = self._locations  # read-only, and covers every id of a derived set
        return derived


def load_traces(
    source: str | os.PathLike | TraceSet | Iterable[Mapping[str, Any]] | Any,
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
) -> TraceSet:
    """Load and validate trace records; return all of them or raise at the first bad one.

    Each record has an ``id`` (an int id becomes its decimal str), a prompt as ``prompt`` text
    and/or ``prompt_token_ids``, a trace as ``trace_token_ids`` and/or ``completion`` text, and
    optionally ``ref_logprobs`` (one per trace token) and ``meta`` (a JSON object, or that
    object as a JSON string, as Parquet stores it). Other keys are ignored.

    Parameters
    ----------
    source : path, TraceSet, DataFrame, Dataset or iterable of mappings
        A ``.jsonl``, ``.json`` (a list or ``{"traces": [...]}``) or ``.parquet`` path (JSON may
        be gzipped, ``.gz``); a pandas DataFrame; anything with ``.to_pandas()`` such as a Hugging
        Face ``datasets.Dataset``; an iterable of mappings; or a TraceSet, returned as is.
    tokenizer : transformers tokenizer, optional
        If given, the result is ``.tokenize(tokenizer, vocab_size=vocab_size)``.
    vocab_size : int, optional
        Exclusive bound on token ids (checked on the ids present when there is no tokenizer).

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
    TraceSet(1 traces, tokenized, source='<list>')
    >>> traces[0].trace_token_ids
    (3,)
    """
    traces = source if isinstance(source, TraceSet) else _build(*_rows(source))
    if tokenizer is not None:
        return traces.tokenize(tokenizer, vocab_size=vocab_size)
    if vocab_size is not None:
        traces.validate_vocab(vocab_size)
    return traces


def _rows(source: Any) -> tuple[str, Iterable[tuple[str, Any]]]:
    """Return the source's name and its (location, record) pairs."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        kind = path.name.removesuffix(".gz").rpartition(".")[2]
        readers = {"jsonl": _jsonl_rows, "json": _json_rows, "parquet": _parquet_rows}
        if kind not in readers:
            raise TraceError("unknown trace file type (expected .jsonl, .json or .parquet)",
                             location=str(path))
        return str(path), readers[kind](path)
    name = f"<{type(source).__name__}>"
    if hasattr(source, "to_pandas"):
        source = source.to_pandas()
    # A DataFrame can only exist once pandas is imported; loading plain records never imports it.
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(source, pd.DataFrame):
        return name, _frame_rows(name, source)
    if isinstance(source, (Mapping, bytes)) or not isinstance(source, Iterable):
        raise TypeError(f"cannot load traces from {type(source).__name__}")
    return name, ((f"{name} row {i}", record) for i, record in enumerate(source))


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_text(path, "r", gzipped=path.suffix == ".gz") as file:
        for line_number, line in enumerate(file, start=1):
            if line.strip():
                location = f"{path}:{line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise TraceError(f"malformed JSON: {error.msg} (column {error.colno})",
                                     location=location) from None
                yield location, record


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_text(path, "r", gzipped=path.suffix == ".gz") as file:
        try:
            data = json.load(file)
        except json.JSONDecodeError as error:
            raise TraceError(f"malformed JSON: {error.msg} (column {error.colno})",
                             location=f"{path}:{error.lineno}") from None
    if isinstance(data, dict) and "traces" in data:
        data = data["traces"]
    if not isinstance(data, list):
        raise TraceError('expected a list of records or {"traces": [...]}', location=str(path))
    return ((f"{path}[{i}]", record) for i, record in enumerate(data))


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    records = pq.read_table(path).to_pylist()
    return ((f"{path} row {i}", record) for i, record in enumerate(records))


def _frame_rows(name: str, frame: pandas.DataFrame) -> Iterator[tuple[str, Any]]:
    import pandas as pd

    for i, record in enumerate(frame.to_dict("records")):
        # Tabular sources mark a missing field with a null scalar (None, NaN, NA).
        present = {key: value for key, value in record.items()
                   if not (pd.api.types.is_scalar(value) and pd.isna(value))}
        yield f"{name} row {i}", present


def _build(name: str, rows: Iterable[tuple[str, Any]]) -> TraceSet:
    traces, locations = [], []
    for location, record in rows:
        traces.append(_parse(record, location))
        locations.append(location)
    _check_unique(traces, locations)
    trace_set = TraceSet(traces, source=name)
    trace_set._locations = dict(zip(trace_set.ids, locations))
    return trace_set


def _parse(record: Any, location: str) -> Trace:
    if not isinstance(record, Mapping):
        raise TraceError(f"expected a record, got {type(record).__name__}", location=location)
    trace_id = record.get("id")
    if trace_id is None:
        raise TraceError("missing 'id'", location=location)
    if isinstance(trace_id, numbers.Integral) and not isinstance(trace_id, bool):
        trace_id = str(int(trace_id))
    elif not isinstance(trace_id, str):
        raise TraceError(f"id must be a str or int, got {type(trace_id).__name__} {trace_id!r}",
                         location=location)
    meta = record.get("meta")
    try:
        if isinstance(meta, str):
            meta = json.loads(meta)
        return Trace(trace_id, meta={} if meta is None else meta,
                     **{name: record.get(name) for name in _FIELDS if name not in ("id", "meta")})
    except json.JSONDecodeError as error:
        raise TraceError(f"meta is not valid JSON: {error.msg}", trace_id=trace_id,
                         location=location) from None
    except TraceError as error:
        raise error.at(location) from None


def _check_unique(traces: Iterable[Trace], locations: Iterable[str]) -> None:
    first_location: dict[str, str] = {}
    for trace, location in zip(traces, locations):
        if trace.id in first_location:
            raise TraceError(f"duplicate id (first at {first_location[trace.id]})",
                             trace_id=trace.id, location=location)
        first_location[trace.id] = location


def _encode(tokenizer: Any, trace: Trace, name: str) -> list[int]:
    # Prompts get the special tokens a request would (e.g. BOS); a trace is pure continuation.
    token_ids = tokenizer.encode(getattr(trace, name), add_special_tokens=name == "prompt")
    if not token_ids:
        raise TraceError(f"{name} tokenizes to no tokens", trace_id=trace.id)
    return token_ids


def _shard_of(trace_id: str, count: int) -> int:
    # hashlib, not hash(): str hashes are salted per process, and shards must agree across jobs.
    digest = hashlib.sha256(trace_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def _id_set(ids: str | Iterable[str]) -> set[str]:
    return {ids} if isinstance(ids, str) else {str(trace_id) for trace_id in ids}


def _record(trace: Trace) -> dict[str, Any]:
    """The trace as a JSON-ready dict, without its missing fields."""
    values = {name: getattr(trace, name) for name in _FIELDS}
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in values.items() if value is not None}


def _open_text(path: str | os.PathLike, mode: str, *, gzipped: bool) -> IO[str]:
    if gzipped:
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")
