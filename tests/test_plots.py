"""Tests for trace_replay.plots: each function draws on the given Axes and returns it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import LogNorm, SymLogNorm
from matplotlib.container import BarContainer

from trace_replay.analysis import compare, summarize
from trace_replay.plots import (
    plot_delta_hist,
    plot_divergence_heatmap,
    plot_first_divergence,
    plot_logprob_scatter,
    plot_rank_buckets,
    plot_trace,
)


@pytest.fixture
def cmp(replay_pair):
    a, b = replay_pair
    return compare(a, b, labels=("hf", "vllm"))


def line_labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_plot_trace_single_replay(replay_df):
    """One logprob line on the main Axes, ranks on a log twin reachable as ax.rank_ax."""
    df = replay_df.drop(columns="ref_logprob")
    _, ax = plt.subplots()
    out = plot_trace(df, "t1", ax=ax)
    assert out is ax
    assert line_labels(ax) == ["logprob"]
    np.testing.assert_array_equal(ax.get_lines()[0].get_xdata(), np.arange(40))
    assert ax.rank_ax in ax.figure.axes and ax.rank_ax.get_yscale() == "log"
    assert line_labels(ax.rank_ax) == ["rank"]
    assert ax.get_ylabel() == "logprob (nats)" and "t1" in ax.get_title()


def test_plot_trace_rank_axis_has_rank1_on_top(replay_df):
    """The rank axis is inverted so that good tokens sit high on both axes."""
    ax = plot_trace(replay_df.drop(columns="ref_logprob"), "t0", ax=plt.gca())
    bottom, top = ax.rank_ax.get_ylim()
    assert bottom > top


def test_plot_trace_comparison_labels_and_divergence_spans(cmp):
    """Both runs' lines carry the compare labels; divergent steps are shaded."""
    ax = plot_trace(cmp, "t1", ax=plt.gca())
    assert line_labels(ax) == ["logprob hf", "logprob vllm"]
    spans = [c for c in ax.collections if c.get_label().startswith("|Δ| >")]
    assert len(spans) == 1
    legend_texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "rank vllm" in legend_texts and "|Δ| > 0.001" in legend_texts


def test_plot_trace_identical_trace_has_no_spans(cmp):
    """A trace whose runs agree bitwise gets no divergence shading."""
    ax = plot_trace(cmp, "t0", ax=plt.gca())
    assert not [c for c in ax.collections if c.get_label().startswith("|Δ|")]


def test_plot_trace_other_frame_is_compared(replay_pair):
    """other= draws the second run's logprob, labelled from attrs["engine"]."""
    a, b = replay_pair
    ax = plot_trace(a, "t2", other=b, ax=plt.gca())
    assert line_labels(ax) == ["logprob hf", "logprob vllm"]


def test_plot_trace_draws_ref_logprob(replay_df):
    """A frame with ref_logprob shows the trace's recorded logprobs next to the replay."""
    ax = plot_trace(replay_df, "t0", ax=plt.gca())
    assert line_labels(ax) == ["logprob ref", "logprob replay"]
    assert line_labels(ax.rank_ax) == ["rank replay"]


def test_plot_trace_thins_labels_and_windows(replay_df):
    """At most max_labels token ticks; window keeps only start <= step < stop."""
    ax = plot_trace(replay_df, "t0", ax=plt.gca(), max_labels=7, window=(10, 30))
    assert len(ax.get_xticks()) <= 7
    np.testing.assert_array_equal(ax.get_lines()[0].get_xdata(), np.arange(10, 30))
    assert all(label.get_text() for label in ax.get_xticklabels())


def test_plot_trace_defaults_to_current_axes(replay_df):
    """ax=None draws on plt.gca()."""
    _, ax = plt.subplots()
    assert plot_trace(replay_df, "t0") is ax


def test_plot_trace_unknown_trace(replay_df):
    """An unknown trace id is a KeyError naming it."""
    with pytest.raises(KeyError, match="nope"):
        plot_trace(replay_df, "nope", ax=plt.gca())


