"""Tests for trace_replay.analysis.ranks: GLTR buckets and the single-run trace summary."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from trace_replay.analysis.metrics import compare, dataset_summary, summarize
from trace_replay.analysis.ranks import (
    RANK_BUCKETS,
    engine_table,
    rank_bucket,
    rank_bucket_transitions,
    trace_summary,
)


def frame(logprob, rank=None, *, trace_id="t", step=None, **extra) -> pd.DataFrame:
    """Replay frame; by default one trace "t" with steps 0..n-1, all rank 1."""
    n = len(logprob)
    return pd.DataFrame(
        {
            "trace_id": [trace_id] * n if isinstance(trace_id, str) else trace_id,
            "step": step or list(range(n)),
            "token_id": [100 + i for i in range(n)],
            "logprob": logprob,
            "rank": rank or [1] * n,
            **extra,
        }
    )


def test_rank_bucket_boundaries():
    """Buckets are (0, 10], (10, 100], (100, 1000], above, labelled by their ranks; NaN stays
    missing."""
    buckets = rank_bucket([1, 10, 11, 100, 101, 1000, 1001, np.nan])
    assert list(buckets.categories) == list(RANK_BUCKETS) and buckets.ordered
    assert [str(b) if pd.notna(b) else None for b in buckets] == [
        "1-10",
        "1-10",
        "11-100",
        "11-100",
        "101-1000",
        "101-1000",
        ">1000",
        None,
    ]


def test_rank_bucket_keeps_series_index():
    """A Series in gives a categorical Series with the same index."""
    out = rank_bucket(pd.Series([5, 500], index=[7, 9]))
    assert out.index.tolist() == [7, 9] and isinstance(out.dtype, pd.CategoricalDtype)


def test_rank_bucket_transitions_crosstab():
    """5 x 5 counts (the last, lower bounds), zeros included, rows side a and columns side b."""
    cmp = compare(frame([-1.0] * 3, [1, 50, 5000]), frame([-1.0] * 3, [2, 500, 5000]))
    table = rank_bucket_transitions(cmp)
    assert table.shape == (5, 5) and table.to_numpy().sum() == 3
    assert table.loc["1-10", "1-10"] == 1
    assert table.loc["11-100", "101-1000"] == 1
    assert table.loc[">1000", ">1000"] == 1


def test_trace_summary_hand_values():
    """Per-trace logprob, perplexity, cumulative rank fractions, first off-top-1 step."""
    df = frame(
        [-1.0, -3.0, -2.0, -0.5],
        [1, 20, 1, 1],
        trace_id=["t", "t", "t", "u"],
        step=[0, 1, 2, 0],
        entropy=[1.0, 2.0, np.nan, 0.5],
    )
    summary = trace_summary(df).set_index("trace_id")
    t, u = summary.loc["t"], summary.loc["u"]
    assert (t.n_tokens, t.mean_logprob, t.min_logprob) == (3, -2.0, -3.0)
    assert t.ppl == pytest.approx(math.exp(2.0))
    assert t.frac_rank_le_1 == pytest.approx(2 / 3) and t.frac_rank_le_10 == pytest.approx(2 / 3)
    assert t.frac_rank_le_100 == 1.0 and t.frac_rank_gt_1000 == 0.0
    assert t.first_off_top1_step == 1 and pd.isna(u.first_off_top1_step)
    assert t.mean_entropy == 1.5 and u.frac_rank_le_10 == 1.0


def test_trace_summary_without_entropy_column():
    """An engine without entropy gives NaN mean_entropy, not an error."""
    assert trace_summary(frame([-1.0]))["mean_entropy"].isna().all()


RANK_PREDICATES = {
    "frac_rank_le_1": lambda r: r <= 1,
    "frac_rank_le_10": lambda r: r <= 10,
    "frac_rank_le_100": lambda r: r <= 100,
    "frac_rank_le_1000": lambda r: r <= 1000,
    "frac_rank_gt_1000": lambda r: r > 1000,
}


def test_rank_fraction_names_say_what_they_count():
    """Every rank fraction of trace_summary and dataset_summary (each side) is the fraction of
    known ranks its name states: frac_rank_le_K = mean(rank <= K), frac_rank_gt_K = mean(rank
    > K); the old names that mixed cumulative and per-bucket meanings (frac_top100 held ranks
    11-100) are gone."""
    from trace_replay.analysis.metrics import dataset_summary

    ranks = [1, 2, 10, 11, 100, 101, 1000, 1001, 5000, 7]
    other = [3, 1, 400, 12, 2000, 1, 1, 1000, 99, 10]
    df = frame([-1.0] * len(ranks), ranks)
    summary = trace_summary(df).iloc[0]
    table = dataset_summary(compare(df, frame([-1.0] * len(other), other)))
    values = table.set_index("metric")["value"]
    for name, holds in RANK_PREDICATES.items():
        assert summary[name] == pytest.approx(np.mean([holds(r) for r in ranks])), name
        assert values[f"{name}_a"] == pytest.approx(np.mean([holds(r) for r in ranks])), name
        assert values[f"{name}_b"] == pytest.approx(np.mean([holds(r) for r in other])), name
    names = [*summary.index, *values.index]
    assert [
        n
        for n in names
        if n.startswith("frac_")
        and "rank" in n
        and n.removesuffix("_a").removesuffix("_b") not in RANK_PREDICATES
    ] == []
    assert not [n for n in names if n.startswith("frac_top") and n != "frac_top1_agree"]


def test_rank_fractions_skip_unknown_ranks():
    """A missing rank counts in no fraction's numerator or denominator."""
    df = frame([-1.0] * 3, [1, 20, 1])
    df["rank"] = pd.array([1, pd.NA, 20], dtype="Int64")
    summary = trace_summary(df).iloc[0]
    assert (summary.frac_rank_le_1, summary.frac_rank_le_100) == (0.5, 1.0)


