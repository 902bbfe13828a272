"""Tests for trace_replay.explorer, driven through the widget objects."""

from __future__ import annotations

import re
import sys

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
