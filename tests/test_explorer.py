"""Tests for trace_replay.explorer, driven through the widget objects."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

widgets = pytest.importorskip("ipywidgets", reason="explorer tests need ipywidgets")

from trace_replay.analysis.metrics import compare  # noqa: E402
from trace_replay.explorer import explore  # noqa: E402


@pytest.fixture
def single(replay_df):
    return explore(replay_df)


@pytest.fixture
def paired(replay_pair):
    a, b = replay_pair
    return explore(compare(a, b, labels=("hf", "vllm")))


def highlighted(explorer) -> list[str]:
    pattern = r'class="tr-tok[^"]*tr-highlight" data-step="(\d+)"'
    return re.findall(pattern, explorer.tokens_html.value)


def selected_step_line(explorer) -> float:
    lines = explorer.figure.axes[0].get_lines()
    (line,) = [ln for ln in lines if ln.get_label() == "selected step"]
    return line.get_xdata()[0]


def test_widgets_have_stable_names_and_dom_classes(single):
    """The top-level VBox holds the named widgets, each with its tr-* DOM class."""
    assert isinstance(single.widget, widgets.VBox)
    for name, dom in (
        ("tokens_html", "tr-tokens"),
        ("topk_html", "tr-topk"),
        ("step_slider", "tr-step"),
        ("trace_dropdown", "tr-trace"),
    ):
        assert dom in getattr(single, name)._dom_classes
    assert isinstance(single.plot_output, widgets.Output)
    assert isinstance(single.divergent_only, widgets.Checkbox)
    assert hasattr(single, "_ipython_display_")


def test_slider_moves_highlight_table_and_plot(single):
    """Setting the step slider re-renders tokens, top-k table and the figure for that step."""
    single.step_slider.value = 0
    before = (single.tokens_html.value, single.topk_html.value)
    single.step_slider.value = 3
    assert highlighted(single) == ["3"]
    assert single.tokens_html.value != before[0] and single.topk_html.value != before[1]
    assert selected_step_line(single) == 3


def test_dropdown_switches_trace(single):
    """Picking another trace re-renders every view for it and resets the slider range."""
    single.trace_dropdown.value = "t2"
    assert "trace <b>t2</b>" in single.tokens_html.value
    assert single.figure.axes[0].get_title().startswith("trace t2")
    assert (single.step_slider.min, single.step_slider.max) == (0, 39)
    assert highlighted(single) == [str(single.step_slider.value)]


def test_single_replay_topk_table_marks_trace_token(replay_df, single):
    """The table shows the trace token, the model's choice and alternatives with logprobs."""
    single.trace_dropdown.value = "t0"
    single.step_slider.value = 5
    row = replay_df[(replay_df.trace_id == "t0") & (replay_df.step == 5)].iloc[0]
    table = single.topk_html.value
    assert "(model's choice)" in table
    assert f"(id {row.token_id})" in table and f"{row.top_logprobs[0]:.4f}" in table
    assert "<script>" not in table


def test_single_replay_starts_at_first_off_top1_step(replay_df, single):
    """A trace opens on its first step where the replay token was not the model's top-1."""
    first = replay_df[(replay_df.trace_id == "t0") & (replay_df["rank"] > 1)].step.min()
    assert single.step_slider.value == first


def test_comparison_table_shows_both_sides(paired):
    """A comparison frame gets one top-k table per side, labelled, and the delta."""
    paired.trace_dropdown.value = "t1"
    paired.step_slider.value = 8
    table = paired.topk_html.value
    assert "hf: trace token" in table and "vllm: trace token" in table and "Δ logprob" in table
    assert highlighted(paired) == ["8"]


def test_divergent_only_filter_drops_agreeing_trace(paired):
    """With the checkbox, the bitwise-identical trace t0 leaves the dropdown."""
    assert [v for _, v in paired.trace_dropdown.options] == ["t0", "t1", "t2"]
    paired.divergent_only.value = True
    assert [v for _, v in paired.trace_dropdown.options] == ["t1", "t2"]
    assert paired.trace_dropdown.value == "t1"


def test_sort_by_first_divergence(paired):
    """Sorting puts earlier divergences first and never-divergent traces last."""
    paired.sort_by.value = "first divergence"
    assert [v for _, v in paired.trace_dropdown.options] == ["t1", "t2", "t0"]
    assert "diverges @ 7" in paired.trace_dropdown.options[0][0]


def test_empty_filter_shows_a_message(replay_df):
    """When no trace is divergent, the filter leaves an explanatory message, not an error."""
    explorer = explore(replay_df.assign(rank=1))
    explorer.divergent_only.value = True
    assert explorer.trace_dropdown.value is None
    assert "no trace matches" in explorer.tokens_html.value


def test_missing_ipywidgets_says_what_to_install(monkeypatch, replay_df):
    """Without ipywidgets, explore() raises ImportError naming the notebook extra."""
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(ImportError, match=r"pip install 'trace-replay\[notebook\]'"):
        explore(replay_df)


def test_a_lower_bound_rank_reads_as_a_bound(replay_df):
    """A rank the server only bounds (rank_exact False) reads "rank >k" in the top-k table,
    not an exact rank."""
    df = replay_df.assign(rank_exact=True)
    at = (df.trace_id == "t0") & (df.step == 5)
    df.loc[at, "rank"], df.loc[at, "rank_exact"] = 21, False
    ex = explore(df)
    ex.trace_dropdown.value = "t0"
    ex.step_slider.value = 5
    assert "rank &gt;20" in ex.topk_html.value or "rank >20" in ex.topk_html.value
    assert "rank 21<" not in ex.topk_html.value


