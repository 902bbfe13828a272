"""Tests for trace_replay.analysis.metrics: hand-computed metrics on small frames."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_replay.analysis.metrics import (
    NegativeEstimateWarning,
    compare,
    dataset_summary,
    run_labels,
    summarize,
)
from trace_replay.analysis.mismatch import trainer_metrics
from trace_replay.analysis.ranks import rank_bucket_transitions

# hand-made pairs below are fixed traces, not samples of side a: their k1/chi2 may be negative
pytestmark = pytest.mark.filterwarnings(
    "ignore::trace_replay.analysis.mismatch.NegativeEstimateWarning"
)


def frame(logprob, rank=None, *, trace_id="t", step=None, token_id=None, **extra) -> pd.DataFrame:
    """Replay frame; by default one trace "t" with steps 0..n-1, all rank 1."""
    n = len(logprob)
    return pd.DataFrame(
        {
            "trace_id": [trace_id] * n if isinstance(trace_id, str) else trace_id,
            "step": step or list(range(n)),
            "position": [5 + i for i in range(n)],
            "token_id": token_id or [100 + i for i in range(n)],
            "token": [f"w{i}" for i in range(n)],
            "logprob": logprob,
            "rank": rank or [1] * n,
            **extra,
        }
    )


def metric(table: pd.DataFrame, name: str) -> float:
    return table.set_index("metric").loc[name, "value"]


def test_delta_is_b_minus_a_with_ratio_k1_k3_and_prob_gap():
    """delta = b - a; ratio = exp(delta); k1 = -delta; k3 = ratio - 1 - delta; |p_b - p_a|."""
    cmp = compare(frame([-1.0, -2.0]), frame([-0.5, -2.5]))
    assert cmp["delta"].tolist() == [0.5, -0.5]
    assert cmp["abs_delta"].tolist() == [0.5, 0.5]
    assert cmp["ratio"].tolist() == pytest.approx([math.exp(0.5), math.exp(-0.5)])
    assert cmp["k1"].tolist() == [-0.5, 0.5]
    assert cmp["k3"].tolist() == pytest.approx([math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5])
    assert cmp["abs_delta_prob"].tolist() == pytest.approx(
        [math.exp(-0.5) - math.exp(-1.0), math.exp(-2.0) - math.exp(-2.5)]
    )


def test_compare_columns_in_documented_order():
    """The documented per-token columns come first; side columns keep their _a/_b suffixes."""
    a = frame([-1.0], entropy=[0.5], top_token_ids=[[100, 7]], top_logprobs=[[-1.0, -2.0]])
    cmp = compare(a, a.copy())
    assert cmp.columns[:23].tolist() == [
        "trace_id",
        "step",
        "position",
        "token",
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
    assert {"entropy_a", "entropy_b", "top_token_ids_a", "top_logprobs_b"} <= set(cmp.columns)


def test_compare_records_labels_and_both_attrs():
    """attrs holds the labels and each side's provenance."""
    a, b = frame([-1.0]), frame([-1.0])
    a.attrs, b.attrs = {"engine": "hf"}, {"engine": "vllm"}
    cmp = compare(a, b, labels=("hf", "vllm"))
    assert cmp.attrs == {
        "labels": ("hf", "vllm"),
        "attrs_a": {"engine": "hf"},
        "attrs_b": {"engine": "vllm"},
    }


def test_compare_labels_default_to_the_attrs_that_differ():
    """Without labels=, each side is named by the engine/dtype/device values that differ."""
    a, b = frame([-1.0]), frame([-1.0])
    a.attrs = {"engine": "torch", "dtype": "float32", "device": "cpu"}
    b.attrs = {"engine": "torch", "dtype": "bfloat16", "device": "cpu"}
    assert compare(a, b).attrs["labels"] == ("float32", "bfloat16")


def test_run_labels_fallbacks():
    """One run gets its full label; no attrs gives the side letter; equal runs get #n."""
    run = {"engine": "vllm", "dtype": "float32", "device": "cpu"}
    assert run_labels([run]) == ["vllm float32 cpu"]
    assert run_labels([{}, {}]) == ["a", "b"]
    assert run_labels([run, dict(run)]) == ["vllm float32 cpu #1", "vllm float32 cpu #2"]


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


