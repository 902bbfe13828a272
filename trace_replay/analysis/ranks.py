"""GLTR rank buckets and the per-trace summary of a single replay run.

Names follow the scheme of :mod:`trace_replay.analysis.metrics` (``frac_*`` fractions,
``first_*_step`` first events). Every rank name says which ranks it counts: the buckets
(a partition) are labelled by their rank ranges, ``"1-10"``, ``"11-100"``, ``"101-1000"``,
``">1000"``; the rank fractions are cumulative, ``frac_rank_le_K`` the fraction of tokens
with rank <= K for K in :data:`RANK_CUTS`, and ``frac_rank_gt_1000`` the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from trace_replay.analysis.mismatch import repeated_step, require_comparison

__all__ = ["RANK_BUCKETS", "RANK_CUTS", "rank_bucket", "rank_fractions",
           "rank_bucket_transitions", "trace_summary", "engine_table"]

RANK_BUCKETS = ("1-10", "11-100", "101-1000", ">1000")
_BUCKET_EDGES = [0, 10, 100, 1000, np.inf]
RANK_CUTS = (1, 10, 100, 1000)  # frac_rank_le_<cut>; then frac_rank_gt_<last cut>


def _require_replay(df: pd.DataFrame, caller: str) -> None:
    """Raise a `ValueError` unless ``df`` is one run's replay frame (``logprob`` and ``rank``,
    each trace step once: concatenated runs would be counted as one)."""
    missing = [c for c in ("trace_id", "logprob", "rank") if c not in getattr(df, "columns", ())]
    if not missing:
        row = repeated_step(df)
        if row is not None:
            raise ValueError(f"{caller} takes one run, but df holds trace {row['trace_id']!r} "
                             f"step {row['step']} more than once (runs concatenated? "
                             f"{caller.split(' ')[0]} each one; plot_rank_buckets takes them "
                             "with hue=)")
        return
    if not isinstance(df, pd.DataFrame):
        got = f"a {type(df).__name__}"
    elif "logprob_a" in df.columns:
        got = ("a comparison frame (columns logprob_a, logprob_b): summarize it with "
               "summarize(cmp), or pass one run")
    else:
        got = f"a frame with columns {list(df.columns)}"
    raise ValueError(f"{caller} needs a replay frame (columns trace_id, step, logprob, rank); "
                     f"lacking {missing}, got {got}")


def as_float64(series: pd.Series) -> np.ndarray:
    """A numeric column as float64, missing values as NaN."""
    return pd.to_numeric(series).to_numpy(dtype="float64", na_value=np.nan)


def first_step(df: pd.DataFrame, mask: pd.Series) -> pd.Series:
    """Per trace (in order of appearance), the smallest step where ``mask`` holds; Int64."""
    steps = df["step"].where(mask.fillna(False).astype(bool))
    return steps.groupby(df["trace_id"], sort=False).min().astype("Int64")


def rank_bucket(rank: pd.Series | Sequence[float] | np.ndarray) -> pd.Series | pd.Categorical:
    """GLTR bucket of each rank: "1-10", "11-100", "101-1000" or ">1000" (its rank range).

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
    ['1-10', '1-10', '11-100', '101-1000', '>1000']
    """
    values = pd.to_numeric(pd.Series(np.asarray(rank, dtype=object)), errors="coerce")
    buckets = pd.cut(values.astype("float64"), _BUCKET_EDGES, labels=list(RANK_BUCKETS))
    if isinstance(rank, pd.Series):
        return buckets.set_axis(rank.index).rename("rank_bucket")
    return buckets.array


def _rank_hits(rank: pd.Series) -> pd.DataFrame:
    """Per token, 1.0 where each rank predicate holds, else 0.0, NaN where the rank is unknown;
    one column per :func:`rank_fractions` name, so column means are those fractions."""
    values = pd.Series(as_float64(rank), index=rank.index)
    known = values.notna()
    hits = {f"frac_rank_le_{cut}": values <= cut for cut in RANK_CUTS}
    hits[f"frac_rank_gt_{RANK_CUTS[-1]}"] = values > RANK_CUTS[-1]
    return pd.DataFrame({name: hit.astype("float64").where(known) for name, hit in hits.items()})


def rank_fractions(rank: pd.Series) -> pd.Series:
    """Cumulative fractions of the known ranks: ``frac_rank_le_1`` ... ``frac_rank_gt_1000``.

    Parameters
    ----------
    rank : Series
        1-based ranks; missing ranks are left out.

    Returns
    -------
    Series
        ``frac_rank_le_K`` (fraction with rank <= K, K in :data:`RANK_CUTS`) and
        ``frac_rank_gt_1000`` (rank > 1000); NaN for every name when no rank is known.

    Examples
    --------
    >>> rank_fractions(pd.Series([1, 5, 50, 2000])).tolist()
    [0.25, 0.5, 0.75, 0.75, 0.25]
    """
    return _rank_hits(rank).mean()


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

    Raises
    ------
    ValueError
        If ``cmp`` is not a comparison frame.

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> moved = rank_bucket_transitions(compare(a, a.assign(rank=[1, 30, 1])))
    >>> moved.loc["1-10"].tolist()  # from ranks 1-10 to 1-10, 11-100, 101-1000, >1000
    [2, 1, 0, 0]
    """
    require_comparison(cmp, "rank_bucket_transitions")
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
        mean_logprob, ppl``, the cumulative rank fractions of :func:`rank_fractions`
        (``frac_rank_le_1, frac_rank_le_10, frac_rank_le_100, frac_rank_le_1000,
        frac_rank_gt_1000``, over the trace's known ranks), ``first_off_top1_step`` (first
        step with rank > 1, Int64, ``<NA>`` when none), ``min_logprob, mean_entropy`` (NaN
        when the engine gave no entropy).

    Examples
    --------
    >>> df = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "logprob": [-0.5, -1.0, -2.0],
    ...                    "rank": [1, 2, 1]})
    >>> trace_summary(df)[["trace_id", "ppl", "frac_rank_le_1", "first_off_top1_step"]]
      trace_id       ppl  frac_rank_le_1  first_off_top1_step
    0        t  3.211271        0.666667                    1
    """
    _require_replay(df, "trace_summary")
    logprob = pd.Series(as_float64(df["logprob"]), index=df.index)
    rank = df["rank"].astype("Int64")
    entropy = df["entropy"] if "entropy" in df.columns else pd.Series(np.nan, index=df.index)

    def per_trace(values: pd.Series) -> pd.Series:
        return values.groupby(df["trace_id"], sort=False).mean()

    out = pd.DataFrame({"n_tokens": df.groupby("trace_id", sort=False).size()})
    out["mean_logprob"] = per_trace(logprob)
    out["ppl"] = np.exp(-out["mean_logprob"])
    out = out.join(_rank_hits(rank).groupby(df["trace_id"], sort=False).mean())
    out["first_off_top1_step"] = first_step(df, rank > 1)
    out["min_logprob"] = logprob.groupby(df["trace_id"], sort=False).min()
    out["mean_entropy"] = per_trace(pd.Series(as_float64(entropy), index=df.index))
    return out.reset_index()


def engine_table(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per run of the same traces: size, mean logprob, top-1 fraction, perplexity.

    Parameters
    ----------
    results : dict of str to DataFrame
        Replay frames by run label (e.g. ``"torch float32"``).

    Returns
    -------
    DataFrame
        ``engine`` (the label), ``path`` (``attrs["engine_path"]``), ``traces, tokens,
        mean_logprob, frac_rank_le_1`` (share of rank-1 tokens), ``ppl`` and ``wall_s``
        (``attrs["wall_s"]`` when the caller timed the run, else ``None``).

    Examples
    --------
    >>> run = pd.DataFrame({"trace_id": ["t", "t"], "step": [0, 1], "logprob": [-0.5, -1.5],
    ...                     "rank": [1, 4]})
    >>> engine_table({"torch": run})[["engine", "tokens", "mean_logprob", "frac_rank_le_1"]]
      engine  tokens  mean_logprob  frac_rank_le_1
    0  torch       2          -1.0             0.5
    """
    rows = []
    for name, df in results.items():
        _require_replay(df, f"engine_table (run {name!r})")
        rows.append({"engine": name, "path": df.attrs.get("engine_path"),
                     "traces": df["trace_id"].nunique(), "tokens": len(df),
                     "mean_logprob": df["logprob"].mean(),
                     "frac_rank_le_1": (df["rank"] == 1).mean(),
                     "ppl": float(np.exp(-df["logprob"].mean())),
                     "wall_s": df.attrs.get("wall_s")})
    return pd.DataFrame(rows)
