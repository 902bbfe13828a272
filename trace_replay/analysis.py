"""Metrics over replay frames: pandas in, pandas out.

A replay frame has one row per (trace, step). :func:`compare` joins two of them (or one
against its own ``ref_logprob`` column) into a comparison frame with ``_a``/``_b`` columns;
the other functions reduce either kind of frame to per-trace or per-dataset tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = [
    "RANK_BUCKETS",
    "rank_bucket",
    "compare",
    "summarize",
    "dataset_summary",
    "rank_bucket_transitions",
    "trace_summary",
    "engine_table",
]

RANK_BUCKETS = ("top-10", "top-100", "top-1000", "rest")
_BUCKET_EDGES = [0, 10, 100, 1000, np.inf]
_KEY = ["trace_id", "step"]
_REQUIRED = ("trace_id", "step", "token_id", "logprob", "rank")
_SIDE_COLUMNS = ("logprob", "rank", "top_token_ids", "top_logprobs", "top_tokens", "entropy")


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


def _float64(series: pd.Series) -> np.ndarray:
    return pd.to_numeric(series).to_numpy(dtype="float64", na_value=np.nan)


def _check_frame(df: pd.DataFrame, name: str) -> None:
    missing = [c for c in _REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{name} lacks replay columns {missing}")
    dup = df.duplicated(_KEY)
    if dup.any():
        row = df.loc[dup.idxmax()]
        raise ValueError(f"{name} has duplicate rows for trace {row.trace_id!r} step {row.step}")


def _ref_side(df: pd.DataFrame) -> pd.DataFrame:
    if "ref_logprob" not in df.columns:
        raise ValueError('compare(df, "ref") needs a ref_logprob column')
    ref = df[["trace_id", "step", "token_id", "ref_logprob"]].rename(
        columns={"ref_logprob": "logprob"}
    )
    ref["rank"] = pd.array([pd.NA] * len(ref), dtype="Int64")
    ref.attrs = {"source": "trace reference logprobs"}
    return ref


def _first_mismatch(a: pd.DataFrame, b: pd.DataFrame, name: str) -> str:
    joined = a[_KEY].merge(b[_KEY], how="left", on=_KEY, indicator=True)
    row = joined.loc[(joined["_merge"] == "left_only").idxmax()]
    return f"first only in {name}: trace {row.trace_id!r} step {row.step}"


def compare(
    a: pd.DataFrame,
    b: pd.DataFrame | str,
    *,
    labels: tuple[str, str] | None = None,
) -> pd.DataFrame:
    """Join two replay frames on (trace_id, step) into a per-token comparison frame.

    Parameters
    ----------
    a, b : DataFrame
        Replay frames of the same traces. ``b="ref"`` compares ``a`` against its own
        ``ref_logprob`` column: side a is then the trace's recorded logprobs (rank unknown,
        ``<NA>``) and side b the replay.
    labels : tuple of str, optional
        Names of the two sides, stored in ``attrs["labels"]`` for legends. Default
        ``("a", "b")``, or ``("ref", "replay")`` for ``b="ref"``.

    Returns
    -------
    DataFrame
        One row per token, ordered by trace (first appearance in ``a``) then step:
        ``trace_id, step, position, token, token_id, logprob_a, logprob_b, delta`` (b - a),
        ``abs_delta, ratio`` (exp delta), ``k3`` (exp delta - 1 - delta), ``rank_a, rank_b``
        (Int64), ``top1_a, top1_b, top1_agree`` (boolean, ``<NA>`` when a rank is unknown),
        ``bitwise_equal`` (identical float64 bit patterns: 0.0 and -0.0 differ, NaN equals
        only a NaN with the same payload), ``nonfinite`` (either logprob is not finite), and
        ``top_token_ids_*``, ``top_logprobs_*``, ``top_tokens_*``, ``entropy_*`` when present.
        ``attrs`` holds ``labels``, ``attrs_a`` and ``attrs_b``.

    Raises
    ------
    ValueError
        If the (trace_id, step) sets differ or a token id differs between the sides.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> compare(a, b, labels=("fp32", "bf16"))[["step", "delta", "rank_a", "rank_b"]]
       step  delta  rank_a  rank_b
    0     0   0.00       1       1
    1     1  -0.25       2       3
    2     2   0.00       1       1
    """
    if isinstance(b, str):
        if b != "ref":
            raise ValueError(f'b must be a DataFrame or "ref", got {b!r}')
        _check_frame(a, "a")
        a, b = _ref_side(a), a
        labels = labels or ("ref", "replay")
    labels = tuple(labels or ("a", "b"))
    _check_frame(a, f"a ({labels[0]})")
    _check_frame(b, f"b ({labels[1]})")

    keys_a = pd.MultiIndex.from_frame(a[_KEY])
    keys_b = pd.MultiIndex.from_frame(b[_KEY])
    only_a, only_b = (~keys_a.isin(keys_b)).sum(), (~keys_b.isin(keys_a)).sum()
    if only_a or only_b:
        first = _first_mismatch(a, b, "a") if only_a else _first_mismatch(b, a, "b")
        raise ValueError(
            f"(trace_id, step) sets differ: {only_a} rows only in a ({labels[0]}), "
            f"{only_b} rows only in b ({labels[1]}); {first}"
        )

    shared = [c for c in ("position", "token") if c in a.columns or c in b.columns]
    side_a = a[[*_KEY, "token_id", *[c for c in shared if c in a.columns]]]
    side_b = b[[*_KEY, "token_id", *[c for c in shared if c not in a.columns]]]
    order = {t: i for i, t in enumerate(pd.unique(a["trace_id"]))}
    base = side_a.merge(side_b, on=_KEY, suffixes=("", "_b")).sort_values(
        _KEY, key=lambda s: s.map(order) if s.name == "trace_id" else s, kind="stable"
    )
    mismatch = base["token_id"].to_numpy() != base["token_id_b"].to_numpy()
    if mismatch.any():
        row = base[mismatch].iloc[0]
        raise ValueError(
            f"token ids differ: first at trace {row.trace_id!r} step {row.step} "
            f"({labels[0]}: {row.token_id}, {labels[1]}: {row.token_id_b})"
        )
    cmp = base.drop(columns="token_id_b")
    for side, frame in (("a", a), ("b", b)):
        cols = [c for c in _SIDE_COLUMNS if c in frame.columns]
        renamed = frame[[*_KEY, *cols]].rename(columns={c: f"{c}_{side}" for c in cols})
        cmp = cmp.merge(renamed, on=_KEY)  # keeps the left (sorted) row order
    cmp = cmp.reset_index(drop=True)

    la, lb = _float64(cmp["logprob_a"]), _float64(cmp["logprob_b"])
    with np.errstate(invalid="ignore", over="ignore"):
        delta = lb - la
        cmp["delta"] = delta
        cmp["abs_delta"] = np.abs(delta)
        cmp["ratio"] = np.exp(delta)
        cmp["k3"] = np.expm1(delta) - delta
    for side in ("a", "b"):
        cmp[f"rank_{side}"] = pd.array(cmp[f"rank_{side}"], dtype="Int64")
        cmp[f"top1_{side}"] = (cmp[f"rank_{side}"] == 1).astype("boolean")
    cmp["top1_agree"] = cmp["top1_a"] == cmp["top1_b"]
    cmp["bitwise_equal"] = la.view(np.int64) == lb.view(np.int64)
    cmp["nonfinite"] = ~(np.isfinite(la) & np.isfinite(lb))

    first = [*_KEY, *shared, "token_id", "logprob_a", "logprob_b", "delta", "abs_delta",
             "ratio", "k3", "rank_a", "rank_b", "top1_a", "top1_b", "top1_agree",
             "bitwise_equal", "nonfinite"]  # fmt: skip
    cmp = cmp[first + [c for c in cmp.columns if c not in first]]
    cmp.attrs = {"labels": labels, "attrs_a": dict(a.attrs), "attrs_b": dict(b.attrs)}
    return cmp


def _divergent(cmp: pd.DataFrame, tol: float) -> pd.Series:
    delta = cmp["delta"].astype("float64")
    return (delta.abs() > tol) | ~np.isfinite(delta)


def _first_step(df: pd.DataFrame, mask: pd.Series) -> pd.Series:
    steps = df["step"].where(mask.fillna(False).astype(bool))
    return steps.groupby(df["trace_id"], sort=False).min().astype("Int64")


def summarize(cmp: pd.DataFrame, *, tol: float = 1e-3) -> pd.DataFrame:
    """Per-trace summary of a comparison frame.

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`compare`.
    tol : float
        A step diverges when ``abs_delta > tol`` (strictly) or its delta is not finite.

    Returns
    -------
    DataFrame
        One row per trace, in order of first appearance: ``trace_id, n_tokens,
        first_divergence_step, first_rank_flip_step`` (exactly one side top-1),
        ``first_bitwise_step`` (Int64, ``<NA>`` when none), ``n_nonfinite``,
        ``mean_abs_delta, sum_delta`` (sequence log importance ratio; both over finite
        deltas), ``max_abs_delta`` (inf when any delta is not finite), ``ppl_a, ppl_b``
        (exp of minus the mean logprob).

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> summary = summarize(compare(a, b), tol=0.1)
    >>> summary[["trace_id", "n_tokens", "first_divergence_step", "max_abs_delta"]]
      trace_id  n_tokens  first_divergence_step  max_abs_delta
    0        t         3                      1           0.25
    """
    delta = cmp["delta"].astype("float64")
    finite = delta.where(np.isfinite(delta))
    g = cmp.groupby("trace_id", sort=False)
    out = pd.DataFrame({"n_tokens": g.size()})
    out["first_divergence_step"] = _first_step(cmp, _divergent(cmp, tol))
    out["first_rank_flip_step"] = _first_step(cmp, cmp["top1_a"] != cmp["top1_b"])
    out["first_bitwise_step"] = _first_step(cmp, ~cmp["bitwise_equal"])
    out["n_nonfinite"] = (~np.isfinite(delta)).groupby(cmp["trace_id"], sort=False).sum()
    out["mean_abs_delta"] = finite.abs().groupby(cmp["trace_id"], sort=False).mean()
    out["max_abs_delta"] = delta.abs().fillna(np.inf).groupby(cmp["trace_id"], sort=False).max()
    out["sum_delta"] = finite.groupby(cmp["trace_id"], sort=False).sum()
    for side in ("a", "b"):
        out[f"ppl_{side}"] = np.exp(-g[f"logprob_{side}"].mean().astype("float64"))
    return out.reset_index()


def _bucket_fractions(rank: pd.Series) -> pd.Series:
    buckets = rank_bucket(rank).dropna()
    counts = buckets.value_counts().reindex(list(RANK_BUCKETS), fill_value=0)
    return counts / len(buckets) if len(buckets) else counts.astype(float) * np.nan


def dataset_summary(cmp: pd.DataFrame) -> pd.DataFrame:
    """Dataset-level metrics of a comparison frame, as a tidy ``metric``/``value`` table.

    Long form reads top to bottom in a notebook and concatenates across runs
    (``pd.concat(..., keys=runs)``). |delta| statistics use finite deltas; ``max_abs_delta``
    is inf and ``frac_ratio_outside_0.5_2`` counts the token when a delta is not finite.
    Bucket fractions of a side with unknown ranks (``"ref"``) are NaN.

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`compare`.

    Returns
    -------
    DataFrame
        Columns ``metric`` (str) and ``value`` (float): ``n_traces, n_tokens,
        mean_abs_delta, median_abs_delta, p99_abs_delta, max_abs_delta, mean_k3,
        frac_ratio_outside_0.5_2, top1_agree, frac_bitwise_equal, frac_nonfinite`` and
        ``frac_top10_a ... frac_rest_b``.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> metrics = dataset_summary(compare(a, b)).set_index("metric")["value"]
    >>> metrics[["n_tokens", "max_abs_delta", "top1_agree"]].tolist()
    [3.0, 0.25, 1.0]
    """
    delta = cmp["delta"].astype("float64")
    finite = delta[np.isfinite(delta)]
    abs_finite = finite.abs()
    any_nonfinite = len(finite) < len(delta)
    ratio = np.exp(delta)
    metrics = {
        "n_traces": cmp["trace_id"].nunique(),
        "n_tokens": len(cmp),
        "mean_abs_delta": abs_finite.mean(),
        "median_abs_delta": abs_finite.median(),
        "p99_abs_delta": abs_finite.quantile(0.99) if len(finite) else np.nan,
        "max_abs_delta": np.inf if any_nonfinite else abs_finite.max(),
        "mean_k3": cmp["k3"].astype("float64")[np.isfinite(delta)].mean(),
        "frac_ratio_outside_0.5_2": float((~((ratio >= 0.5) & (ratio <= 2))).mean()),
        "top1_agree": cmp["top1_agree"].astype("Float64").mean(),
        "frac_bitwise_equal": cmp["bitwise_equal"].mean(),
        "frac_nonfinite": cmp["nonfinite"].mean(),
    }
    for side in ("a", "b"):
        fractions = _bucket_fractions(cmp[f"rank_{side}"])
        for bucket, value in fractions.items():
            metrics[f"frac_{bucket.replace('-', '')}_{side}"] = value
    values = [float(v) if pd.notna(v) else np.nan for v in metrics.values()]
    return pd.DataFrame({"metric": list(metrics), "value": np.array(values, dtype="float64")})


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
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(rank=[1, 30, 1])
    >>> rank_bucket_transitions(compare(a, b)).loc["top-10"].tolist()  # to top-10 ... rest
    [2, 1, 0, 0]
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
        mean_logprob, ppl, top1_frac, frac_top10, frac_top100, frac_top1000, frac_rest,
        first_off_top1_step`` (first step with rank > 1, Int64, ``<NA>`` when none),
        ``min_logprob, mean_entropy`` (NaN when the engine gave no entropy).

    Examples
    --------
    >>> df = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "logprob": [-0.5, -1.0, -2.0],
    ...                    "rank": [1, 2, 1]})
    >>> trace_summary(df)[["trace_id", "n_tokens", "ppl", "top1_frac", "first_off_top1_step"]]
      trace_id  n_tokens       ppl  top1_frac  first_off_top1_step
    0        t         3  3.211271   0.666667                    1
    """
    logprob = pd.Series(_float64(df["logprob"]), index=df.index)
    rank = df["rank"].astype("Int64")
    known = rank.notna()
    buckets = rank_bucket(rank)
    entropy = df["entropy"] if "entropy" in df.columns else pd.Series(np.nan, index=df.index)

    def per_trace(values: pd.Series) -> pd.Series:
        return values.groupby(df["trace_id"], sort=False).mean()

    out = pd.DataFrame({"n_tokens": df.groupby("trace_id", sort=False).size()})
    out["mean_logprob"] = per_trace(logprob)
    out["ppl"] = np.exp(-out["mean_logprob"])
    out["top1_frac"] = per_trace((rank == 1).astype("float64").where(known))
    for bucket in RANK_BUCKETS:
        hit = (buckets == bucket).astype("float64").where(known)
        out[f"frac_{bucket.replace('-', '')}"] = per_trace(hit)
    out["first_off_top1_step"] = _first_step(df, rank > 1)
    out["min_logprob"] = logprob.groupby(df["trace_id"], sort=False).min()
    out["mean_entropy"] = per_trace(pd.Series(_float64(entropy), index=df.index))
    return out.reset_index()


