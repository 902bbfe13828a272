"""Metrics over replay frames: pandas in, pandas out.

A replay frame has one row per (trace, step). :func:`compare` joins two of them (or one
against its own ``ref_logprob`` column) into a comparison frame with ``_a``/``_b`` columns;
the other functions reduce either kind of frame to per-trace or per-dataset tables.

Sides
-----
Side a is the *behaviour* run, the one the trace tokens were drawn from: in RL the rollout
engine (vLLM, SGLang); for ``compare(df, "ref")`` the trace's recorded logprobs. Side b is
the *target* run: in RL the trainer's forward pass. Every difference is b − a
(``delta = logprob_b - logprob_a``), every ratio b / a (``ratio = p_b / p_a``, verl's
importance weight ρ = π_train / π_rollout), every KL estimate is of KL(a ‖ b), and a pair
is named "b vs a". So ``compare(rollout, trainer)`` gives the numbers a trainer logs. The
KL estimates are unbiased only when the trace tokens were sampled from a; for other traces
(human-written text, a third model's output) they are mismatch statistics, not KLs, and k1
and chi-squared can come out negative (a `NegativeEstimateWarning` says so; k3 cannot).

Names
-----
- ``n_<what>``: a count (``n_tokens``, ``n_bit_mismatch``).
- ``frac_<predicate>``: the fraction of tokens for which a per-token predicate holds;
  ``frac_top1_agree`` is the mean of the boolean ``top1_agree`` column, ``frac_rank_le_10``
  the fraction with rank <= 10 (rank fractions are cumulative, ``frac_rank_le_K``, plus
  ``frac_rank_gt_1000``; GLTR buckets are labelled by their rank ranges, ``"11-100"``).
- ``<stat>_<quantity>``: a statistic of a per-token column (``mean_abs_delta``,
  ``p99_abs_delta``, ``std_ratio``, ``max_ulp_distance``, ``mean_k3``).
- ``first_<event>_step``: the first step at which the event happens, ``<NA>`` when it never
  does (``first_divergence_step``, ``first_rank_flip_step``, ``first_bit_mismatch_step``,
  ``first_off_top1_step``).
- ``<column>_a`` / ``<column>_b``: one side's value in a comparison frame.
- Divergences keep their trainers' names: ``chi2_token``, ``chi2_seq``, ``ess``.

Trainer names
-------------
Defined precisely in :func:`trace_replay.analysis.mismatch.trainer_metrics`; in
:func:`dataset_summary`:

====================================================  ====================================
trainer metric                                        here
====================================================  ====================================
verl ``rollout_corr/kl``                              ``mean_k1``
verl ``rollout_corr/k3_kl``                           ``mean_k3``
verl ``rollout_corr/chi2_token``, ``chi2_seq``        ``chi2_token``, ``chi2_seq``
verl ``rollout_corr/rollout_is_{mean,std,min,max}``   ``{mean,std,min,max}_ratio``
verl ``rollout_corr/rollout_is_eff_sample_size``      ``ess``
verl ``rollout_is_ratio_fraction_{low,high}`` (2.0)   ``frac_ratio_outside_0.5_2`` (sum)
verl ``training/rollout_probs_diff_{mean,std,max}``   ``{mean,std,max}_abs_delta_prob``
slime ``train_rollout_logprob_abs_diff``              ``mean_abs_delta``
prime-rl ``logprob_bit_mismatch``                     ``n_bit_mismatch``, ``frac_bit_mismatch``
float32 ULP distance of the logprobs                  ``mean_ulp_distance``, ``max_ulp_distance``
====================================================  ====================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from trace_replay.analysis.mismatch import (
    NOISE_SE,
    ROUNDING_NATS,
    NegativeEstimateWarning,
    bit_mismatch,
    require_comparison,
    trainer_metrics,
    ulp_distance,
    warn_negative,
)
from trace_replay.analysis.ranks import (
    RANK_BUCKETS,
    as_float64,
    engine_table,
    exact_ranks,
    first_step,
    rank_bucket,
    rank_bucket_transitions,
    rank_fractions,
    trace_summary,
)
from trace_replay.analysis.same_traces import same_traces
from trace_replay.runs.frame import check_frame
from trace_replay.wording import plural

# the rank-bucket and single-run names live in trace_replay.analysis.ranks; re-exported here, where
# they have always been imported from
__all__ = [
    "NegativeEstimateWarning",
    "RANK_BUCKETS",
    "rank_bucket",
    "run_labels",
    "compare",
    "summarize",
    "dataset_summary",
    "rank_bucket_transitions",
    "trace_summary",
    "engine_table",
]

_KEY = ["trace_id", "step"]
_SIDE_COLUMNS = (
    "logprob",
    "rank",
    "rank_exact",
    "top_token_ids",
    "top_logprobs",
    "top_tokens",
    "entropy",
)


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


_LABEL_FIELDS = ("engine", "dtype", "device")


def run_labels(attrs: Sequence[Mapping], *, fields: Sequence[str] = _LABEL_FIELDS) -> list[str]:
    """Short names for runs, from their provenance, keeping only the fields that differ.

    Parameters
    ----------
    attrs : sequence of dict
        Each run's ``df.attrs``.
    fields : sequence of str
        Provenance keys that name a run, in label order.

    Returns
    -------
    list of str
        One label per run: the values of the fields that differ between the runs (all
        fields for a single run or when none differ), joined by spaces. A run with none of
        the fields is named by its letter ("a", "b", ...); runs whose labels would
        coincide get " #1", " #2", ... appended.

    Examples
    --------
    >>> run_labels([{"engine": "torch", "dtype": "float32", "device": "cpu"},
    ...             {"engine": "torch", "dtype": "bfloat16", "device": "cpu"}])
    ['float32', 'bfloat16']
    >>> run_labels([{"engine": "vllm", "dtype": "float32", "device": "cpu"}])
    ['vllm float32 cpu']
    """
    values = [[str(a[f]) if a.get(f) not in (None, "") else "" for f in fields] for a in attrs]
    if len(values) > 1:
        differing = [i for i in range(len(fields)) if len({v[i] for v in values}) > 1]
        if differing:
            values = [[v[i] for i in differing] for v in values]
    labels = [" ".join(x for x in v if x) or chr(ord("a") + i) for i, v in enumerate(values)]
    if len(set(labels)) < len(labels):
        labels = [f"{label} #{i + 1}" for i, label in enumerate(labels)]
    return labels


def compare(
    a: pd.DataFrame,
    b: pd.DataFrame | str,
    *,
    labels: tuple[str, str] | None = None,
    drop_mismatched: bool = False,
) -> pd.DataFrame:
    """Join two replay frames on (trace_id, step) into a per-token comparison frame.

    Traces are paired by id only where both runs scored the same prompt and trace tokens
    (:mod:`~trace_replay.analysis.same_traces`: equal ``tokens_digest``, or for frames
    without one, equal token columns).

    Parameters
    ----------
    a, b : DataFrame
        Replay frames of the same traces: a the behaviour run (rollout), b the target run
        (trainer); see the module docstring. ``b="ref"`` compares ``a`` against its own
        ``ref_logprob`` column: side a is then the trace's recorded logprobs (rank unknown,
        ``<NA>``) and side b the replay.
    labels : tuple of str, optional
        Names of the two sides, stored in ``attrs["labels"]`` for legends and titles.
        Default: :func:`run_labels` of the two frames' attrs (engine, dtype, device, only
        those that differ), or ``("ref", "replay")`` for ``b="ref"``.
    drop_mismatched : bool
        Leave out the traces whose tokens differ between a and b, with a
        :class:`~trace_replay.analysis.same_traces.TracesLeftOut` warning saying how many
        (their ids in ``attrs["left_out"]``); by default they are an error.

    Returns
    -------
    DataFrame
        One row per token, ordered by trace (first appearance in ``a``) then step:
        ``trace_id, step, position, token`` (and ``turn, role`` for chat traces),
        ``token_id, logprob_a, logprob_b``,
        ``delta`` (logprob_b - logprob_a), ``abs_delta``, ``ratio`` (exp(delta) = p_b / p_a),
        ``k1`` (-delta), ``k3`` (ratio - 1 - delta), ``abs_delta_prob``
        (|p_b - p_a|), ``rank_a, rank_b`` (Int64), ``rank_exact_a, rank_exact_b`` (boolean:
        False where that rank is only a lower bound, as a side's ``rank_exact`` column says;
        True where it has none; ``<NA>`` with the rank), ``top1_a, top1_b`` (rank == 1;
        ``<NA>`` for a bound of 1), ``top1_agree`` (top1_a == top1_b; boolean, ``<NA>``
        when a top-1 is unknown),
        ``bit_mismatch`` (the float32 logprobs differ in any bit, see
        :func:`~trace_replay.analysis.mismatch.bit_mismatch`), ``ulp_distance`` (Int64, float32
        ULPs, see :func:`~trace_replay.analysis.mismatch.ulp_distance`), ``nonfinite`` (either
        logprob is not finite), and ``top_token_ids_*``, ``top_logprobs_*``,
        ``top_tokens_*``, ``entropy_*`` when present. ``attrs`` holds ``labels``,
        ``attrs_a`` and ``attrs_b``.

    Raises
    ------
    TracesDiffer
        (a ValueError) If a trace id holds other prompt or trace tokens in a than in b,
        naming how many and the first ones, unless ``drop_mismatched``.
    ValueError
        If the (trace_id, step) sets differ or a token id differs between the sides.

    Examples
    --------
    >>> rollout = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                         "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> rollout.attrs = {"engine": "vllm", "dtype": "bfloat16", "device": "cpu"}
    >>> trainer = rollout.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> trainer.attrs = {"engine": "prefill", "dtype": "float32", "device": "cpu"}
    >>> cmp = compare(rollout, trainer)
    >>> cmp.attrs["labels"]
    ('vllm bfloat16', 'prefill float32')
    >>> cmp[["step", "delta", "rank_a", "rank_b", "top1_agree"]]
       step  delta  rank_a  rank_b  top1_agree
    0     0   0.00       1       1        True
    1     1  -0.25       2       3        True
    2     2   0.00       1       1        True
    """
    paired_with_ref = isinstance(b, str)  # both sides are one frame's rows
    if isinstance(b, str):
        if b != "ref":
            raise ValueError(f'b must be a DataFrame or "ref", got {b!r}')
        check_frame(a, "a")
        a, b = _ref_side(a), a
        labels = labels or ("ref", "replay")
    labels = tuple(labels or run_labels([a.attrs, b.attrs]))
    check_frame(a, f"a ({labels[0]})")
    check_frame(b, f"b ({labels[1]})")
    left_out: list[str] = []
    if not paired_with_ref:
        a, b, left_out = same_traces(
            a, b, labels=(f"a ({labels[0]})", f"b ({labels[1]})"), drop_mismatched=drop_mismatched
        )

    keys_a = pd.MultiIndex.from_frame(a[_KEY])
    keys_b = pd.MultiIndex.from_frame(b[_KEY])
    only_a, only_b = (~keys_a.isin(keys_b)).sum(), (~keys_b.isin(keys_a)).sum()
    if only_a or only_b:
        first = _first_mismatch(a, b, "a") if only_a else _first_mismatch(b, a, "b")
        raise ValueError(
            f"(trace_id, step) sets differ: {only_a} rows only in a ({labels[0]}), "
            f"{only_b} rows only in b ({labels[1]}); {first}"
        )

    # per-token facts of the trace itself, not of a run: kept once
    shared = [c for c in ("position", "token", "turn", "role") if c in a.columns or c in b.columns]
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

    la, lb = as_float64(cmp["logprob_a"]), as_float64(cmp["logprob_b"])
    with np.errstate(invalid="ignore", over="ignore"):
        delta = lb - la
        cmp["delta"] = delta
        cmp["abs_delta"] = np.abs(delta)
        cmp["ratio"] = np.exp(delta)
        cmp["k1"] = -delta
        cmp["k3"] = np.expm1(delta) - delta
        cmp["abs_delta_prob"] = np.abs(np.exp(lb) - np.exp(la))
    for side in ("a", "b"):
        rank = cmp[f"rank_{side}"] = pd.array(cmp[f"rank_{side}"], dtype="Int64")
        exact = pd.array(exact_ranks(cmp, f"_{side}"), dtype="boolean")
        exact[pd.isna(rank)] = pd.NA
        cmp[f"rank_exact_{side}"] = exact
        top1 = pd.array(rank == 1, dtype="boolean")
        top1[(rank == 1).fillna(False) & ~exact.fillna(True)] = pd.NA  # a bound of 1: >= 1
        cmp[f"top1_{side}"] = top1
    cmp["top1_agree"] = cmp["top1_a"] == cmp["top1_b"]
    cmp["bit_mismatch"] = bit_mismatch(la, lb)
    cmp["ulp_distance"] = ulp_distance(la, lb)
    cmp["nonfinite"] = ~(np.isfinite(la) & np.isfinite(lb))

    first = [
        *_KEY,
        *shared,
        "token_id",
        "logprob_a",
        "logprob_b",
        "delta",
        "abs_delta",
        "ratio",
        "k1",
        "k3",
        "abs_delta_prob",
        "rank_a",
        "rank_b",
        "rank_exact_a",
        "rank_exact_b",
        "top1_a",
        "top1_b",
        "top1_agree",
        "bit_mismatch",
        "ulp_distance",
        "nonfinite",
    ]
    cmp = cmp[first + [c for c in cmp.columns if c not in first]]
    cmp.attrs = {"labels": labels, "attrs_a": dict(a.attrs), "attrs_b": dict(b.attrs)}
    if left_out:
        cmp.attrs["left_out"] = left_out
    return cmp


def _divergent(cmp: pd.DataFrame, tol: float) -> pd.Series:
    delta = cmp["delta"].astype("float64")
    return (delta.abs() > tol) | ~np.isfinite(delta)


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
        ``first_bit_mismatch_step`` (first step whose float32 logprobs differ in any bit;
        all three Int64, ``<NA>`` when none), ``n_bit_mismatch, n_nonfinite``,
        ``mean_abs_delta``, ``max_abs_delta`` (inf when any delta is not finite),
        ``sum_delta`` (the log of the sequence importance ratio), ``mean_k1, mean_k3``
        (per-trace KL(a ‖ b) estimates), ``max_ulp_distance`` (Int64), ``ppl_a, ppl_b``
        (exp of minus the mean logprob) and ``n_rank_bound_a, n_rank_bound_b`` (ranks that
        are only lower bounds; a bound is never a top-1 flip). Delta statistics use finite
        deltas.

    Raises
    ------
    ValueError
        If ``cmp`` is not a comparison frame (a replay frame needs ``compare`` first).

    Warns
    -----
    NegativeEstimateWarning
        Once, when some trace's ``mean_k1`` is negative by more than three standard errors
        (beyond sampling noise): k1 is unbiased only on tokens sampled from side a, so these
        traces are not such samples (``mean_k3`` is >= 0).

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
    require_comparison(cmp, "summarize", one=True)
    delta = cmp["delta"].astype("float64")
    finite = delta.where(np.isfinite(delta))
    by_trace = cmp["trace_id"]
    g = cmp.groupby("trace_id", sort=False)
    out = pd.DataFrame({"n_tokens": g.size()})
    out["first_divergence_step"] = first_step(cmp, _divergent(cmp, tol))
    out["first_rank_flip_step"] = first_step(cmp, cmp["top1_a"] != cmp["top1_b"])
    out["first_bit_mismatch_step"] = first_step(cmp, cmp["bit_mismatch"])
    out["n_bit_mismatch"] = cmp["bit_mismatch"].groupby(by_trace, sort=False).sum()
    out["n_nonfinite"] = (~np.isfinite(delta)).groupby(by_trace, sort=False).sum()
    out["mean_abs_delta"] = finite.abs().groupby(by_trace, sort=False).mean()
    out["max_abs_delta"] = delta.abs().fillna(np.inf).groupby(by_trace, sort=False).max()
    out["sum_delta"] = finite.groupby(by_trace, sort=False).sum()
    out["mean_k1"] = (-finite).groupby(by_trace, sort=False).mean()
    out["mean_k3"] = (np.expm1(finite) - finite).groupby(by_trace, sort=False).mean()
    out["max_ulp_distance"] = cmp["ulp_distance"].groupby(by_trace, sort=False).max()
    for side in ("a", "b"):
        out[f"ppl_{side}"] = np.exp(-g[f"logprob_{side}"].mean().astype("float64"))
    for side in ("a", "b"):
        out[f"n_rank_bound_{side}"] = (
            (~exact_ranks(cmp, f"_{side}")).groupby(by_trace, sort=False).sum()
        )
    se_k1 = (-finite).groupby(by_trace, sort=False).std() / np.sqrt(
        finite.notna().groupby(by_trace, sort=False).sum()
    )
    _warn_negative_traces(out["mean_k1"], se_k1)
    return out.reset_index()


def _warn_negative_traces(mean_k1: pd.Series, se: pd.Series) -> None:
    """One warning for the traces whose mean_k1 is negative beyond its standard error."""
    # a rounding of ROUNDING_NATS on every delta moves a mean of them by as much
    negative = mean_k1[mean_k1 < -(NOISE_SE * se.fillna(0) + ROUNDING_NATS)]
    if len(negative):
        lowest = negative.idxmin()
        name = (
            f"mean_k1 of {len(negative)} of {plural(len(mean_k1), 'trace')} "
            f"(lowest: trace {lowest!r})"
        )
        warn_negative({name: (negative[lowest], se[lowest], ROUNDING_NATS)}, stacklevel=4)


def dataset_summary(cmp: pd.DataFrame) -> pd.DataFrame:
    """Dataset-level metrics of a comparison frame, as a tidy ``metric``/``value`` table.

    Long form reads top to bottom in a notebook and concatenates across runs
    (``pd.concat(..., keys=runs)``). Statistics of delta use finite deltas; ``max_abs_delta``
    is inf when a delta is not finite. Rank fractions and top-1 agreement of a side with
    unknown ranks (``"ref"``) are NaN.

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`compare`.

    Returns
    -------
    DataFrame
        Columns ``metric`` (str) and ``value`` (float), in this order: ``n_traces,
        n_tokens, mean_abs_delta`` (slime ``train_rollout_logprob_abs_diff``),
        ``median_abs_delta, p99_abs_delta, max_abs_delta``, then the trainer metrics of
        :func:`~trace_replay.analysis.mismatch.trainer_metrics` (``mean_k1, mean_k3, chi2_token,
        chi2_seq, mean_ratio, std_ratio, min_ratio, max_ratio, ess,
        frac_ratio_outside_0.5_2, mean_abs_delta_prob, std_abs_delta_prob,
        max_abs_delta_prob, n_bit_mismatch, frac_bit_mismatch, mean_ulp_distance,
        max_ulp_distance``), then ``frac_top1_agree, n_nonfinite, frac_nonfinite`` and each
        side's cumulative rank fractions (:func:`~trace_replay.analysis.ranks.rank_fractions`)
        ``frac_rank_le_1_a, frac_rank_le_10_a, frac_rank_le_100_a, frac_rank_le_1000_a,
        frac_rank_gt_1000_a`` (a lower-bound rank counted only where it decides) and
        ``n_rank_bound_a`` (lower-bound ranks), then the same for ``_b``.

    Raises
    ------
    ValueError
        If ``cmp`` is not a comparison frame.

    Warns
    -----
    NegativeEstimateWarning
        When ``mean_k1``, ``chi2_token`` or ``chi2_seq`` is negative beyond its noise (see
        :func:`~trace_replay.analysis.mismatch.trainer_metrics`).

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> metrics = dataset_summary(compare(a, b)).set_index("metric")["value"]
    >>> metrics[["n_tokens", "max_abs_delta", "frac_top1_agree", "n_bit_mismatch"]].tolist()
    [3.0, 0.25, 1.0, 1.0]
    """
    require_comparison(cmp, "dataset_summary", one=True)
    delta = cmp["delta"].astype("float64")
    abs_finite = delta[np.isfinite(delta)].abs()
    metrics = {
        "n_traces": cmp["trace_id"].nunique(),
        "n_tokens": len(cmp),
        "mean_abs_delta": abs_finite.mean(),
        "median_abs_delta": abs_finite.median(),
        "p99_abs_delta": abs_finite.quantile(0.99) if len(abs_finite) else np.nan,
        "max_abs_delta": np.inf if len(abs_finite) < len(delta) else abs_finite.max(),
        **trainer_metrics(cmp),
        "frac_top1_agree": cmp["top1_agree"].astype("Float64").mean(),
        "n_nonfinite": cmp["nonfinite"].sum(),
        "frac_nonfinite": cmp["nonfinite"].mean(),
    }
    for side in ("a", "b"):
        exact = exact_ranks(cmp, f"_{side}")
        for name, value in rank_fractions(cmp[f"rank_{side}"], exact).items():
            metrics[f"{name}_{side}"] = value
        metrics[f"n_rank_bound_{side}"] = (~exact).sum()
    values = [float(v) if pd.notna(v) else np.nan for v in metrics.values()]
    return pd.DataFrame({"metric": list(metrics), "value": np.array(values, dtype="float64")})
