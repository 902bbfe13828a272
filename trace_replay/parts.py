"""Checkpoint parts: Parquet files that prove their own integrity.

A part's pages carry CRC checksums (``write_page_checksum``), its name carries the start of the
SHA-256 of its bytes, and its values are checked for plausibility on read, so a flipped bit, a
torn write or a buggy writer is detected rather than served.
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

__all__ = ["PART_NAME", "CorruptPart", "read_part", "write_part"]

PART_NAME = re.compile(r"^part-\d{20}-(?P<sha>[0-9a-f]{16})\.parquet$")
_TOLERANCE = 1e-3  # float32 scores round-tripped through float64: far above rounding


class CorruptPart(ValueError):
    """A part whose bytes, pages or values fail verification."""


def write_part(folder: Path, frame: pd.DataFrame) -> Path:
    """Write ``frame`` (with its ``trace_digest`` column) as a part; return its path.

    The part's pages carry CRC checksums and its name the start of its bytes' SHA-256.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), sink,
                   write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    path = folder / f"part-{time.time_ns():020d}-{hashlib.sha256(data).hexdigest()[:16]}.parquet"
    write_atomic(path, lambda temporary: temporary.write_bytes(data))
    return path


def read_part(path: Path, *, top_k: int | None = None,
              requests: Mapping[str, ReplayRequest] | None = None) -> pd.DataFrame:
    """A part's rows, once its SHA-256, page checksums and values are verified.

    Parameters
    ----------
    path
        The part.
    top_k
        The top-k list length every row must have (``None``: not checked).
    requests
        By digest: the traces whose rows must carry exactly their tokens.

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
    _check_values(frame, top_k, requests or {})
    return frame


def _check_values(frame: pd.DataFrame, top_k: int | None,
                  requests: Mapping[str, ReplayRequest]) -> None:
    """Raise :class:`CorruptPart` unless every trace's rows are complete and plausible."""
    need = {"trace_id", "trace_digest", "step", "position", "token_id", "logprob", "rank",
            "top_token_ids", "top_logprobs", "entropy"}
    if not need <= set(frame.columns):
        raise CorruptPart(f"columns {sorted(need - set(frame.columns))} missing")
    frame = frame.sort_values(["trace_digest", "step"], kind="stable")
    groups = frame.groupby("trace_digest", sort=False)
    logprob, rank = frame["logprob"].to_numpy(), frame["rank"].to_numpy()
    entropy, step = frame["entropy"].to_numpy(), frame["step"].to_numpy()
    offsets = (frame["position"] - frame["step"]).groupby(frame["trace_digest"])
    problems = {
        "steps are not 0, 1, 2…": (groups.cumcount().to_numpy() != step).any(),
        "positions are not prompt_len + step": offsets.nunique().gt(1).any(),
        "logprob is NaN or positive": (np.isnan(logprob) | (logprob > _TOLERANCE)).any(),
        "rank below 1": (rank < 1).any(),
        "negative entropy": (entropy < -_TOLERANCE).any(),
    }
    if top_k is not None:
        lengths = frame["top_logprobs"].map(len).to_numpy()
        problems["top-k lists of the wrong length"] = (
            (lengths != top_k).any() or (frame["top_token_ids"].map(len).to_numpy() != top_k).any())
        if top_k > 0 and not problems["top-k lists of the wrong length"]:
            top = np.stack(frame["top_logprobs"].to_numpy()).astype(np.float64)
            within = rank <= top_k
            at_rank = top[np.arange(len(top)), np.minimum(rank, top_k) - 1]
            slack = _TOLERANCE * np.maximum(1.0, np.abs(logprob))
            problems["top-k logprobs not sorted"] = (np.diff(top, axis=1) > slack[:, None]).any()
            # rank r: r - 1 logprobs are greater, so the r-th largest is the token's own
            problems["rank disagrees with top-k"] = (
                (within & (np.abs(at_rank - logprob) > slack))
                | (~within & (top[:, -1] < logprob - slack))).any()
    for digest, rows in groups:
        request = requests.get(digest)
        if request is not None and (
                not np.array_equal(rows["token_id"].to_numpy(), request.trace_token_ids)
                or rows["position"].iloc[0] != request.prompt_len):
            problems[f"trace {request.trace_id!r}: tokens differ from its digest's"] = True
    failed = [problem for problem, bad in problems.items() if bad]
    if failed:
        raise CorruptPart("; ".join(failed))