def test_bit_mismatch_and_ulp_distance_per_token():
    """float32 bits: 0.0 vs -0.0 mismatch at 0 ULP, a float32 neighbour is 1 ULP, NaN is NA."""
    nan = float("nan")
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    cmp = compare(
        frame([-1.0, 0.0, nan, -1.0, -1.0]), frame([-1.0, -0.0, nan, below, -1.0 + 1e-12])
    )
    assert cmp["bit_mismatch"].tolist() == [False, True, False, True, False]
    assert cmp["ulp_distance"].tolist() == [0, 0, pd.NA, 1, 0]
    assert cmp["nonfinite"].tolist() == [False, False, True, False, False]


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


def test_chat_turn_and_role_survive_compare():
    """A chat trace's turn and role columns are kept once, so assistant tokens can be selected."""
    a = frame([-1.0, -2.0, -0.5], turn=[1, 1, 2], role=["assistant", "template", "assistant"])
    b = frame([-1.5, -2.0, -0.5], turn=[1, 1, 2], role=["assistant", "template", "assistant"])
    cmp = compare(a, b)
    assert cmp["turn"].tolist() == [1, 1, 2] and "role_a" not in cmp.columns
    assert cmp.loc[cmp["role"] == "assistant", "delta"].tolist() == [-0.5, 0.0]
    ref = compare(frame([-1.0], turn=[3], role=["assistant"], ref_logprob=[-1.0]), "ref")
    assert ref["role"].tolist() == ["assistant"]


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
    for column in ("first_divergence_step", "first_rank_flip_step", "first_bit_mismatch_step"):
        assert str(summary[column].dtype) == "Int64"
        assert summary[column].isna().all()


def test_rank_flip_needs_exactly_one_side_top1():
    """Rank 2 -> 3 is no flip; 3 -> 1 is."""
    cmp = compare(frame([-1.0] * 4, [1, 1, 2, 3]), frame([-1.0] * 4, [1, 1, 3, 1]))
    assert summarize(cmp).iloc[0].first_rank_flip_step == 3


def test_first_bit_mismatch_step_catches_differences_below_tol():
    """A 1-ULP float32 difference is no divergence at tol=1e-3 but is a bit mismatch."""
    below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    summary = summarize(compare(frame([-1.0, -1.0, -1.0]), frame([-1.0, below, below])))
    row = summary.iloc[0]
    assert row.first_bit_mismatch_step == 1 and row.n_bit_mismatch == 2
    assert row.max_ulp_distance == 1 and pd.isna(row.first_divergence_step)


def test_summarize_per_trace_kl_estimates():
    """mean_k1 = mean(-delta) and mean_k3 = mean(exp(delta) - 1 - delta), per trace."""
    cmp = compare(
        frame([-1.0, -1.0, -1.0], trace_id=["t", "t", "u"], step=[0, 1, 0]),
        frame([-0.5, -1.25, -1.0], trace_id=["t", "t", "u"], step=[0, 1, 0]),
    )
    t, u = summarize(cmp).set_index("trace_id").loc[["t", "u"]].itertuples()
    assert t.mean_k1 == pytest.approx((-0.5 + 0.25) / 2)
    assert t.mean_k3 == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.25) - 0.75) / 2)
    assert (u.mean_k1, u.mean_k3) == (0.0, 0.0)


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
    assert metric(table, "frac_top1_agree") == 0.75
    assert metric(table, "frac_rank_le_10_a") == 0.75 and metric(table, "frac_rank_le_100_a") == 1
    assert metric(table, "frac_rank_le_10_b") == 0.75
    assert metric(table, "frac_rank_gt_1000_b") == 0.25


LN2 = math.log(2.0)


@pytest.fixture
def power_of_two_cmp() -> pd.DataFrame:
    """Probabilities 1/4->1/2, 1/2->1/4, 1/2->1/2 (trace t), 1/16->1/4 (trace u).

    Ratios w = p_b / p_a are 2, 1/2, 1, 4; each pair of differing float32 logprobs is one
    power of two apart, which is exactly 2**23 float32 ULPs.
    """
    traces = dict(trace_id=["t", "t", "t", "u"], step=[0, 1, 2, 0])
    a = frame([-2 * LN2, -LN2, -LN2, -4 * LN2], **traces)
    b = frame([-LN2, -2 * LN2, -LN2, -2 * LN2], **traces)
    return compare(a, b)


