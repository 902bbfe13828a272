"""GLTR rank buckets and the per-trace summary of a single replay run.

Names follow the scheme of :mod:`trace_replay.analysis` (``frac_*`` fractions,
``first_*_step`` first events).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = ["RANK_BUCKETS", "rank_bucket", "rank_bucket_transitions", "trace_summary"]

RANK_BUCKETS = ("top-10", "top-100", "top-1000", "rest")
_BUCKET_EDGES = [0, 10, 100, 1000, np.inf]


def as_float64(series: pd.Series) -> np.ndarray:
    """A numeric column as float64, missing values as NaN."""
    return pd.to_numeric(series).to_numpy(dtype="float64", na_value=np.nan)


def first_step(df: pd.DataFrame, mask: pd.Series) -> pd.Series:
    """Per trace (in order of appearance), the smallest step where ``mask`` holds; Int64."""
    steps = df["step"].where(mask.fillna(False).astype(bool))
    return steps.groupby(df["trace_id"], sort=False).min().astype("Int64")


def rank_bucket(rank: pd.Series | Sequence[float] | np.ndarray) -> pd.Series | pd.Categorical:
    """GLTR bucket of each rank: "top-10", "top-100", "top-1000" or "rest".

    Parameters
    ----------
    rank : Series or array-like
        1-based ranks; missing ranks map to a missing bucket.

    Returns
    -------
    Series or Categorical
        Ordered categorical with categories :data:`RANK_BUCKETS`; a Series (same index) when
        given a Series.

    Examples
    --------
    >>> list(rank_bucket([1, 10, 11, 1000, 1001]))
    ['top-10', 'top-10', 'top-100', 'top-1000', 'rest']
    """
    values = pd.to_numeric(pd.Series(np.asarray(rank, dtype=object)), errors="coerce")
    buckets = pd.cut(values.astype("float64"), _BUCKET_EDGES, labels=list(RANK_BUCKETS))
    if isinstance(rank, pd.Series):
        return buckets.set_axis(rank.index).rename("rank_bucket")
    return buckets.array


def bucket_fractions(rank: pd.Series) -> pd.Series:
    """Fraction of known ranks in each bucket; NaN for every bucket when none is known."""
    buckets = rank_bucket(rank).dropna()
    counts = buckets.value_counts().reindex(list(RANK_BUCKETS), fill_value=0)
    return counts / len(buckets) if len(buckets) else counts.astype(float) * np.nan


def rank_bucket_transitions(cmp: pd.DataFrame) -> pd.DataFrame:
    """Counts of tokens moving from each GLTR bucket on side a to each bucket on side b.

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`compare`. Tokens with an unknown rank on either side are left out.

    Returns
    -------
    DataFrame
        4 x 4 integer crosstab, index ``rank_bucket_a``, columns ``rank_bucket_b``, both in
        :data:`RANK_BUCKETS` order; zeros included.

    Examples
    --------
    >>> rank_bucket_transitions(compare(a, b)).loc["top-10", "rest"]  # doctest: +SKIP
    """
    a, b = rank_bucket(cmp["rank_a"]), rank_bucket(cmp["rank_b"])
    known = a.notna() & b.notna()
    table = pd.crosstab(a[known].astype(str), b[known].astype(str))
    table = table.reindex(index=list(RANK_BUCKETS), columns=list(RANK_BUCKETS), fill_value=0)
    table.index.name, table.columns.name = "rank_bucket_a", "rank_bucket_b"
    table.attrs = {"labels": cmp.attrs.get("labels", ("a", "b"))}
    return table.astype("int64")


def trace_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per-trace summary of a single replay frame (no second run needed).

    Parameters
    ----------
    df : DataFrame
        A replay frame (``trace_id, step, logprob, rank``; ``entropy`` optional).

    Returns
    -------
    DataFrame
        One row per trace, in order of first appearance: ``trace_id, n_tokens,
        mean_logprob, ppl, frac_top1, frac_top10, frac_top100, frac_top1000, frac_rest,
        first_off_top1_step`` (first step with rank > 1, Int64, ``<NA>`` when none),
        ``min_logprob, mean_entropy`` (NaN when the engine gave no entropy).

    Examples
    --------
    >>> trace_summary(replay_df).sort_values("mean_logprob").head()  # doctest: +SKIP
    """
    logprob = pd.Series(as_float64(df["logprob"]), index=df.index)
    rank = df["rank"].astype("Int64")
    known = rank.notna()
    buckets = rank_bucket(rank)
    entropy = df["entropy"] if "entropy" in df.columns else pd.Series(np.nan, index=df.index)

    def per_trace(values: pd.Series) -> pd.Series:
        return values.groupby(df["trace_id"], sort=False).mean()

    out = pd.DataFrame({"n_tokens": df.groupby("trace_id", sort=False).size()})
    out["mean_logprob"] = per_trace(logprob)
    out["ppl"] = np.exp(-out["mean_logprob"])
    out["frac_top1"] = per_trace((rank == 1).astype("float64").where(known))
    for bucket in RANK_BUCKETS:
        hit = (buckets == bucket).astype("float64").where(known)
        out[f"frac_{bucket.replace('-', '')}"] = per_trace(hit)
    out["first_off_top1_step"] = first_step(df, rank > 1)
    out["min_logprob"] = logprob.groupby(df["trace_id"], sort=False).min()
    out["mean_entropy"] = per_trace(pd.Series(as_float64(entropy), index=df.index))
    return out.reset_index()
