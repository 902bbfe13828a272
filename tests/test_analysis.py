"""Tests for trace_replay.analysis: hand-computed metrics on small frames."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_replay.analysis import (
    RANK_BUCKETS,
    compare,
    dataset_summary,
    rank_bucket,
    rank_bucket_transitions,
    summarize,
    trace_summary,
)


def frame(logprob, rank=None, *, trace_id="t", step=None, token_id=None, **extra) -> pd.DataFrame:
    """Replay frame; by default one trace "t" with steps 0..n-1, all rank 1."""
    n = len(logprob)
    return pd.DataFrame({
        "trace_id": [trace_id] * n if isinstance(trace_id, str) else trace_id,
        "step": step or list(range(n)),
        "position": [5 + i for i in range(n)],
        "token_id": token_id or [100 + i for i in range(n)],
        "token": [f"w{i}" for i in range(n)],
        "logprob": logprob,
        "rank": rank or [1] * n,
        **extra,
    })  # fmt: skip


def metric(table: pd.DataFrame, name: str) -> float:
    return table.set_index("metric").loc[name, "value"]


def test_delta_is_b_minus_a_with_ratio_and_k3():
    """delta = logprob_b - logprob_a; ratio = exp(delta); k3 = exp(delta) - 1 - delta."""
    cmp = compare(frame([-1.0, -2.0]), frame([-0.5, -2.5]))
    assert cmp["delta"].tolist() == [0.5, -0.5]
    assert cmp["abs_delta"].tolist() == [0.5, 0.5]
    assert cmp["ratio"].tolist() == pytest.approx([math.exp(0.5), math.exp(-0.5)])
    assert cmp["k3"].tolist() == pytest.approx([math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5])


def test_compare_columns_in_documented_order():
    """The documented per-token columns come first; side columns keep their _a/_b suffixes."""
    a = frame([-1.0], entropy=[0.5], top_token_ids=[[100, 7]], top_logprobs=[[-1.0, -2.0]])
    cmp = compare(a, a.copy())
    assert cmp.columns[:18].tolist() == [
        "trace_id", "step", "position", "token", "token_id", "logprob_a", "logprob_b", "delta",
        "abs_delta", "ratio", "k3", "rank_a", "rank_b", "top1_a", "top1_b", "top1_agree",
        "bitwise_equal", "nonfinite",
    ]  # fmt: skip
    assert {"entropy_a", "entropy_b", "top_token_ids_a", "top_logprobs_b"} <= set(cmp.columns)


def test_compare_records_labels_and_both_attrs():
    """attrs holds the labels and each side's provenance."""
    a, b = frame([-1.0]), frame([-1.0])
    a.attrs, b.attrs = {"engine": "hf"}, {"engine": "vllm"}
    cmp = compare(a, b, labels=("hf", "vllm"))
    assert cmp.attrs == {"labels": ("hf", "vllm"), "attrs_a": {"engine": "hf"},
                         "attrs_b": {"engine": "vllm"}}  # fmt: skip


def test_compare_orders_by_trace_appearance_then_step():
    """Rows follow a's trace order, then step, whatever b's row order."""
    a = frame([-1.0, -2.0, -3.0], trace_id=["z", "z", "a"], step=[0, 1, 0])
    b = a.iloc[::-1].copy()
    cmp = compare(a, b)
    assert list(zip(cmp.trace_id, cmp.step, strict=True)) == [("z", 0), ("z", 1), ("a", 0)]


def test_compare_rejects_mismatched_token_ids_naming_first():
    """A token id mismatch raises, naming the first mismatching trace and step."""
    a = frame([-1.0] * 3, token_id=[1, 2, 3]).iloc[::-1]
    with pytest.raises(ValueError, match=r"first at trace 't' step 1 \(a: 2, b: 9\)"):
        compare(a, frame([-1.0] * 3, token_id=[1, 9, 8]))


def test_compare_rejects_different_row_sets_with_counts():
    """Different (trace_id, step) sets raise, counting the unmatched rows of each side."""
    with pytest.raises(ValueError, match=r"2 rows only in a .*0 rows only in b.*step 1"):
        compare(frame([-1.0] * 3), frame([-1.0]))


def test_compare_rejects_duplicate_rows():
    """A (trace_id, step) pair may appear once per side."""
    a = frame([-1.0, -1.0], trace_id=["t", "t"], step=[0, 0])
    with pytest.raises(ValueError, match="duplicate"):
        compare(a, a)