# --- full distributions and MoE routing, from a real paired replay of a tiny random MoE ---

MOE_TRACES = [
    {"id": "a", "prompt": "The capital of France is", "completion": " Paris, a city"},
    {"id": "b", "prompt": "One, two,", "completion": " three, four, five"},
]


@pytest.fixture(scope="module")
def moe_runs(make_tiny_lm, tokenizer):
    """A tiny random Qwen3-MoE over the embedded vocabulary and a copy whose layer-1 router
    favours expert 5, each in the prefill engine: their paired replay (exact), their
    replays (for bounds) and their routing records."""
    import copy

    import torch

    import trace_replay as tr
    from trace_replay.analysis.distributions import replay_pair
    from trace_replay.analysis.routing import record_routing
    from trace_replay.engines.routing import find_routers

    model = make_tiny_lm(
        "Qwen3MoeConfig",
        vocab_size=49152,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        initializer_range=0.05,
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(model).values():  # transformers starts them at zero
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.5)
        planted = copy.deepcopy(model)
        find_routers(planted)[1].weight[5] += 3.0 * torch.sign(
            torch.randn(planted.config.hidden_size, generator=gen)
        )
    engines = [tr.make_engine("prefill", model=m) for m in (model, planted)]
    try:
        for engine in engines:
            engine.tokenizer = tokenizer
        pair = replay_pair(MOE_TRACES, *engines, labels=("rollout", "trainer"))
        (df_a, ra), (df_b, rb) = (record_routing(MOE_TRACES, e) for e in engines)
    finally:
        for engine in engines:
            engine.close()
    return pair, df_a, df_b, ra, rb


def strip_axes(explorer):
    """The figure's axes with a title (the rank twin has none), top to bottom."""
    return [ax for ax in explorer.figure.axes if ax.get_title()]


def test_a_paired_frame_shows_its_kl_strip_under_the_logprob_strip(moe_runs):
    """Exploring a replay_pair frame draws, under the trace's logprob strip and over the same
    steps, its per-token KL(a||b), the selected step marked on both; the step's exact
    divergences are listed under the top-k tables."""
    pair = moe_runs[0]
    ex = explore(pair)
    ex.trace_dropdown.value = "b"
    ex.step_slider.value = 2
    logprob_ax, kl_ax = strip_axes(ex)
    rows = pair[pair["trace_id"] == "b"].sort_values("step")
    (line,) = [ln for ln in kl_ax.get_lines() if ln.get_label().startswith("kl_ab")]
    assert list(line.get_xdata()) == rows["step"].tolist()
    np.testing.assert_allclose(line.get_ydata(), rows["kl_ab"].clip(lower=1e-12))
    assert (rows["kl_ab"] > 0).all()  # the planted router moves every distribution
    assert kl_ax.get_xlim() == logprob_ax.get_xlim()
    assert selected_step_line(ex) == 2
    marks = [ln for ln in kl_ax.get_lines() if ln.get_label() == "selected step"]
    assert marks[0].get_xdata()[0] == 2
    kl = float(rows.loc[rows["step"] == 2, "kl_ab"].iloc[0])
    assert f"kl_ab {kl:.3g}" in ex.topk_html.value and "(exact)" in ex.topk_html.value


def test_the_metric_control_redraws_the_strip(moe_runs):
    """Choosing another divergence redraws the strip with that metric's values."""
    pair = moe_runs[0]
    ex = explore(pair)
    ex.metric.value = "tv"
    strip = strip_axes(ex)[1]
    assert strip.get_ylabel() == "tv"
    rows = pair[pair["trace_id"] == ex.trace_id].sort_values("step")
    (line,) = [ln for ln in strip.get_lines() if ln.get_label().startswith("tv")]
    np.testing.assert_allclose(line.get_ydata(), rows["tv"].clip(lower=1e-12))


def test_bounds_and_routing_flips_are_shown_beside_a_comparison(moe_runs):
    """A comparison with a bounds frame and the two routing records: the divergence strip
    draws the band between the bounds, and the routing panel is the trace's layers x steps
    flip matrix, the selected step's flipped layers listed."""
    from trace_replay.analysis.distribution_bounds import distribution_bounds
    from trace_replay.analysis.routing import flip_matrix

    _, df_a, df_b, ra, rb = moe_runs
    ex = explore(
        compare(df_a, df_b), distributions=distribution_bounds(df_a, df_b), routing=(ra, rb)
    )
    ex.trace_dropdown.value = "a"
    matrix = flip_matrix(ra, rb, "a")
    step = int(matrix.columns[matrix.any(axis=0).to_numpy()][0])  # a step that flips
    ex.step_slider.value = step
    logprob_ax, band_ax, routing_ax = strip_axes(ex)
    assert band_ax.collections, "no band between the bounds"
    assert "bounded" in band_ax.get_title() and "bounded" in ex.topk_html.value
    (image,) = routing_ax.get_images()
    np.testing.assert_array_equal(image.get_array(), matrix.to_numpy())
    assert not matrix.loc[0].any() and matrix.loc[1].any()  # planted in layer 1 only
    layers = [int(x) for x in matrix.index[matrix[step].to_numpy()]]
    assert f"layers {layers}" in ex.topk_html.value
    assert routing_ax.get_xlim() == logprob_ax.get_xlim()


def test_a_frame_without_divergences_is_refused_as_distributions(replay_pair):
    """distributions must hold kl_ab (exact) or kl_ab_lower (bounded): else a clear error."""
    a, b = replay_pair
    with pytest.raises(ValueError, match="kl_ab"):
        explore(compare(a, b), distributions=compare(a, b))
