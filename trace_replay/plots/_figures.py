"""Helpers shared by the plot functions: own figures, side labels, shared colour scales."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import Colormap, LogNorm, Normalize, SymLogNorm
from matplotlib.figure import Figure, SubFigure
from matplotlib.image import AxesImage

from trace_replay.analysis.metrics import run_labels

BUCKET_COLORS = {
    "1-10": "#5fb85f",
    "11-100": "#f2d14b",
    "101-1000": "#e8615a",
    ">1000": "#9d6fd6",
    "bound": "#6fa8dc",
}
MARK = "#00c8ff"  # first divergence / tol marks, visible on light and dark cells
_SIGNED = ("delta", "k1")  # heatmap columns drawn on a symmetric scale whatever their values
_LABEL_FIELDS = ("engine", "dtype", "device")


def own_axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    """``ax``, or the Axes of a new pyplot figure (constrained layout) when it is None."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt  # only here: report.py draws without pyplot

    _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def finish(ax: Axes) -> Axes:
    """Make ``ax`` its figure's current Axes (not a twin or colour bar) and return it."""
    ax.figure.sca(ax)
    return ax


def run_label(attrs: Mapping) -> str:
    """One run's label from its engine, dtype and device; "" when it has none of them."""
    return run_labels([attrs])[0] if any(attrs.get(f) for f in _LABEL_FIELDS) else ""


def side_labels(data: pd.DataFrame, labels: tuple[str, str] | None) -> tuple[str, str]:
    """Names of sides a and b: ``labels``, else the comparison's ``attrs["labels"]``."""
    return tuple(labels or data.attrs.get("labels") or ("a", "b"))


def _shared_norm(fig: Figure | SubFigure, value: str) -> Normalize | None:
    gid = f"trace_replay.heatmap:{value}"
    for image in fig.figure.findobj(AxesImage):  # fig.figure: the root, across subfigures
        if image.get_gid() == gid:
            return image.norm
    return None


def heatmap_norm(
    fig: Figure | SubFigure,
    value: str,
    values: np.ndarray,
    tol: float,
    norm: Normalize | None,
) -> tuple[Normalize, Colormap, np.ndarray]:
    """Colour scale, colour map and drawable values for a heatmap of column ``value``.

    Values below the scale (zeros on a log scale) take the lowest colour and infinities the
    extreme colours, through the colour map's under/over colours rather than clipping, so
    the scale can widen later: a heatmap of the same column already in the figure has its
    scale widened to cover both and shared, unless ``norm`` is given.
    """
    finite = values[np.isfinite(values)]
    values = np.where(np.isinf(values), np.sign(values) * np.finfo(float).max, values)
    if value in _SIGNED or (finite.size and finite.min() < 0):
        bound = max(np.abs(finite).max() if finite.size else 0.0, 10 * tol)
        own, name = SymLogNorm(linthresh=tol, vmin=-bound, vmax=bound), "RdBu_r"
    else:
        positive = finite[finite > 0]
        floor = positive.min() if positive.size else tol / 100
        floor = min(floor, tol / 10) if value == "abs_delta" else floor
        top = max(positive.max() if positive.size else 1.0, floor * 10)
        own, name = LogNorm(vmin=floor, vmax=top), "magma_r"
        values = np.where(values <= 0, np.finfo(float).tiny, values)
    base = colormaps[name]
    cmap = base.with_extremes(under=base(0.0), over=base(1.0))
    if norm is not None:
        return norm, cmap, values
    shared = _shared_norm(fig, value)
    if shared is None or type(shared) is not type(own):
        return own, cmap, values
    shared.vmin, shared.vmax = min(shared.vmin, own.vmin), max(shared.vmax, own.vmax)
    return shared, cmap, values