def engine_table(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per run of the same traces: size, mean logprob, top-1 agreement, perplexity.

    Parameters
    ----------
    results : dict of str to DataFrame
        Replay frames by run label (e.g. ``"torch float32"``).

    Returns
    -------
    DataFrame
        ``engine`` (the label), ``path`` (``attrs["engine_path"]``), ``traces, tokens,
        mean_logprob, top1_agreement`` (share of rank-1 tokens), ``ppl`` and ``wall_s``
        (``attrs["wall_s"]`` when the caller timed the run, else ``None``).

    Examples
    --------
    >>> run = pd.DataFrame({"trace_id": ["t", "t"], "step": [0, 1], "logprob": [-0.5, -1.5],
    ...                     "rank": [1, 4]})
    >>> engine_table({"torch": run})[["engine", "tokens", "mean_logprob", "top1_agreement"]]
      engine  tokens  mean_logprob  top1_agreement
    0  torch       2          -1.0             0.5
    """
    rows = []
    for name, df in results.items():
        rows.append({"engine": name, "path": df.attrs.get("engine_path"),
                     "traces": df["trace_id"].nunique(), "tokens": len(df),
                     "mean_logprob": df["logprob"].mean(),
                     "top1_agreement": (df["rank"] == 1).mean(),
                     "ppl": float(np.exp(-df["logprob"].mean())),
                     "wall_s": df.attrs.get("wall_s")})
    return pd.DataFrame(rows)
