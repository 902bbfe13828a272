"""GLTR rank buckets and the per-trace summary of a single replay run.

Names follow the scheme of :mod:`trace_replay.analysis.metrics` (``frac_*`` fractions,
``first_*_step`` first events). Every rank name says which ranks it counts: the buckets
(a partition) are labelled by their rank ranges, ``"1-10"``, ``"11-100"``, ``"101-1000"``,
``">1000"``; the rank fractions are cumulative, ``frac_rank_le_K`` the fraction of tokens
with rank <= K for K in :data:`RANK_CUTS`, and ``frac_rank_gt_1000`` the rest.

A rank is exact unless the frame's ``rank_exact`` column says it is a lower bound (a server
that lists 20 alternatives knows only that a token past them ranks above 20; the column is
absent where every rank is exact). A bound is part of the rank everywhere: shown as
``">20"`` (:func:`rank_label`), in its own bucket ``"bound"`` unless it decides one (a bound
past 1000 is ``">1000"``), counted in a rank fraction only where it decides the predicate
(rank 21 and up is not <= 10, but may be <= 100), counted apart as ``n_rank_bound``, and
never top-1 unless it is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from trace_replay.analysis.mismatch import repeated_step, require_comparison

__all__ = [
    "BOUND_BUCKET",
    "RANK_BUCKETS",
    "RANK_CUTS",
    "exact_ranks",
    "rank_bucket",
    "rank_fractions",
    "rank_label",
    "rank_bucket_transitions",
    "trace_summary",
    "engine_table",
]

BOUND_BUCKET = "bound"  # a lower-bound rank whose bucket it does not decide
RANK_BUCKETS = ("1-10", "11-100", "101-1000", ">1000", BOUND_BUCKET)
_BUCKET_EDGES = [0, 10, 100, 1000, np.inf]
RANK_CUTS = (1, 10, 100, 1000)  # frac_rank_le_<cut>; then frac_rank_gt_<last cut>


def _require_replay(df: pd.DataFrame, caller: str) -> None:
    """Raise a `ValueError` unless ``df`` is one run's replay frame (``logprob`` and ``rank``,
    each trace step once: concatenated runs would be counted as one)."""
    missing = [c for c in ("trace_id", "logprob", "rank") if c not in getattr(df, "columns", ())]
    if not missing:
        row = repeated_step(df)
        if row is not None:
            raise ValueError(
                f"{caller} takes one run, but df holds trace {row['trace_id']!r} "
                f"step {row['step']} more than once (runs concatenated? "
                f"{caller.split(' ')[0]} each one; plot_rank_buckets takes them "
                "with hue=)"
            )
        return
    if not isinstance(df, pd.DataFrame):
        got = f"a {type(df).__name__}"
    elif "logprob_a" in df.columns:
        got = (
            "a comparison frame (columns logprob_a, logprob_b): summarize it with "
            "summarize(cmp), or pass one run"
        )
    else:
        got = f"a frame with columns {list(df.columns)}"
    raise ValueError(
        f"{caller} needs a replay frame (columns trace_id, step, logprob, rank); "
        f"lacking {missing}, got {got}"
    )


def as_float64(series: pd.Series) -> np.ndarray:
    """A numeric column as float64, missing values as NaN."""
    return pd.to_numeric(series).to_numpy(dtype="float64", na_value=np.nan)


def exact_ranks(df: pd.DataFrame, suffix: str = "") -> pd.Series:
    """Per row, whether ``rank<suffix>`` is exact: ``rank_exact<suffix>`` where present and
    known, else True (frames of engines that give exact ranks have no such column)."""
    column = f"rank_exact{suffix}"
    if column not in df.columns:
        return pd.Series(True, index=df.index)
    return df[column].astype("boolean").fillna(True).astype(bool)


def rank_label(rank: float, exact: bool = True) -> str:
    """A rank as text: ``"21"``, a lower bound as ``">20"``, a missing one as ``"?"``.

    Examples
    --------
    >>> rank_label(21), rank_label(21, exact=False), rank_label(float("nan"))
    ('21', '>20', '?')
    """
    if pd.isna(rank):
        return "?"
    return str(int(rank)) if exact or pd.isna(exact) else f">{int(rank) - 1}"


def first_step(df: pd.DataFrame, mask: pd.Series) -> pd.Series:
    """Per trace (in order of appearance), the smallest step where ``mask`` holds; Int64."""
    steps = df["step"].where(mask.fillna(False).astype(bool))
    return steps.groupby(df["trace_id"], sort=False).min().astype("Int64")


def rank_bucket(
    rank: pd.Series | Sequence[float] | np.ndarray,
    exact: pd.Series | Sequence[bool] | np.ndarray | None = None,
) -> pd.Series | pd.Categorical:
    """GLTR bucket of each rank: "1-10", "11-100", "101-1000" or ">1000" (its rank range),
    or "bound" for a lower bound that does not decide its range.

    Parameters
    ----------
    rank : Series or array-like
        1-based ranks; missing ranks map to a missing bucket.
    exact : Series or array-like of bool, optional
        False where ``rank`` is a lower bound (the true rank is ``rank`` or more); default
        all exact.

    Returns
    -------
    Series or Categorical
        Ordered categorical with categories :data:`RANK_BUCKETS`; a Series (same index) when
        given a Series.

    Examples
    --------
    >>> list(rank_bucket([1, 10, 11, 1000, 1001]))
    ['1-10', '1-10', '11-100', '101-1000', '>1000']
    >>> list(rank_bucket([21, 1001], exact=[False, False]))  # ranks above 20, above 1000
    ['bound', '>1000']
    """
    values = pd.to_numeric(pd.Series(np.asarray(rank, dtype=object)), errors="coerce")
    buckets = pd.cut(values.astype("float64"), _BUCKET_EDGES, labels=list(RANK_BUCKETS[:-1]))
    buckets = buckets.cat.add_categories([BOUND_BUCKET])
    if exact is not None:
        bound = ~pd.Series(np.asarray(exact, dtype=object)).fillna(True).astype(bool)
        # a bound past the last edge still decides its bucket
        buckets[(bound & (values <= _BUCKET_EDGES[-2])).to_numpy()] = BOUND_BUCKET
    if isinstance(rank, pd.Series):
        return buckets.set_axis(rank.index).rename("rank_bucket")
    return buckets.array


def _rank_hits(rank: pd.Series, exact: pd.Series | None = None) -> pd.DataFrame:
    """Per token, 1.0 where each rank predicate holds, else 0.0, NaN where the rank is unknown
    or a lower bound that does not decide it; one column per :func:`rank_fractions` name, so
    column means are those fractions."""
    values = pd.Series(as_float64(rank), index=rank.index)
    known = values.notna()
    exact = pd.Series(True, index=rank.index) if exact is None else exact
    # a bound r says rank >= r: it decides "rank <= K" (false) only when r > K
    hits = {f"frac_rank_le_{cut}": (values <= cut, exact | (values > cut)) for cut in RANK_CUTS}
    last = RANK_CUTS[-1]
    hits[f"frac_rank_gt_{last}"] = (values > last, exact | (values > last))
    return pd.DataFrame(
        {
            name: hit.astype("float64").where(known & decided)
            for name, (hit, decided) in hits.items()
        }
    )


def rank_fractions(rank: pd.Series, exact: pd.Series | None = None) -> pd.Series:
    """Cumulative fractions of the known ranks: ``frac_rank_le_1`` ... ``frac_rank_gt_1000``.

    Parameters
    ----------
    rank : Series
        1-based ranks; missing ranks are left out.
    exact : Series of bool, optional
        False where ``rank`` is a lower bound: it counts only in the fractions it decides.

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
    return _rank_hits(rank, exact).mean()


