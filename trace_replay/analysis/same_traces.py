"""Pairing two runs' traces by id, only where both scored the same tokens.

Every comparison of two runs (:func:`~trace_replay.analysis.metrics.compare`, and through it
``report``, the plots, sweeps and the demo) pairs their rows here, so two runs that hold
other prompts or traces under one id are never reported as a divergence.

A trace matches when both runs hold the same tokens for it:

* where both runs' rows carry ``tokens_digest`` (every result ``replay`` writes: a digest of
  the prompt and trace token ids, :func:`~trace_replay.runs.frame.tokens_digest`), when the
  digests are equal;
* else (a frame or file written before the digest existed, a checkpoint part written
  before it, or a frame made by hand) when the token columns both hold agree at every step
  both hold: the same ``token_id`` and, where both have it, ``position`` (``prompt_len +
  step``: a prompt of another length). A prompt of the same length with other tokens
  cannot be told apart there, and other step sets are left to ``compare``'s own error.

Traces held by one run only are not this module's concern: ``compare`` refuses them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from trace_replay.wording import plural

__all__ = ["TracesDiffer", "TracesLeftOut", "mismatched_traces", "same_traces"]

_NAMED = 5  # trace ids an error or warning names before "and N more"


class TracesDiffer(ValueError):
    """Two runs hold other tokens under the same trace ids; ``trace_ids`` names them."""

    def __init__(self, message: str, trace_ids: list[str]) -> None:
        super().__init__(message)
        self.trace_ids = trace_ids


class TracesLeftOut(UserWarning):
    """Traces left out of a comparison because the two runs hold other tokens for them."""


def _digests(frame: pd.DataFrame) -> pd.Series:
    """Per trace (in order of appearance), its ``tokens_digest``; missing where the column
    is absent, a row lacks one, or two rows disagree."""
    by = frame["trace_id"]
    if "tokens_digest" not in frame.columns:
        return pd.Series(None, index=pd.unique(by), dtype=object)
    digest = frame["tokens_digest"].groupby(by, sort=False)
    whole = (digest.count() == by.groupby(by, sort=False).size()) & (digest.nunique() == 1)
    return digest.first().where(whole)


def mismatched_traces(a: pd.DataFrame, b: pd.DataFrame) -> list:
    """The trace ids both frames hold whose tokens differ between them (the module
    docstring's rule), in order of ``a``. Without digests only the steps both hold are
    compared: other step sets are ``compare``'s error.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": ["t", "t", "u"], "step": [0, 1, 0],
    ...                   "token_id": [5, 6, 7], "position": [3, 4, 2]})
    >>> mismatched_traces(a, a.assign(position=[3, 4, 9]))
    ['u']
    """
    da, db = _digests(a), _digests(b)
    both = da.index.intersection(db.index, sort=False)
    da, db = da.loc[both], db.loc[both]
    by_digest = da.notna() & db.notna()
    differ = set(both[by_digest & (da != db)])
    rest = set(both[~by_digest])
    if rest:
        columns = [c for c in ("token_id", "position") if c in a.columns and c in b.columns]
        key = ["trace_id", "step"]
        joined = a.loc[a["trace_id"].isin(rest), key + columns].merge(
            b.loc[b["trace_id"].isin(rest), key + columns], on=key, suffixes=("_a", "_b")
        )
        other = np.zeros(len(joined), dtype=bool)
        for column in columns:
            va = pd.to_numeric(joined[f"{column}_a"]).to_numpy(dtype="float64", na_value=np.nan)
            vb = pd.to_numeric(joined[f"{column}_b"]).to_numpy(dtype="float64", na_value=np.nan)
            other |= (va != vb) & ~(np.isnan(va) & np.isnan(vb))
        differ |= set(joined.loc[other, "trace_id"])
    return [t for t in both if t in differ]


def _first_difference(a: pd.DataFrame, b: pd.DataFrame, trace_id: str) -> str:
    """What differs in ``trace_id`` between ``a`` and ``b``, first."""
    rows_a = a[a["trace_id"] == trace_id].sort_values("step")
    rows_b = b[b["trace_id"] == trace_id].sort_values("step")
    if "tokens_digest" in a.columns and "tokens_digest" in b.columns:
        da, db = rows_a["tokens_digest"].iloc[0], rows_b["tokens_digest"].iloc[0]
        if pd.notna(da) and pd.notna(db) and da != db:
            return f"trace {trace_id!r} has tokens_digest {da} in a, {db} in b"
    joined = rows_a.merge(rows_b, on="step", suffixes=("_a", "_b"))
    for column in ("token_id", "position"):
        if f"{column}_a" in joined.columns:
            differ = joined[joined[f"{column}_a"] != joined[f"{column}_b"]]
            if len(differ):
                row = differ.iloc[0]
                return (
                    f"{column} differs first at trace {trace_id!r} step {row['step']} "
                    f"(a: {row[f'{column}_a']}, b: {row[f'{column}_b']})"
                )
    return f"trace {trace_id!r} has {len(rows_a)} steps in a, {len(rows_b)} in b"


def same_traces(
    a: pd.DataFrame,
    b: pd.DataFrame,
    *,
    labels: tuple[str, str] = ("a", "b"),
    drop_mismatched: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """``a`` and ``b`` with the traces both hold under other tokens refused, or left out.

    Parameters
    ----------
    a, b : DataFrame
        Replay frames (``trace_id``, ``step``, ``token_id``; ``position`` and
        ``tokens_digest`` used where present).
    labels : tuple of str
        How errors and warnings name the two runs.
    drop_mismatched : bool
        Leave the mismatched traces out of both frames, with a :class:`TracesLeftOut`
        warning saying how many; by default they are an error.

    Returns
    -------
    tuple
        ``(a, b, left_out)``: the frames (unchanged when nothing differs) and the ids left
        out.

    Raises
    ------
    TracesDiffer
        Naming how many traces differ and the first of them, unless ``drop_mismatched``.
    """
    left_out = mismatched_traces(a, b)
    if not left_out:
        return a, b, []
    named = ", ".join(repr(t) for t in left_out[:_NAMED])
    if len(left_out) > _NAMED:
        named += f" and {len(left_out) - _NAMED} more"
    verb = "holds" if len(left_out) == 1 else "hold"
    what = (
        f"{plural(len(left_out), 'trace')} ({named}) {verb} other prompt or trace tokens "
        f"in {labels[0]} than in {labels[1]}"
    )
    if not drop_mismatched:
        raise TracesDiffer(
            f"{what} ({_first_difference(a, b, left_out[0])}): their numbers "
            "are not comparable; replay both runs on one trace set, or leave "
            "them out (drop_mismatched=True, --drop-mismatched)",
            left_out,
        )
    total = len(set(a["trace_id"]) | set(b["trace_id"]))
    warnings.warn(
        f"left out {len(left_out)} of {plural(total, 'trace')}: {what}", TracesLeftOut, stacklevel=3
    )
    gone = set(left_out)
    return a[~a["trace_id"].isin(gone)], b[~b["trace_id"].isin(gone)], left_out
