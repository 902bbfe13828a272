"""Where trace records come from: files, DataFrames, datasets and iterables of mappings.

Every reader yields ``(location, record)`` pairs, the location naming the record for errors:
``path:LINE`` (JSONL, 1-based, blank lines counted), ``path[INDEX]`` (JSON) or
``SOURCE row INDEX`` (Parquet, DataFrames, datasets, iterables). A key or column that is no
`Trace` field is ignored with an `UnknownFieldWarning`, whatever the source.
"""

from __future__ import annotations

import codecs
import difflib
import gzip
import json
import numbers
import os
import sys
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trace_replay.traces.trace import FIELDS, JSON_FIELDS, Trace, TraceError

if TYPE_CHECKING:
    import pandas

__all__ = ["UnknownFieldWarning", "open_text", "parse_record", "read_records"]

# keys that are no Trace field but are expected: TraceSet.to_pandas's counts, pandas' index
_IGNORED = ("n_prompt_tokens", "n_trace_tokens")
_PANDAS_INDEX = "__index_level_"


class UnknownFieldWarning(UserWarning):
    """A trace record has a key that is no trace field (a typo, or data the replay ignores)."""


def read_records(source: Any) -> tuple[str, Iterable[tuple[str, Any]]]:
    """Return the source's name and its (location, record) pairs.

    ``source`` is a ``.jsonl``, ``.json`` or ``.parquet`` path (JSON may be gzipped), a pandas
    DataFrame, anything with ``.to_pandas()``, or an iterable of mappings.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        kind = path.name.lower().removesuffix(".gz").rpartition(".")[2]
        readers = {"jsonl": _jsonl_rows, "json": _json_rows, "parquet": _parquet_rows}
        if kind not in readers:
            raise TraceError(
                "unknown trace file type (expected .jsonl, .json or .parquet)", location=str(path)
            )
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


def parse_record(record: Any, location: str, *, reported: set[str] | None = None) -> Trace:
    """Validate one raw record as a `Trace`; errors name ``location`` and the trace id.

    Keys that are no trace field are ignored with an `UnknownFieldWarning` naming the key,
    ``location`` and the closest field name (a key holding null is not named: nothing is
    lost); a key already in ``reported`` (a set the caller keeps across the records of one
    source) is not named again, and is added to it.
    """
    if not isinstance(record, Mapping):
        raise TraceError(f"expected a record, got {type(record).__name__}", location=location)
    _warn_unknown(record, location, set() if reported is None else reported)
    trace_id = record.get("id")
    if trace_id is None:
        raise TraceError("missing 'id'", location=location)
    if isinstance(trace_id, numbers.Integral) and not isinstance(trace_id, bool):
        trace_id = str(int(trace_id))
    elif not isinstance(trace_id, str):
        raise TraceError(
            f"id must be a str or int, got {type(trace_id).__name__} {trace_id!r}",
            location=location,
        )
    fields = {name: record.get(name) for name in FIELDS if name != "id"}
    for name in JSON_FIELDS:
        if isinstance(fields[name], str):
            try:
                fields[name] = json.loads(fields[name])
            except json.JSONDecodeError as error:
                raise TraceError(
                    f"{name} is not valid JSON: {error.msg}", trace_id=trace_id, location=location
                ) from None
    if fields["meta"] is None:
        fields["meta"] = {}
    try:
        return Trace(trace_id, **fields)
    except TraceError as error:
        raise error.at(location) from None


def _warn_unknown(record: Mapping, location: str, reported: set[str]) -> None:
    """Warn for the unknown keys of ``record`` holding a value (a null one loses nothing, and
    a Parquet column of a typo is null in the rows before the first that has it)."""
    for key, value in record.items():
        name = str(key)
        if name in FIELDS or name in _IGNORED or name.startswith(_PANDAS_INDEX) or value is None:
            continue
        if name in reported:
            continue
        reported.add(name)
        close = difflib.get_close_matches(name, FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        trace = f" trace {record['id']!r}:" if isinstance(record.get("id"), (str, int)) else ""
        warnings.warn(
            f"{location}:{trace} unknown field {name!r} is ignored{hint}; known "
            f"fields: {', '.join(FIELDS)} (later records with it are not reported)",
            UnknownFieldWarning,
            stacklevel=5,
        )  # load_traces's caller


def open_text(path: str | os.PathLike, mode: str, *, gzipped: bool) -> IO[str]:
    """Open a UTF-8 text file, through gzip when ``gzipped``."""
    if gzipped:
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _gzipped(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    for line_number, line in _lines(path):
        if line.strip():
            location = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(
                    f"malformed JSON: {error.msg} (column {error.colno})", location=location
                ) from None
            yield location, record


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """The numbered lines of a UTF-8 file (gzip-compressed when ``.gz``, a BOM allowed).

    Bytes that are not UTF-8 and damaged or truncated gzip data are errors naming the line.
    """
    file = (gzip.open if _gzipped(path) else open)(path, "rb")
    number = 0
    with file:
        try:
            for number, raw in enumerate(file, start=1):
                yield (
                    number,
                    _decode(
                        raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw,
                        f"{path}:{number}",
                    ),
                )
        except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
            raise TraceError(
                f"gzip data is damaged or truncated ({error})", location=f"{path}:{number + 1}"
            ) from None


def _decode(raw: bytes, location: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TraceError(
            f"not UTF-8 text: byte {raw[error.start]:#04x} at byte {error.start + 1} of the line",
            location=location,
        ) from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with (gzip.open if _gzipped(path) else open)(path, "rb") as file:
            data = file.read().removeprefix(codecs.BOM_UTF8)
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise TraceError(
            f"gzip data is damaged or truncated ({error})", location=str(path)
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise TraceError(
            f"not UTF-8 text: byte {data[error.start]:#04x}", location=f"{path}:{line}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(
            f"malformed JSON: {error.msg} (column {error.colno})", location=f"{path}:{error.lineno}"
        ) from None
    if isinstance(data, dict) and "traces" in data:
        data = data["traces"]
    if not isinstance(data, list):
        raise TraceError('expected a list of records or {"traces": [...]}', location=str(path))
    return ((f"{path}[{i}]", record) for i, record in enumerate(data))


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise TraceError(f"not a readable Parquet file ({error})", location=str(path)) from None
    return ((f"{path} row {i}", record) for i, record in enumerate(records))


def _frame_rows(name: str, frame: pandas.DataFrame) -> Iterator[tuple[str, Any]]:
    import pandas as pd

    for i, record in enumerate(frame.to_dict("records")):
        # Tabular sources mark a missing field with a null scalar (None, NaN, NA)
        present = {
            key: value
            for key, value in record.items()
            if not (pd.api.types.is_scalar(value) and pd.isna(value))
        }
        yield f"{name} row {i}", present