def test_trainer_metrics_hand_values(power_of_two_cmp):
    """k1, k3, chi2 (token, sequence), ratio stats, ESS and the ratio-outside fraction."""
    table = dataset_summary(power_of_two_cmp)
    # delta = [ln2, -ln2, 0, 2 ln2]; w = [2, 1/2, 1, 4]
    assert metric(table, "mean_k1") == pytest.approx(-LN2 / 2)  # -(ln2 - ln2 + 0 + 2 ln2) / 4
    assert metric(table, "mean_k3") == pytest.approx((3.5 - 2 * LN2) / 4)
    assert metric(table, "chi2_token") == pytest.approx(21.25 / 4 - 1)  # (4 + 1/4 + 1 + 16) / 4
    assert metric(table, "chi2_seq") == pytest.approx((1 + 16) / 2 - 1)  # t: e^0, u: e^(4 ln2)
    assert metric(table, "mean_ratio") == pytest.approx(1.875)
    assert metric(table, "std_ratio") == pytest.approx(math.sqrt(7.1875 / 4))
    assert (metric(table, "min_ratio"), metric(table, "max_ratio")) == (0.5, 4.0)
    assert metric(table, "ess") == pytest.approx(7.5**2 / (4 * 21.25))
    assert metric(table, "frac_ratio_outside_0.5_2") == 0.25  # 1/2 and 2 are inside


def test_probability_gap_bit_mismatch_and_ulp_hand_values(power_of_two_cmp):
    """|p_b - p_a| stats (verl rollout_probs_diff), float32 bit mismatches and ULP distances."""
    table = dataset_summary(power_of_two_cmp)
    # |p_b - p_a| = [1/4, 1/4, 0, 3/16]
    assert metric(table, "mean_abs_delta_prob") == pytest.approx(0.6875 / 4)
    assert metric(table, "std_abs_delta_prob") == pytest.approx(math.sqrt(0.0419921875 / 4))
    assert metric(table, "max_abs_delta_prob") == pytest.approx(0.25)
    assert (metric(table, "n_bit_mismatch"), metric(table, "frac_bit_mismatch")) == (3, 0.75)
    assert metric(table, "mean_ulp_distance") == 3 * 2**23 / 4
    assert metric(table, "max_ulp_distance") == 2**23


def test_trainer_metrics_of_identical_runs():
    """Identical runs: KLs and chi2 are 0, every weight is 1, ESS is 1, nothing mismatches."""
    a = frame([-0.3, -2.0, -7.5])
    values = dataset_summary(compare(a, a.copy())).set_index("metric")["value"]
    assert values[["mean_k1", "mean_k3", "chi2_token", "chi2_seq", "std_ratio"]].eq(0).all()
    assert values[["mean_ratio", "min_ratio", "max_ratio", "ess"]].eq(1).all()
    assert values[["n_bit_mismatch", "max_ulp_distance", "max_abs_delta_prob"]].eq(0).all()


def test_trainer_metrics_leave_out_nonfinite_tokens():
    """A NaN logprob is left out of the ratio statistics but counts as a ratio outside [0.5, 2]."""
    b = frame([-LN2, -1.0])
    b["logprob"] = [-LN2, np.nan]
    table = dataset_summary(compare(frame([-2 * LN2, -1.0]), b))
    assert metric(table, "mean_ratio") == 2.0 and metric(table, "chi2_token") == 3.0
    assert metric(table, "frac_ratio_outside_0.5_2") == 0.5
    assert metric(table, "n_nonfinite") == 1 and metric(table, "max_ulp_distance") == 2**23


NAME_SCHEME = (
    r"^(n_\w+|frac_[\w.]+|(mean|median|p99|max|min|std|sum)_\w+|first_\w+_step"
    r"|chi2_token|chi2_seq|ess|ppl(_a|_b)?|trace_id)$"
)


