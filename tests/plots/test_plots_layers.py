"""Layer attribution and sweep figures draw what the frames say, on the Axes they return."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from trace_replay.analysis.capture import LAYER_SITES, SITES
from trace_replay.plots.layers import (
    plot_layer_divergence,
    plot_layer_profile,
    plot_sweep,
)

NUM_LAYERS = 3


@pytest.fixture
def frame() -> pd.DataFrame:
    """Two traces of 5 steps through 3 layers; runs differ from layer 1's mlp at steps >= 2
    (layer 2's mlp before that), nowhere earlier."""
    rows = []
    for trace_id in ("t0", "t1"):
        for step in range(5):
            first = 1 if step >= 2 else 2
            sites = [(-1, "embeddings")] + [
                (layer, site) for layer in range(NUM_LAYERS) for site in LAYER_SITES
            ]
            sites += [(NUM_LAYERS, "final_norm"), (NUM_LAYERS, "logits")]
            for layer, site in sites:
                late = layer > first or (layer == first and site in ("mlp", "residual"))
                diff = 10.0 ** (layer - 6) * (step + 1) if late else 0.0
                rows.append((trace_id, step, layer, site, diff, diff / 3, 1 - diff, diff == 0))
    data = pd.DataFrame(
        rows,
        columns=[
            "trace_id",
            "step",
            "layer",
            "site",
            "max_abs_diff",
            "rel_l2",
            "cosine",
            "bitwise_equal",
        ],
    )
    data["site"] = pd.Categorical(data["site"], categories=SITES, ordered=True)
    data.attrs = {
        "a": {"engine": "torch", "dtype": "float32"},
        "b": {"engine": "prefill", "dtype": "float32"},
        "tol": 0.0,
        "num_layers": NUM_LAYERS,
        "sites": list(SITES),
    }
    return data


def test_layer_heatmap_is_layers_by_steps_with_zeros_below_the_scale(frame):
    """One cell per (layer, step) of the site; equal cells fall below the colour scale."""
    ax = plot_layer_divergence(frame, site="residual")
    image = ax.images[0]
    values = image.get_array()
    assert values.shape == (NUM_LAYERS, 5)
    assert values[0, 0] < image.norm.vmin  # layer 0 is equal everywhere
    assert values[2, 4] == pytest.approx(10.0 ** (2 - 6) * 5)
    assert "prefill vs torch" in ax.get_title() and "t0" in ax.get_title()


def test_layer_heatmap_marks_the_first_divergent_layer_per_step(frame):
    """The marks sit at each step's first divergent layer (over all sites)."""
    ax = plot_layer_divergence(frame, site=None, trace_id="t1")
    assert ax.images[0].get_array().shape == (NUM_LAYERS + 2, 5)  # layers -1 .. 3
    marks = ax.get_lines()[0]
    assert list(marks.get_xdata()) == [0, 1, 2, 3, 4]
    assert list(marks.get_ydata()) == [2 + 1, 2 + 1, 1 + 1, 1 + 1, 1 + 1]  # row of layer L is L+1


def test_layer_heatmap_own_figure_or_given_axes(frame):
    """Without ax a new figure is made; with one, that Axes is drawn on, returned, current."""
    own = plot_layer_divergence(frame)
    fig, given = plt.subplots()
    assert plot_layer_divergence(frame, ax=given) is given
    assert own.figure is not fig and plt.gca() is given


def test_layer_heatmap_rejects_unknown_site_and_trace(frame):
    """A site name outside SITES and a trace not in the frame are errors naming them."""
    with pytest.raises(ValueError, match="attn"):
        plot_layer_divergence(frame, site="attn")
    with pytest.raises(KeyError, match="t9"):
        plot_layer_divergence(frame, trace_id="t9")


def test_layer_profile_one_line_per_site(frame):
    """One line per site, over the layers where that site exists."""
    ax = plot_layer_profile(frame, y="max_abs_diff", estimator="max")
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == list(SITES)
    mlp = ax.get_lines()[SITES.index("mlp")]
    assert list(mlp.get_xdata()) == [0, 1, 2]
    np.testing.assert_allclose(mlp.get_ydata(), [0.0, 1e-5 * 5, 1e-4 * 5])


@pytest.fixture
def sweep_frame() -> pd.DataFrame:
    table = pd.DataFrame(
        {
            "dtype": ["float32", "float32", "bfloat16", "bfloat16"],
            "batch_size": [1, 8, 1, 8],
            "mean_abs_delta": [0.0, 2e-6, 3e-2, 3.1e-2],
        }
    )
    table.attrs = {"grid": ["dtype", "batch_size"], "metrics": ["mean_abs_delta"]}
    return table


def test_sweep_matrix_cells_and_labels(sweep_frame):
    """x is the first grid key, rows the others; every cell annotated, zero as 'equal'."""
    ax = plot_sweep(sweep_frame)
    values = ax.images[0].get_array()
    assert values.shape == (2, 2)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["float32", "bfloat16"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["batch_size=1", "batch_size=8"]
    assert sorted(t.get_text() for t in ax.texts) == sorted(["equal", "2e-06", "0.03", "0.031"])


def test_sweep_refuses_ambiguous_cells_and_unknown_metrics(sweep_frame):
    """A varying grid key left out of x and y, or a missing metric, is an error."""
    with pytest.raises(ValueError, match="share a cell"):
        plot_sweep(sweep_frame, x="dtype", y=[])
    with pytest.raises(KeyError, match="k9"):
        plot_sweep(sweep_frame, metric="k9")