def test_heatmap_image_sorted_by_first_divergence(cmp):
    """One traces x steps image, rows by first divergence (never-divergent last), colorbar."""
    _, ax = plt.subplots()
    assert plot_divergence_heatmap(cmp, ax=ax) is ax
    (image,) = ax.images
    assert image.get_array().shape == (3, 40)
    assert isinstance(image.norm, LogNorm) and image.colorbar is not None
    expected = summarize(cmp).sort_values("first_divergence_step", na_position="last")
    assert [t.get_text() for t in ax.get_yticklabels()] == expected["trace_id"].tolist()
    assert ax.get_xlabel() == "step"


def test_heatmap_ragged_traces_and_nonfinite(replay_pair):
    """Steps past a trace's end are masked; a NaN delta takes the top colour."""
    a, b = (df[(df.trace_id != "t0") | (df.step < 30)] for df in replay_pair)
    b = b.copy()
    b.loc[(b.trace_id == "t1") & (b.step == 3), "logprob"] = np.nan
    ax = plot_divergence_heatmap(compare(a, b), ax=plt.gca())
    image = ax.images[0]
    values = image.get_array()
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert values.mask[rows.index("t0"), 30:].all() and not values.mask[rows.index("t0"), :30].any()
    assert values[rows.index("t1"), 3] == image.norm.vmax
    assert rows[0] == "t1"


def test_heatmap_signed_value_uses_symmetric_scale(cmp):
    """value="delta" is signed: a symmetric log scale centred on zero."""
    ax = plot_divergence_heatmap(cmp, value="delta", ax=plt.gca())
    norm = ax.images[0].norm
    assert isinstance(norm, SymLogNorm) and norm.vmin == -norm.vmax


def test_heatmap_rank_value(cmp):
    """A rank column draws on a log scale."""
    ax = plot_divergence_heatmap(cmp, value="rank_b", ax=plt.gca())
    assert isinstance(ax.images[0].norm, LogNorm)
    assert ax.images[0].colorbar.ax.get_ylabel() == "rank_b"


def test_delta_hist_log_counts(cmp):
    """Bars of finite deltas on a log y axis; the x label names both runs."""
    _, ax = plt.subplots()
    assert plot_delta_hist(cmp, ax=ax) is ax
    assert len(ax.patches) == 80 and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "Δ logprob (vllm − hf, nats)"
    assert sum(p.get_height() for p in ax.patches) == len(cmp)


def test_logprob_scatter_with_diagonal(cmp):
    """Two point sets (within / beyond tol) and the y = x diagonal."""
    _, ax = plt.subplots()
    assert plot_logprob_scatter(cmp, ax=ax) is ax
    assert len(ax.collections) == 2
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(cmp)
    assert line_labels(ax) == ["y = x"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("logprob hf", "logprob vllm")


def test_first_divergence_cdf_reports_never_diverged(cmp):
    """The CDF tops out at the diverged fraction; the legend counts the rest."""
    _, ax = plt.subplots()
    assert plot_first_divergence(summarize(cmp), ax=ax) is ax
    cdf = ax.get_lines()[0]
    assert cdf.get_ydata()[-1] == pytest.approx(2 / 3)
    assert "never diverged: 1/3 traces" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_rank_buckets_single_bar_sums_to_one(replay_df):
    """by=None: one stacked bar per bucket container, heights summing to 1."""
    _, ax = plt.subplots()
    assert plot_rank_buckets(replay_df, ax=ax) is ax
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_label() for b in bars] == ["top-10", "top-100", "top-1000", "rest"]
    assert sum(b.patches[0].get_height() for b in bars) == pytest.approx(1.0)


def test_rank_buckets_by_column(replay_df):
    """One bar per value of `by`, in order of appearance."""
    ax = plot_rank_buckets(replay_df, by="trace_id", ax=plt.gca())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["t0", "t1", "t2"]
    assert len(ax.containers[0].patches) == 3 and ax.get_xlabel() == "trace_id"


def test_rank_buckets_comparison_one_bar_per_side(cmp):
    """A comparison frame gets one bar per side, named by the compare labels."""
    ax = plot_rank_buckets(cmp, ax=plt.gca())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["hf", "vllm"]