def test_summary_names_follow_one_scheme(power_of_two_cmp):
    """Every summary name is n_*, frac_*, <stat>_*, first_*_step or a trainer's own name."""
    from trace_replay.analysis.metrics import trace_summary

    names = [
        *dataset_summary(power_of_two_cmp)["metric"],
        *summarize(power_of_two_cmp).columns,
        *trace_summary(frame([-1.0, -2.0])).columns,
    ]
    assert [n for n in names if not re.match(NAME_SCHEME, n)] == []


def test_dataset_summary_ref_side_buckets_unknown():
    """The "ref" side has no ranks: its bucket fractions and top-1 agreement are NaN."""
    table = dataset_summary(compare(frame([-1.0], ref_logprob=[-1.0]), "ref"))
    assert np.isnan(metric(table, "frac_rank_le_10_a"))
    assert np.isnan(metric(table, "frac_top1_agree"))
    assert metric(table, "frac_rank_le_10_b") == 1.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=12))
def test_swapping_sides_negates_delta(pairs):
    """compare(b, a).delta == -compare(a, b).delta; bit mismatch and ULPs are symmetric."""
    a, b = frame([p[0] for p in pairs]), frame([p[1] for p in pairs])
    ab, ba = compare(a, b), compare(b, a)
    np.testing.assert_array_equal(ba["delta"].to_numpy(), -ab["delta"].to_numpy())
    assert ab["bit_mismatch"].tolist() == ba["bit_mismatch"].tolist()
    assert ab["ulp_distance"].tolist() == ba["ulp_distance"].tolist()
    assert (ab["ulp_distance"][~ab["bit_mismatch"]] == 0).all()


@pytest.mark.parametrize(
    "reduce", [summarize, dataset_summary, trainer_metrics, rank_bucket_transitions]
)
def test_comparison_reductions_refuse_a_replay_frame_by_name(reduce):
    """A replay frame given where a comparison frame is needed: a ValueError naming the
    function, compare(a, b), the missing columns and what to do instead, not KeyError 'delta'."""
    name = reduce.__name__
    with pytest.raises(
        ValueError,
        match=rf"{name} needs a comparison frame from compare\(a, b\)"
        r".*lacking \['logprob_a', 'logprob_b', 'delta'\], got a "
        r"replay frame .*trace_summary\(df\)",
    ):
        reduce(frame([-1.0, -2.0]))
    with pytest.raises(ValueError, match=r"got a frame with columns \['x'\]"):
        reduce(pd.DataFrame({"x": [1]}))


def fixed_trace_pair() -> pd.DataFrame:
    """Fixed (not sampled) tokens that side b finds likelier than side a: delta > 0 at every
    step, so mean(-delta) < 0 and mean(ratio**2) - 1 > 0; side a's own samples could not give
    that on average, and every token says so (no sampling noise)."""
    return compare(frame([-2.0, -3.0, -1.5]), frame([-1.5, -2.5, -1.0]))


def test_negative_k1_on_fixed_traces_warns_once_with_the_assumption():
    """A negative k1 estimate (impossible for KL in expectation) warns once, naming the metric
    and its value and saying the estimator assumes tokens sampled from side a; the values
    themselves are unchanged and k3 stays >= 0."""
    cmp = fixed_trace_pair()
    with pytest.warns(NegativeEstimateWarning) as caught:
        table = dataset_summary(cmp)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert metric(table, "mean_k1") == pytest.approx(-0.5) and "mean_k1 = -0.5" in message
    assert "samples of side a's distribution (on-policy)" in message
    assert "evidently are not such samples" in message
    assert "chi2_token" not in message  # positive here: only negative estimates are named
    assert metric(table, "mean_k3") > 0
    with pytest.warns(
        NegativeEstimateWarning,
        match=r"mean_k1 of 1 of 1 trace \(lowest: "
        r"trace 't'\) = -0.5\. .*on-policy",
    ):
        assert summarize(cmp)["mean_k1"].iloc[0] == pytest.approx(-0.5)


def test_negative_chi2_warns_naming_it():
    """chi2_token = mean(ratio**2) - 1 below zero (b less likely on every fixed token) is named."""
    cmp = compare(frame([-1.0, -1.0]), frame([-1.5, -2.0]))
    with pytest.warns(NegativeEstimateWarning, match=r"chi2_token = -0\.\d+, chi2_seq = -0\.\d+"):
        trainer_metrics(cmp)