def test_bitwise_equal_compares_float64_bit_patterns():
    """0.0 vs -0.0 differ, equal NaNs match, a 1-ulp difference differs."""
    nan = float("nan")
    tiny = np.nextafter(-1.0, 0.0)
    cmp = compare(frame([-1.0, 0.0, nan, -1.0]), frame([-1.0, -0.0, nan, tiny]))
    assert cmp["bitwise_equal"].tolist() == [True, False, True, False]
    assert cmp["nonfinite"].tolist() == [False, False, True, False]


def test_missing_logprob_is_nonfinite_and_divergent():
    """A missing (NA) logprob gives a NaN delta, the nonfinite flag and a divergence."""
    b = frame([-1.0, -1.0, -1.0])
    b["logprob"] = pd.array([-1.0, pd.NA, -1.0], dtype="Float64")
    cmp = compare(frame([-1.0, -1.0, -1.0]), b)
    assert cmp["nonfinite"].tolist() == [False, True, False]
    assert np.isnan(cmp["delta"].iloc[1])
    row = summarize(cmp).iloc[0]
    assert row.first_divergence_step == 1 and row.max_abs_delta == np.inf
    assert row.n_nonfinite == 1 and row.mean_abs_delta == 0.0


def test_top1_flags_from_ranks():
    """top1 is rank == 1 per side; top1_agree compares the two flags."""
    cmp = compare(frame([-1.0] * 3, [1, 1, 4]), frame([-1.0] * 3, [1, 2, 5]))
    assert cmp["top1_a"].tolist() == [True, True, False]
    assert cmp["top1_b"].tolist() == [True, False, False]
    assert cmp["top1_agree"].tolist() == [True, False, True]


def test_ref_comparison_uses_recorded_logprobs_as_side_a():
    """compare(df, "ref"): a = ref_logprob with unknown rank, b = the replay."""
    df = frame([-1.0, -2.0], [1, 3], ref_logprob=[-1.25, -2.0])
    cmp = compare(df, "ref")
    assert cmp.attrs["labels"] == ("ref", "replay")
    assert cmp["logprob_a"].tolist() == [-1.25, -2.0]
    assert cmp["delta"].tolist() == [0.25, 0.0]
    assert cmp["rank_a"].isna().all() and cmp["rank_b"].tolist() == [1, 3]
    assert cmp["top1_a"].isna().all() and cmp["top1_agree"].isna().all()
    assert summarize(cmp)["first_rank_flip_step"].isna().all()


def test_ref_comparison_needs_ref_column():
    """Without ref_logprob, "ref" is an error that says what is missing."""
    with pytest.raises(ValueError, match="ref_logprob"):
        compare(frame([-1.0]), "ref")


def test_first_divergence_is_strictly_above_tol():
    """A delta exactly equal to tol is not a divergence; the first larger one is."""
    cmp = compare(frame([-1.0] * 4), frame([-1.0, -0.5, -1.75, -0.25]))
    row = summarize(cmp, tol=0.5).iloc[0]
    assert row.first_divergence_step == 2
    assert (row.mean_abs_delta, row.max_abs_delta, row.sum_delta) == (0.5, 0.75, 0.5)
    assert row.ppl_a == pytest.approx(math.e)
    assert row.ppl_b == pytest.approx(math.exp(0.875))


def test_first_steps_are_na_when_runs_agree():
    """Identical runs have no divergence, flip or bitwise difference (nullable Int64 NA)."""
    summary = summarize(compare(frame([-1.0, -2.0]), frame([-1.0, -2.0])))
    for column in ("first_divergence_step", "first_rank_flip_step", "first_bitwise_step"):
        assert str(summary[column].dtype) == "Int64"
        assert summary[column].isna().all()


def test_rank_flip_needs_exactly_one_side_top1():
    """Rank 2 -> 3 is no flip; 3 -> 1 is."""
    cmp = compare(frame([-1.0] * 4, [1, 1, 2, 3]), frame([-1.0] * 4, [1, 1, 3, 1]))
    assert summarize(cmp).iloc[0].first_rank_flip_step == 3


def test_first_bitwise_step_catches_differences_below_tol():
    """A 1e-9 difference is not a divergence at tol=1e-3 but is a bitwise difference."""
    summary = summarize(compare(frame([-1.0, -1.0]), frame([-1.0, -1.0 + 1e-9])))
    assert summary.iloc[0].first_bitwise_step == 1
    assert pd.isna(summary.iloc[0].first_divergence_step)


def test_summarize_one_row_per_trace_in_appearance_order():
    """Traces appear in order of first appearance, not sorted."""
    a = frame([-1.0, -2.0, -3.0], trace_id=["z", "a", "z"], step=[0, 0, 1])
    summary = summarize(compare(a, a.copy()))
    assert summary["trace_id"].tolist() == ["z", "a"]
    assert summary["n_tokens"].tolist() == [2, 1]


