"""Tests for trace_replay.plots.frames: each function draws on the given Axes or its own, returns it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import LogNorm, SymLogNorm
from matplotlib.container import BarContainer

from trace_replay.analysis.metrics import compare, summarize
from trace_replay.plots.frames import (
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
    assert image.norm(values[rows.index("t1"), 3]) > 1  # over the scale: the top colour
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
    assert [b.get_label() for b in bars] == ["1-10", "11-100", "101-1000", ">1000", "bound"]
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


ALL_PLOTS = {
    "trace": lambda cmp: plot_trace(cmp, "t1"),
    "heatmap": lambda cmp: plot_divergence_heatmap(cmp),
    "delta_hist": lambda cmp: plot_delta_hist(cmp),
    "scatter": lambda cmp: plot_logprob_scatter(cmp),
    "first_divergence": lambda cmp: plot_first_divergence(summarize(cmp)),
    "rank_buckets": lambda cmp: plot_rank_buckets(cmp),
}


def test_every_plot_twice_without_ax_saves_two_figures(cmp, tmp_path):
    """Each plot function called twice with no ax draws two figures, both of which save.

    The second call must not draw into the first figure (a log-scale twin left current once
    made the next plot's savefig crash), and no legend may reach outside its figure.
    """
    for name, draw in ALL_PLOTS.items():
        first, second = draw(cmp), draw(cmp)
        assert first.figure is not second.figure, name
        assert plt.gca() is second, name
        for i, ax in enumerate((first, second)):
            ax.figure.savefig(tmp_path / f"{name}{i}.png")
            assert (tmp_path / f"{name}{i}.png").stat().st_size > 0
            legend = ax.get_legend()
            if legend is not None:
                box, page = legend.get_window_extent(), ax.figure.bbox
                assert page.x0 <= box.x0 and box.x1 <= page.x1, name
                assert page.y0 <= box.y0 and box.y1 <= page.y1, name


def test_heatmap_panels_of_one_figure_share_one_colour_scale(replay_pair):
    """Two heatmaps in one figure get one norm covering both, whatever order they come in."""
    a, b = replay_pair
    tiny = b.assign(logprob=a["logprob"] + (b["logprob"] - a["logprob"]) * 1e-4)
    fig, (top, bottom) = plt.subplots(2, 1)
    plot_divergence_heatmap(compare(a, tiny), ax=top)
    plot_divergence_heatmap(compare(a, b), ax=bottom)
    norm = top.images[0].norm
    assert bottom.images[0].norm is norm
    big = compare(a, b)["abs_delta"].max()
    assert norm.vmax >= big and norm.vmin <= compare(a, tiny)["abs_delta"].replace(0, 1).min()
    fig.canvas.draw()
    assert top.images[0].colorbar.ax.get_ylim() == bottom.images[0].colorbar.ax.get_ylim()


def test_heatmap_no_first_divergence_legend_when_nothing_diverged(replay_pair):
    """Identical runs: no first-divergence marks and no legend for them."""
    a, _ = replay_pair
    ax = plot_divergence_heatmap(compare(a, a.copy()))
    assert ax.get_legend() is None and "first divergence" not in line_labels(ax)


def test_labels_come_from_attrs_unless_given(replay_pair):
    """Without labels, sides are named by engine/dtype; labels= overrides them everywhere."""
    cmp = compare(*replay_pair)
    assert plot_delta_hist(cmp).get_xlabel() == "Δ logprob (vllm bfloat16 − hf float32, nats)"
    assert plot_divergence_heatmap(cmp).get_title().endswith("vllm bfloat16 vs hf float32")
    ticks = plot_rank_buckets(cmp).get_xticklabels()
    assert [t.get_text() for t in ticks] == ["hf float32", "vllm bfloat16"]
    scatter = plot_logprob_scatter(cmp, labels=("rollout", "trainer"))
    assert (scatter.get_xlabel(), scatter.get_ylabel()) == ("logprob rollout", "logprob trainer")


def test_single_run_named_from_attrs(replay_df):
    """A single run's rank-bucket bar and trace title carry its engine and dtype."""
    ax = plot_rank_buckets(replay_df)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["hf float32"]
    title = plot_trace(replay_df.drop(columns="ref_logprob"), "t0").get_title()
    assert title == "trace t0 · synthetic · hf float32"


def test_hue_gives_one_artist_per_level(replay_pair):
    """hue= on concatenated comparisons: one histogram, one CDF, one point set per pair."""
    a, b = replay_pair
    pairs = pd.concat(
        [compare(a, b), compare(a, a.copy())], keys=["drift", "same"], names=["pair", None]
    ).reset_index("pair")
    hist = plot_delta_hist(pairs, hue="pair")
    assert [t.get_text() for t in hist.get_legend().get_texts()] == ["drift", "same"]
    summaries = pd.concat(
        [summarize(compare(a, b)), summarize(compare(a, a.copy()))],
        keys=["drift", "same"],
        names=["pair", None],
    ).reset_index("pair")
    cdf = plot_first_divergence(summaries, hue="pair")
    assert [line.get_label() for line in cdf.get_lines()][::2] == ["drift", "same"]
    assert cdf.get_lines()[2].get_ydata()[-1] == 0.0  # "same" never diverges
    scatter = plot_logprob_scatter(pairs, hue="pair")
    assert [c.get_label() for c in scatter.collections] == ["drift", "same"]
    buckets = plot_rank_buckets(
        pd.concat(replay_pair, keys=["x", "y"], names=["run", None]).reset_index("run"), hue="run"
    )
    assert [t.get_text() for t in buckets.get_xticklabels()] == ["x", "y"]


def test_first_divergence_hue_on_concatenated_comparison_frames(replay_pair):
    """hue= on comparison frames (not summaries): one CDF per pair, each pair summarized on its
    own, so equal trace ids in different pairs do not merge."""
    a, b = replay_pair
    pairs = pd.concat(
        [compare(a, b), compare(a, a.copy())], keys=["drift", "same"], names=["pair", None]
    ).reset_index("pair")
    ax = plot_first_divergence(pairs, hue="pair")
    assert line_labels(ax)[::2] == ["drift", "same"]
    assert ax.get_lines()[0].get_ydata()[-1] == pytest.approx(2 / 3)  # t1 and t2 diverge
    assert ax.get_lines()[2].get_ydata()[-1] == 0.0  # "same" never diverges


@pytest.mark.parametrize(
    "plot", [plot_first_divergence, plot_delta_hist, plot_logprob_scatter, plot_rank_buckets]
)
def test_unknown_hue_names_the_valid_columns(cmp, replay_df, plot):
    """A hue that is no column is a ValueError naming it and listing the columns to choose from."""
    data = replay_df if plot is plot_rank_buckets else cmp
    with pytest.raises(
        ValueError,
        match=r"hue='pairs' is not a column of data; valid hue "
        r"columns: trace_id, step, .*token_id",
    ):
        plot(data, hue="pairs")


@pytest.mark.parametrize("plot", [plot_delta_hist, plot_logprob_scatter])
def test_comparison_plots_refuse_a_replay_frame_by_name(replay_df, plot):
    """A replay frame where a comparison is needed is a ValueError naming the function and
    pointing at compare() (was a bare KeyError 'delta' / 'logprob_a'); a column that a
    comparison frame lacks is named too."""
    with pytest.raises(ValueError, match=rf"{plot.__name__} needs a comparison frame .*compare"):
        plot(replay_df)
    cmp = compare(replay_df, "ref")
    with pytest.raises(ValueError, match=rf"{plot.__name__}: \['nope'\] not among the columns"):
        plot(cmp, x="nope")


@pytest.mark.parametrize("plot", [plot_divergence_heatmap, plot_first_divergence])
def test_an_empty_comparison_is_named_not_a_nan_conversion(cmp, plot):
    """A comparison frame with no rows (e.g. filtered to nothing) is a ValueError naming the
    function, before any figure is made (was 'cannot convert float NaN to integer')."""
    figures = plt.get_fignums()
    with pytest.raises(ValueError, match=rf"^{plot.__name__}: data has no rows"):
        plot(cmp.iloc[:0])
    assert plt.get_fignums() == figures
