"""Checkpoint parts: Parquet files that prove their own integrity.

A part's pages carry CRC checksums (``write_page_checksum``), its name carries the start of the
SHA-256 of its bytes, and its values are checked on read (complete traces, and scores by the
rules every engine result passes, :func:`trace_replay.engines.validate.impossible`), so a
flipped bit, a torn write or a buggy writer is detected rather than served.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from trace_replay._io import write_atomic
from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.validate import ImpossibleResult, impossible

__all__ = [
    "PART_NAME",
    "CorruptPart",
    "check_rows",
    "describe",
    "not_saved",
    "part_settings_key",
    "read_part",
    "write_checked",
    "write_part",
]

# written at time.time_ns() (ns), with the first 16 hex digits of its bytes' sha256
PART_NAME = re.compile(r"^part-(?P<ns>\d{20})-(?P<sha>[0-9a-f]{16})\.parquet$")
_SETTINGS_KEY = b"trace_replay.settings_key"  # Parquet metadata: the run's settings key


class CorruptPart(ValueError):
    """A part whose bytes, pages or values fail verification."""


def write_part(folder: Path, frame: pd.DataFrame, settings_key: str | None = None) -> Path:
    """Write ``frame`` (with its ``trace_digest`` column) as a part; return its path.

    The part's pages carry CRC checksums, its name the start of its bytes' SHA-256, and its
    metadata the ``settings_key`` of the run that computed it (:func:`part_settings_key`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, preserve_index=False)
    if settings_key is not None:
        table = table.replace_schema_metadata(
            {**table.schema.metadata, _SETTINGS_KEY: settings_key.encode()}
        )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    path = folder / f"part-{time.time_ns():020d}-{hashlib.sha256(data).hexdigest()[:16]}.parquet"
    write_atomic(path, lambda temporary: temporary.write_bytes(data))
    return path


def write_checked(
    folder: Path,
    frame: pd.DataFrame,
    settings_key: str,
    *,
    top_k: int | None,
    requests: Mapping[str, ReplayRequest],
    vocab_size: int | None = None,
) -> tuple[Path | None, dict[str, list[str]]]:
    """Write the traces of ``frame`` (with ``trace_digest``) that pass a read's checks as
    a part, so that nothing a read would refuse is ever written.

    Returns
    -------
    tuple
        The part (``None`` when no trace passed), and what is wrong with the other traces
        (:func:`check_rows`; empty when all passed).
    """
    failed = check_rows(frame, top_k=top_k, requests=requests, vocab_size=vocab_size)
    frame = frame[~frame["trace_id"].isin(failed)]
    if frame.empty:
        return None, failed
    return write_part(folder, frame, settings_key), failed


def not_saved(folder: Path, failed: Mapping[str, list[str]]) -> ImpossibleResult:
    """The error for traces :func:`write_checked` refused, naming the first ones."""
    return ImpossibleResult(
        f"checkpoint {folder}: impossible results, not saved (the other "
        f"traces are): {describe(failed)}",
        trace_id=next(iter(failed)),
    )


def part_settings_key(path: Path) -> str | None:
    """The settings key a part was written with; ``None`` when it records none.

    Raises
    ------
    CorruptPart
        When its metadata cannot be read.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, ValueError) as error:
        raise CorruptPart(f"unreadable: {error}") from None
    key = metadata.get(_SETTINGS_KEY)
    return None if key is None else key.decode()


def read_part(
    path: Path,
    *,
    top_k: int | None = None,
    requests: Mapping[str, ReplayRequest] | None = None,
    vocab_size: int | None = None,
    check_values: bool = True,
) -> pd.DataFrame:
    """A part's rows, once its SHA-256, page checksums and values are verified.

    Parameters
    ----------
    path
        The part.
    top_k
        The top-k list length every row must have (``None``: not checked).
    requests
        By digest: the traces whose rows must carry exactly their tokens.
    vocab_size
        The engine's vocabulary size, which bounds ranks, token ids and the most likely
        token's logprob (``None``: those bounds are not checked).
    check_values
        Whether to check the values; ``False`` for a part whose values the caller checked
        before under the same name, with the same arguments: the name carries the start of
        its bytes' SHA-256, which is still verified, so the same name reads the same rows.

    Raises
    ------
    CorruptPart
        Naming what failed.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = path.read_bytes()
    match = PART_NAME.match(path.name)
    if match is None or hashlib.sha256(data).hexdigest()[:16] != match["sha"]:
        raise CorruptPart("its bytes do not match the checksum in its name")
    try:
        frame = pq.read_table(pa.BufferReader(data), page_checksum_verification=True).to_pandas()
    except (pa.ArrowException, OSError, ValueError) as error:
        raise CorruptPart(f"unreadable: {error}") from None
    failed = check_values and check_rows(
        frame, top_k=top_k, requests=requests, vocab_size=vocab_size
    )
    if failed:
        raise CorruptPart(describe(failed))
    return frame


