"""Tests for trace_replay.plots.trace: one trace's logprob and rank, on its own figure or an ax."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from trace_replay.analysis.metrics import compare
from trace_replay.plots.frames import plot_trace


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
    """other= draws the second run's logprob, labelled by the attrs that tell the runs apart."""
    a, b = replay_pair
    ax = plot_trace(a, "t2", other=b, ax=plt.gca())
    assert line_labels(ax) == ["logprob hf float32", "logprob vllm bfloat16"]


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


def test_plot_trace_without_ax_makes_its_own_figure_and_leaves_it_current(replay_df):
    """ax=None never draws on an existing Axes; the logprob Axes (not the twin) stays current."""
    _, existing = plt.subplots()
    ax = plot_trace(replay_df, "t0")
    assert ax.figure is not existing.figure and not existing.has_data()
    assert plt.gca() is ax and plt.gca() is not ax.rank_ax


def test_plot_trace_hue_draws_one_line_per_run(replay_pair):
    """hue= on a long-form frame of two runs: one logprob line and rank set per run."""
    both = pd.concat(replay_pair, keys=["fp32", "bf16"], names=["run", None]).reset_index("run")
    ax = plot_trace(both, "t1", hue="run")
    assert line_labels(ax) == ["logprob fp32", "logprob bf16"]
    assert line_labels(ax.rank_ax) == ["rank fp32", "rank bf16"]


def test_plot_trace_unknown_trace(replay_df):
    """An unknown trace id is a KeyError naming it."""
    with pytest.raises(KeyError, match="nope"):
        plot_trace(replay_df, "nope", ax=plt.gca())


@pytest.mark.parametrize("size", [(11.0, 4.0), (5.0, 3.0)])
def test_plot_trace_legend_hides_no_data(cmp, size):
    """The legend lies outside the axes, right of the rank axis's tick labels and label, and
    inside its figure: it covers no line, mark or label, whatever the figure's size."""
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    plot_trace(cmp, "t2", ax=ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 >= ax.get_window_extent(renderer).x1
    assert legend.x0 >= ax.rank_ax.get_tightbbox(renderer).x1
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1


def test_lower_bound_ranks_are_drawn_as_bounds():
    """Ranks a server only bounds (rank_exact False) are drawn apart, as downward marks
    labelled "lower bound", and make their own bar segment in the rank buckets."""
    from trace_replay.plots.frames import plot_rank_buckets

    df = pd.DataFrame(
        {
            "trace_id": "t",
            "step": [0, 1, 2],
            "token_id": [5, 6, 7],
            "logprob": [-0.1, -4.0, -5.0],
            "rank": [1, 21, 21],
            "rank_exact": [True, False, True],
        }
    )
    ax = plot_trace(df, "t")
    handles, names = ax.rank_ax.get_legend_handles_labels()
    assert names == ["rank", "rank (lower bound)"]
    assert handles[1].get_xdata().tolist() == [1] and handles[1].get_marker() == "v"
    bars = plot_rank_buckets(df).containers
    heights = {b.get_label(): b.patches[0].get_height() for b in bars}
    assert heights["bound"] == pytest.approx(1 / 3) and heights["11-100"] == pytest.approx(1 / 3)
