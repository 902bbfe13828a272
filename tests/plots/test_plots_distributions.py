"""trace_replay.plots.distributions: each figure draws an exact or a bounded frame on the
Axes given (or its own), returns it and draws what the data says."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from trace_replay.plots.distributions import (
    plot_distribution_hist,
    plot_distribution_strip,
    plot_first_past,
    plot_routing_flips,
)


@pytest.fixture
def exact() -> pd.DataFrame:
    """Two traces of 30 steps; t1's KL grows past 1e-3 at step 12, t0's never does."""
    steps = np.arange(30)
    kl = np.r_[np.full(30, 1e-5), np.where(steps >= 12, 1e-2, 1e-6)]
    return pd.DataFrame(
        {"trace_id": ["t0"] * 30 + ["t1"] * 30, "step": np.r_[steps, steps], "kl_ab": kl}
    )


@pytest.fixture
def bounded(exact) -> pd.DataFrame:
    return exact.assign(kl_ab_lower=exact["kl_ab"] / 2, kl_ab_upper=np.inf).drop(columns="kl_ab")


def test_strip_draws_on_the_given_axes_in_both_forms(exact, bounded):
    """The strip draws the trace's values on a log axis; a bounded frame adds its band."""
    _, ax = plt.subplots()
    assert plot_distribution_strip(exact, "t1", ax=ax) is ax
    np.testing.assert_allclose(ax.lines[0].get_ydata(), exact[exact.trace_id == "t1"]["kl_ab"])
    ax2 = plot_distribution_strip(bounded, "t1")
    assert ax2.collections and "lower bound" in ax2.get_legend().texts[0].get_text()


def test_first_past_finds_the_step(exact):
    """t1's bar ends at step 12, t0 (never past tol) is marked, not barred."""
    ax = plot_first_past(exact, tol=1e-3)
    assert [p.get_width() for p in ax.patches] == [0, 12]


def test_hist_counts_every_token(exact):
    ax = plot_distribution_hist(exact)
    assert sum(p.get_height() for p in ax.patches) == len(exact)


def test_unknown_metric_is_named(exact):
    with pytest.raises(ValueError, match="'tv'"):
        plot_distribution_hist(exact, metric="tv")


def test_routing_flips_marks_the_flipped_cells():
    """The image is layers x steps with 1 exactly where the expert sets differ."""
    rows = [("t", s, layer, (0, 1)) for s in range(4) for layer in range(3)]
    a = pd.DataFrame(rows, columns=["trace_id", "step", "layer", "experts"])
    b = a.copy()
    b.loc[(b.step == 2) & (b.layer == 1), "experts"] = [(0, 5)]
    image = plot_routing_flips(a, b, "t").images[0].get_array()
    assert image.shape == (3, 4) and image.sum() == 1 and image[1, 2] == 1