def test_a_negative_estimate_within_its_noise_does_not_warn():
    """On side a's own samples, scored again by another engine of the same model, k1 and
    chi-squared are ~0 and come out slightly negative half the time (the recorded-then-replayed
    embedded model gave mean_k1 = -2e-6): an estimate within three standard errors of zero
    is noise, not evidence against sampling, and raises no NegativeEstimateWarning."""
    import warnings

    a = frame([-0.5, -1.0, -2.0, -0.25])
    b = a.assign(logprob=a["logprob"] + [3e-6, -2e-6, 3e-6, -2e-6])  # mean_k1 = -5e-7
    cmp = compare(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NegativeEstimateWarning)
        assert trainer_metrics(cmp)["mean_k1"] == pytest.approx(-5e-7)
        assert summarize(cmp)["mean_k1"].iloc[0] == pytest.approx(-5e-7)


def test_a_rounding_bias_on_the_models_own_traces_does_not_warn():
    """compare(df, "ref") of the model's own traces, replayed by another float32 engine: every
    delta ~1e-7 of one sign (rounding that does not average out) puts mean_k1 hundreds of
    standard errors below zero, yet below what the logprobs resolve (ROUNDING_NATS a token):
    no NegativeEstimateWarning from dataset_summary or summarize."""
    import warnings

    rng = np.random.default_rng(0)
    replayed = rng.uniform(-3.0, -0.01, 400)
    df = frame(list(replayed), ref_logprob=replayed - 1e-7 + rng.normal(0, 1e-8, 400))
    cmp = compare(df, "ref")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NegativeEstimateWarning)
        table = dataset_summary(cmp)
        summary = summarize(cmp)
    standard_error = cmp["k1"].std() / math.sqrt(len(cmp))
    assert metric(table, "mean_k1") < -100 * standard_error  # far beyond sampling noise
    assert summary["mean_k1"].iloc[0] == pytest.approx(-1e-7, rel=0.1)


def test_the_warning_mentions_an_unknown_error_only_when_there_is_one():
    """The warning explains 'nan' only when a named estimate's standard error is NaN (a mean
    of one value); with every standard error known it says nothing of NaN."""
    with pytest.warns(NegativeEstimateWarning) as caught:
        dataset_summary(fixed_trace_pair())
    assert "nan" not in str(caught[0].message).lower()
    with pytest.warns(NegativeEstimateWarning, match="nan: a mean of one value"):
        dataset_summary(compare(frame([-2.0]), frame([-1.5])))


def test_nonnegative_estimates_do_not_warn():
    """Identical runs (k1 = chi2 = 0) raise no NegativeEstimateWarning."""
    import warnings

    a = frame([-0.3, -2.0, -7.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error", NegativeEstimateWarning)
        dataset_summary(compare(a, a.copy()))
        summarize(compare(a, a.copy()))


def test_duplicate_rows_are_named_whatever_the_index(replay_df):
    """A frame holding a trace twice (pd.concat keeps the repeated index) is refused naming
    that trace and step in one line, not a dump of the matching rows."""
    doubled = pd.concat([replay_df, replay_df])
    with pytest.raises(ValueError, match=r"^a .*has duplicate rows for trace 't0' step 0$"):
        compare(doubled, replay_df)


@pytest.mark.parametrize("reduce", [summarize, dataset_summary, trainer_metrics])
def test_concatenated_comparisons_are_refused_by_per_trace_statistics(replay_pair, reduce):
    """Two comparisons concatenated (the long form the plots take with hue=) hold each trace
    step twice: a per-trace statistic of them would mix the pairs (summarize counted 80 tokens
    in a 40-token trace), so it is a ValueError naming the function, trace and step."""
    a, b = replay_pair
    both = pd.concat([compare(a, b), compare(b, a)], keys=["ab", "ba"], names=["pair", None])
    with pytest.raises(
        ValueError,
        match=rf"^{reduce.__name__} takes one comparison, but cmp "
        r"holds trace 't0' step 0 more than once",
    ):
        reduce(both.reset_index("pair"))