def rank_bucket_transitions(cmp: pd.DataFrame) -> pd.DataFrame:
    """Counts of tokens moving from each GLTR bucket on side a to each bucket on side b.

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`compare`. Tokens with an unknown rank on either side are left out;
        a lower bound is in the ``"bound"`` bucket unless it decides its range.

    Returns
    -------
    DataFrame
        5 x 5 integer crosstab, index ``rank_bucket_a``, columns ``rank_bucket_b``, both in
        :data:`RANK_BUCKETS` order (the last, ``"bound"``); zeros included.

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
    >>> moved.loc["1-10"].tolist()  # from ranks 1-10 to 1-10, 11-100, 101-1000, >1000, bound
    [2, 1, 0, 0, 0]
    """
    require_comparison(cmp, "rank_bucket_transitions")
    a = rank_bucket(cmp["rank_a"], exact_ranks(cmp, "_a"))
    b = rank_bucket(cmp["rank_b"], exact_ranks(cmp, "_b"))
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
        frac_rank_gt_1000``, over the trace's known ranks, a lower bound only where it
        decides), ``n_rank_bound`` (lower-bound ranks), ``first_off_top1_step`` (first
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
    exact = exact_ranks(df)
    out = out.join(_rank_hits(rank, exact).groupby(df["trace_id"], sort=False).mean())
    out["n_rank_bound"] = (~exact).groupby(df["trace_id"], sort=False).sum()
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
        mean_logprob, frac_rank_le_1`` (share of rank-1 tokens among those whose rank
        decides it), ``ppl``, ``wall_s`` (``attrs["wall_s"]`` when the caller timed the run,
        else ``None``) and ``n_rank_bound`` (lower-bound ranks).

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
        rows.append(
            {
                "engine": name,
                "path": df.attrs.get("engine_path"),
                "traces": df["trace_id"].nunique(),
                "tokens": len(df),
                "mean_logprob": df["logprob"].mean(),
                "frac_rank_le_1": _rank_hits(df["rank"], exact_ranks(df))["frac_rank_le_1"].mean(),
                "ppl": float(np.exp(-df["logprob"].mean())),
                "wall_s": df.attrs.get("wall_s"),
                "n_rank_bound": int((~exact_ranks(df)).sum()),
            }
        )
    return pd.DataFrame(rows)