def test_single_run_summaries_refuse_a_comparison_frame_by_name(replay_df):
    """trace_summary and engine_table take one run's replay frame: a comparison frame is a
    ValueError naming the function and pointing at summarize (was a bare KeyError 'logprob')."""
    cmp = compare(replay_df, "ref")
    with pytest.raises(ValueError, match=r"trace_summary needs a replay frame .*summarize\(cmp\)"):
        trace_summary(cmp)
    with pytest.raises(ValueError, match=r"engine_table \(run 'x'\) needs a replay frame"):
        engine_table({"x": cmp})


def test_single_run_summaries_refuse_concatenated_runs(replay_df):
    """Two runs concatenated hold each trace step twice: trace_summary and engine_table would
    count them as one run (twice the tokens), so they are a ValueError naming the trace and
    step."""
    both = pd.concat([replay_df, replay_df.assign(logprob=replay_df["logprob"] - 1)])
    with pytest.raises(
        ValueError,
        match=r"^trace_summary takes one run, but df holds trace "
        r"'t0' step 0 more than once",
    ):
        trace_summary(both)
    with pytest.raises(ValueError, match=r"^engine_table \(run 'x'\) takes one run"):
        engine_table({"x": both})


def test_lower_bound_ranks_are_bounds_in_every_rank_statistic():
    """rank_exact False marks a lower bound (rank 21: above 20). It has its own bucket
    unless it decides one (a bound past 1000 is >1000), counts in a rank fraction only
    where it decides it (not <= 10, unknown for <= 100), is counted apart as n_rank_bound,
    and is never top-1 or a rank flip (a bound of 1 says nothing); compare carries it."""
    exact = frame([-1.0] * 4, [1, 21, 1001, 1])
    bounded = exact.assign(rank_exact=[True, False, False, False])
    assert rank_bucket(bounded["rank"], bounded["rank_exact"]).tolist() == [
        "1-10",
        "bound",
        ">1000",
        "bound",
    ]
    summary = trace_summary(bounded).iloc[0]
    assert summary["n_rank_bound"] == 3
    assert summary["frac_rank_le_1"] == pytest.approx(1 / 3)  # the bound of 1 is unknown
    assert summary["frac_rank_le_10"] == pytest.approx(1 / 3)  # 21 and 1001 are not <= 10
    assert summary["frac_rank_le_100"] == pytest.approx(1 / 2)  # 21 may be, or not
    assert summary["frac_rank_gt_1000"] == pytest.approx(1 / 2)
    assert engine_table({"server": bounded}).iloc[0]["n_rank_bound"] == 3
    cmp = compare(exact, bounded)
    assert cmp["rank_exact_a"].tolist() == [True] * 4
    assert cmp["rank_exact_b"].tolist() == [True, False, False, False]
    assert cmp["top1_b"].tolist()[:3] == [True, False, False] and pd.isna(cmp["top1_b"][3])
    per_trace = summarize(cmp).iloc[0]
    assert per_trace["n_rank_bound_b"] == 3 and pd.isna(per_trace["first_rank_flip_step"])
    metrics = dataset_summary(cmp).set_index("metric")["value"]
    assert metrics["n_rank_bound_a"] == 0 and metrics["n_rank_bound_b"] == 3
    assert metrics["frac_rank_le_100_b"] == pytest.approx(1 / 2)
    moved = rank_bucket_transitions(cmp)
    assert moved.loc["11-100", "bound"] == 1 and moved.loc[">1000", ">1000"] == 1
    assert moved.loc["1-10", "bound"] == 1 and moved.loc["1-10", "1-10"] == 1