def check_rows(
    frame: pd.DataFrame,
    *,
    top_k: int | None = None,
    requests: Mapping[str, ReplayRequest] | None = None,
    vocab_size: int | None = None,
    by: str = "trace_digest",
) -> dict[str, list[str]]:
    """What is wrong with each trace's rows: complete, plausible, and its request's tokens.

    Parameters
    ----------
    frame
        Rows of whole traces, with the column ``by``, in any order.
    top_k, requests, vocab_size
        As for :func:`read_part` (``requests`` keyed by the values of ``by``).
    by
        The column that tells traces apart: ``trace_digest`` in a part, ``trace_id`` in a
        result file.

    Returns
    -------
    dict
        By trace id, the traces failing a check, each with what failed and at which step
        (``"step 3: logprob nan is impossible: a logprob is a number <= 0"``); empty when
        every row passes.

    Raises
    ------
    CorruptPart
        When a column is missing.
    """
    need = {
        "trace_id",
        by,
        "step",
        "position",
        "token_id",
        "logprob",
        "rank",
        "top_token_ids",
        "top_logprobs",
        "entropy",
    }
    if not need <= set(frame.columns):
        raise CorruptPart(f"columns {sorted(need - set(frame.columns))} missing")
    if frame.empty:
        return {}
    frame = frame.sort_values([by, "step"], kind="stable").reset_index(drop=True)
    digests = frame[by]
    step = frame["step"].to_numpy()
    offsets = (frame["position"] - frame["step"]).groupby(digests)
    problems = [  # (what is wrong, the rows showing it, the column whose value it shows)
        (
            "steps are not 0, 1, 2… (a step is missing or repeated)",
            frame.groupby(by).cumcount().to_numpy() != step,
            None,
        ),
        (
            "positions are not prompt_len + step",
            (offsets.transform("first") != frame["position"] - frame["step"]).to_numpy(),
            None,
        ),
        *_impossible_scores(frame, top_k, vocab_size),
        *_other_tokens(frame, requests or {}, by),
    ]
    failed: dict[str, list[str]] = {}
    for problem, bad, field in problems:
        for row in frame.index[bad].to_series().groupby(digests[bad]).first():
            what = problem
            if field is not None:
                value = np.asarray(frame.at[row, field]).tolist()
                what = f"{field} {value} is impossible: {problem}"
            failed.setdefault(frame.at[row, "trace_id"], []).append(
                f"step {frame.at[row, 'step']}: {what}"
            )
    return failed


def _other_tokens(
    frame: pd.DataFrame, requests: Mapping[str, ReplayRequest], by: str
) -> list[tuple]:
    """Each trace's first row not at its request's prompt length or not its request's token
    (``frame`` sorted by ``by`` and step, so that a trace's rows are consecutive)."""
    moved, other = np.zeros(len(frame), bool), np.zeros(len(frame), bool)
    keys = frame[by].to_numpy()
    first = np.ones(len(frame), bool)  # a trace's first row
    first[1:] = keys[1:] != keys[:-1]
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(frame)]
    tokens, positions = frame["token_id"].to_numpy(), frame["position"].to_numpy()
    for start, end in zip(starts.tolist(), ends.tolist()):
        request = requests.get(keys[start])
        if request is None:
            continue
        want = np.asarray(request.trace_token_ids, dtype=np.int64)
        got = tokens[start:end]
        length = min(len(got), len(want))
        differs = np.flatnonzero(got[:length] != want[:length])
        moved[start] = positions[start] != request.prompt_len
        if len(differs) or len(got) != len(want):
            other[start + min(differs[0] if len(differs) else length, end - start - 1)] = True
    return [
        ("first position is not its prompt's length", moved, None),
        ("tokens differ from its digest's", other, None),
    ]


def _impossible_scores(
    frame: pd.DataFrame, top_k: int | None, vocab_size: int | None
) -> list[tuple]:
    """The rows whose top-k lists are not ``top_k`` long (``None``: all of one length), or
    whose scores an engine's result could not hold (:func:`~trace_replay.engines.validate.
    impossible`: the same rules)."""
    cells = frame["top_logprobs"].to_numpy(), frame["top_token_ids"].to_numpy()
    lengths = [np.fromiter(map(len, column), np.int64, len(column)) for column in cells]
    width = lengths[0][0] if top_k is None else top_k
    wrong = (lengths[0] != width) | (lengths[1] != width)
    whole = width and not wrong.any()
    top = _matrix(cells[0], width, np.float64) if whole else np.zeros((len(frame), 0))
    top_ids = _matrix(cells[1], width, None) if whole else None
    rules = impossible(
        frame["logprob"].to_numpy(),
        frame["rank"].to_numpy(),
        top,
        frame["entropy"].to_numpy(),
        vocab_size=vocab_size,
        token_ids=frame["token_id"].to_numpy(),
        top_token_ids=top_ids,
        # parts written before the tail was recorded have no column
        # (and against ragged top-k lists it cannot be checked)
        tail_logmass=(
            frame["tail_logmass"].to_numpy(dtype=np.float64)
            if "tail_logmass" in frame and not wrong.any()
            else None
        ),
    )
    return [
        ("top-k lists of the wrong length", wrong, None),
        *((rule, rows, field) for field, rule, rows in rules),
    ]


def _matrix(cells: np.ndarray, width: int, dtype: type | None) -> np.ndarray:
    """``[N, width]`` from N cells of ``width`` values each: lists (a frame an engine call
    built) or arrays (a part read back)."""
    if isinstance(cells[0], list):
        return np.array(cells.tolist(), dtype=dtype)
    matrix = np.concatenate(cells.tolist()).reshape(len(cells), width)
    return matrix if dtype is None else matrix.astype(dtype, copy=False)


def describe(failed: Mapping[str, list[str]], most: int = 5) -> str:
    """``check_rows``'s failures as one line: the first ``most`` traces, then a count."""
    named = [
        f"trace {trace_id!r}, {'; '.join(what)}" for trace_id, what in list(failed.items())[:most]
    ]
    more = f"; and {len(failed) - most} more traces" if len(failed) > most else ""
    return "; ".join(named) + more
