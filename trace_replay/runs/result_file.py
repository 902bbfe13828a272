"""What a result file must hold before it is merged or reported: one check for both.

``merge`` and ``report`` read result files with :func:`read_result`, so a file that one
refuses the other refuses too. A result file is refused, naming the file, the trace, the
step and the field, when it is not one that ``replay`` or ``merge`` wrote as it is now:

* columns missing, or ``logprob``/``rank`` holding other than numbers;
* a (trace, step) twice; steps of a trace not 0, 1, 2… without a gap; positions not
  ``prompt_len + step``;
* a score no replay writes (:func:`~trace_replay.engines.validate.impossible`, the rules
  every engine result passes: a positive or NaN logprob, a rank below 1, top-k lists of
  another length than ``attrs["top_k"]``…);
* fewer or more traces or rows than its ``attrs`` record (``num_traces``, ``num_tokens``):
  a trace's rows, or its last step, deleted.

A frame in memory is checked by :func:`check_scores` only: it may be a slice of a result
(some steps, some traces) on purpose.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
from pandas.api.types import is_bool_dtype, is_numeric_dtype

from trace_replay.engines.validate import impossible
from trace_replay.runs.frame import check_frame
from trace_replay.runs.parts import check_rows, describe
from trace_replay.wording import plural

__all__ = ["check_scores", "read_result"]

# what check_rows reads beyond the columns every replay frame has (check_frame's)
_ROW_COLUMNS = ("position", "top_token_ids", "top_logprobs", "entropy")


def check_scores(frame: pd.DataFrame, name: str) -> None:
    """Refuse scores no replay writes (:func:`~trace_replay.engines.validate.impossible`:
    a logprob that is NaN or > 0, a rank that is not an integer >= 1, columns that are not
    numbers), naming ``name``, the trace and the step.

    Raises
    ------
    ValueError
        ``"NAME: trace 'ID', step S: FIELD VALUE is impossible (RULE): not a replay result"``.
    """
    _check_numbers(frame, name)
    if frame.empty:
        return
    entropy = frame["entropy"] if "entropy" in frame else pd.Series(np.nan, index=frame.index)
    for field, rule, rows in impossible(
        frame["logprob"].to_numpy(),
        frame["rank"].to_numpy(),
        np.zeros((len(frame), 0)),
        entropy.to_numpy(),
    ):
        if rows.any():
            row = frame[rows].iloc[0]
            value, step = np.asarray(row[field]).tolist(), np.asarray(row["step"]).tolist()
            raise ValueError(
                f"{name}: trace {row['trace_id']!r}, step {step}: {field} "
                f"{value!r} is impossible ({rule}): not a replay result"
            )


def read_result(path: str | os.PathLike, name: str) -> pd.DataFrame:
    """The result file at ``path``, once it passes every check of this module's docstring.

    Parameters
    ----------
    path
        A Parquet file written by ``replay`` or ``merge``.
    name
        How errors name the file's role (``"merge: result file"``, ``"a:"``); the path
        follows it.

    Returns
    -------
    pandas.DataFrame
        The file's rows and ``attrs``.

    Raises
    ------
    ValueError
        Naming the file and what is wrong: the trace, the step and the field where a row
        is at fault.
    FileNotFoundError
        When ``path`` does not exist.
    """
    path = Path(path)
    where = f"{name} {path}"
    if path.exists() and not path.is_file():
        raise ValueError(f"{where} is not a regular file")
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist")
    frame = pd.read_parquet(path)
    check_frame(frame, f"{where} is not a replay result file: it")
    missing = [column for column in _ROW_COLUMNS if column not in frame.columns]
    if missing:
        raise ValueError(f"{where} is not a replay result file: it lacks replay columns {missing}")
    _check_numbers(frame, where)
    top_k, vocab_size = frame.attrs.get("top_k"), frame.attrs.get("vocab_size")
    # older results record no vocabulary size: the bounds it gives are not checked there
    failed = check_rows(
        frame,
        top_k=top_k if _count(top_k) else None,
        vocab_size=vocab_size if _count(vocab_size) else None,
        by="trace_id",
    )
    if failed:
        raise ValueError(
            f"{where}: {describe(failed)}: it is damaged or was edited, not a replay result"
        )
    _check_counts(frame, where)
    return frame


def _count(value: object) -> bool:
    """Whether an attrs value is a count (a positive int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_numbers(frame: pd.DataFrame, name: str) -> None:
    if frame.empty:  # an empty shard's columns hold no values, of whatever dtype
        return
    for column in ("logprob", "rank"):
        if not is_numeric_dtype(frame[column]) or is_bool_dtype(frame[column]):
            raise ValueError(
                f"{name}: column {column!r} holds {frame[column].dtype} values, "
                "not numbers: not a replay result"
            )


def _check_counts(frame: pd.DataFrame, where: str) -> None:
    """Refuse rows of other than the traces and tokens the file's ``attrs`` record (a count
    that is not one integer, as in older or partial merges, is not checked)."""
    held = {"num_traces": (frame["trace_id"].nunique(), "trace"), "num_tokens": (len(frame), "row")}
    for key, (count, unit) in held.items():
        recorded = frame.attrs.get(key)
        if isinstance(recorded, int) and not isinstance(recorded, bool) and count != recorded:
            raise ValueError(
                f"{where} records {plural(recorded, unit)} ({key}) but holds "
                f"{plural(count, unit)}: it is damaged or was edited; replay "
                "it again"
            )