def test_dataset_summary_hand_values():
    """|delta| stats, k3, ratio-outside fraction and top-1 agreement on four tokens."""
    deltas = [0.0, 0.5, -0.75, 1.0]
    a = frame([-2.0] * 4, [1, 1, 2, 50])
    b = frame([-2.0 + d for d in deltas], [1, 2, 2, 2000])
    table = dataset_summary(compare(a, b))
    assert table.columns.tolist() == ["metric", "value"]
    assert metric(table, "mean_abs_delta") == 0.5625
    assert metric(table, "median_abs_delta") == 0.625
    assert metric(table, "p99_abs_delta") == pytest.approx(0.9925)
    assert metric(table, "max_abs_delta") == 1.0
    assert metric(table, "mean_k3") == pytest.approx(np.mean([np.expm1(d) - d for d in deltas]))
    assert metric(table, "frac_ratio_outside_0.5_2") == 0.5
    assert metric(table, "top1_agree") == 0.75
    assert metric(table, "frac_top10_a") == 0.75 and metric(table, "frac_top100_a") == 0.25
    assert metric(table, "frac_top10_b") == 0.75 and metric(table, "frac_rest_b") == 0.25


def test_dataset_summary_ref_side_buckets_unknown():
    """The "ref" side has no ranks: its bucket fractions and top-1 agreement are NaN."""
    table = dataset_summary(compare(frame([-1.0], ref_logprob=[-1.0]), "ref"))
    assert np.isnan(metric(table, "frac_top10_a")) and np.isnan(metric(table, "top1_agree"))
    assert metric(table, "frac_top10_b") == 1.0


def test_rank_bucket_boundaries():
    """Buckets are (0, 10], (10, 100], (100, 1000], above; NaN stays missing."""
    buckets = rank_bucket([1, 10, 11, 100, 101, 1000, 1001, np.nan])
    assert list(buckets.categories) == list(RANK_BUCKETS) and buckets.ordered
    assert [str(b) if pd.notna(b) else None for b in buckets] == [
        "top-10", "top-10", "top-100", "top-100", "top-1000", "top-1000", "rest", None,
    ]  # fmt: skip


def test_rank_bucket_keeps_series_index():
    """A Series in gives a categorical Series with the same index."""
    out = rank_bucket(pd.Series([5, 500], index=[7, 9]))
    assert out.index.tolist() == [7, 9] and isinstance(out.dtype, pd.CategoricalDtype)


def test_rank_bucket_transitions_crosstab():
    """4 x 4 counts, zeros included, rows side a and columns side b."""
    cmp = compare(frame([-1.0] * 3, [1, 50, 5000]), frame([-1.0] * 3, [2, 500, 5000]))
    table = rank_bucket_transitions(cmp)
    assert table.shape == (4, 4) and table.to_numpy().sum() == 3
    assert table.loc["top-10", "top-10"] == 1
    assert table.loc["top-100", "top-1000"] == 1
    assert table.loc["rest", "rest"] == 1


def test_trace_summary_hand_values():
    """Per-trace logprob, perplexity, top-1 and bucket fractions, first off-top-1 step."""
    df = frame([-1.0, -3.0, -2.0, -0.5], [1, 20, 1, 1], trace_id=["t", "t", "t", "u"],
               step=[0, 1, 2, 0], entropy=[1.0, 2.0, np.nan, 0.5])  # fmt: skip
    summary = trace_summary(df).set_index("trace_id")
    t, u = summary.loc["t"], summary.loc["u"]
    assert (t.n_tokens, t.mean_logprob, t.min_logprob) == (3, -2.0, -3.0)
    assert t.ppl == pytest.approx(math.exp(2.0))
    assert t.top1_frac == pytest.approx(2 / 3) and t.frac_top100 == pytest.approx(1 / 3)
    assert t.first_off_top1_step == 1 and pd.isna(u.first_off_top1_step)
    assert t.mean_entropy == 1.5 and u.frac_top10 == 1.0


def test_trace_summary_without_entropy_column():
    """An engine without entropy gives NaN mean_entropy, not an error."""
    assert trace_summary(frame([-1.0]))["mean_entropy"].isna().all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=12))
def test_swapping_sides_negates_delta(pairs):
    """compare(b, a).delta == -compare(a, b).delta; bitwise_equal is symmetric."""
    a, b = frame([p[0] for p in pairs]), frame([p[1] for p in pairs])
    ab, ba = compare(a, b), compare(b, a)
    np.testing.assert_array_equal(ba["delta"].to_numpy(), -ab["delta"].to_numpy())
    assert ab["bitwise_equal"].tolist() == ba["bitwise_equal"].tolist()
    assert (ab["abs_delta"][ab["bitwise_equal"]] == 0).all()
