"""Figures of layer attribution and configuration sweeps, seaborn style.

Every function takes ``data`` (the frame of :func:`~trace_replay.locate_divergence` or
:func:`~trace_replay.analysis.sweep`) and column names, draws on ``ax`` or, when none is given, on a
new figure of its own (constrained layout), leaves that Axes current (never a colour-bar
axis), returns it and never shows. Zeros — bitwise-equal activations, identical runs — are
drawn in light grey below a log colour scale, so "equal" never looks like "small".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm, Normalize

from trace_replay.analysis.attribution import divergence_origin
from trace_replay.analysis.capture import SITES
from trace_replay.plots._figures import MARK, finish, own_axes

__all__ = ["plot_layer_divergence", "plot_layer_profile", "plot_sweep"]

_EQUAL = "#eeeeee"  # cells without any difference
_LABEL_KEYS = ("engine", "dtype", "device", "batch_size", "backend", "deterministic", "model")


def _pair_label(attrs: Mapping) -> str:
    """``"b vs a"`` from the settings that differ between the two runs of an attribution frame."""
    a, b = attrs.get("a", {}), attrs.get("b", {})
    keys = [k for k in _LABEL_KEYS if a.get(k) != b.get(k)] or ["engine", "dtype"]
    name = lambda s: " ".join(str(s.get(k)) for k in keys if s.get(k) is not None)  # noqa: E731
    return f"{name(b) or 'b'} vs {name(a) or 'a'}"


def _log_image(ax: Axes, values: np.ndarray, label: str, norm: Normalize | None):
    """A log-scaled image whose zeros take the 'equal' colour and NaN stays blank."""
    positive = values[np.isfinite(values) & (values > 0)]
    if norm is None:
        low, high = (positive.min(), positive.max()) if len(positive) else (1e-12, 1e-11)
        norm = LogNorm(low, max(high, low * 10))
    cmap = colormaps["magma_r"].with_extremes(under=_EQUAL, bad="white", over="black")
    shown = np.where(values == 0, norm.vmin / 10, values)  # zeros fall below the scale
    image = ax.imshow(
        np.ma.masked_invalid(shown),
        aspect="auto",
        interpolation="nearest",
        origin="lower",
        norm=norm,
        cmap=cmap,
    )
    colorbar = ax.figure.colorbar(image, ax=ax, extend="min", pad=0.01)
    colorbar.set_label(f"{label}; grey = 0")
    return image


def plot_layer_divergence(
    data: pd.DataFrame,
    *,
    trace_id: str | None = None,
    site: str | None = "residual",
    value: str = "max_abs_diff",
    tol: float | None = None,
    norm: Normalize | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Layer x step image of one trace's difference at one site, first divergence marked.

    Parameters
    ----------
    data : DataFrame
        Output of :func:`~trace_replay.locate_divergence`.
    trace_id : str, optional
        The trace to draw; default the first in ``data``.
    site : str or None
        The site to draw (``"residual"``: the residual stream after each layer). ``None``
        draws, per layer, the largest ``value`` over its sites, embeddings (layer -1) to
        logits included.
    value : str
        ``"max_abs_diff"`` or ``"rel_l2"``.
    tol : float, optional
        Divergence threshold for the marks; default ``data.attrs["tol"]``.
    norm : Normalize, optional
        Colour scale to use (e.g. shared between panels).
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes
        Holding the image (``ax.images[0]``). Cyan dots mark, per step, the first layer
        where any site differs by more than ``tol`` (:func:`~trace_replay.divergence_origin`).

    Examples
    --------
    >>> import trace_replay as tr
    >>> frame = tr.locate_divergence([{"id": "t", "prompt": "Hi", "completion": " there"}],
    ...                              {"dtype": "float32"}, {"dtype": "bfloat16"}, progress=False)
    >>> ax = plot_layer_divergence(frame, site="mlp", value="rel_l2")
    >>> ax.images[0].get_array().shape  # 30 layers (+ the logits row) x 1 step
    (31, 1)
    """
    if site is not None and site not in SITES:
        raise ValueError(f"unknown site {site!r}; choose from {', '.join(SITES)}")
    trace_id = data["trace_id"].iloc[0] if trace_id is None else trace_id
    rows = data[data["trace_id"] == trace_id]
    if rows.empty:
        raise KeyError(f"trace {trace_id!r} not in the frame")
    rows.attrs = dict(data.attrs)
    shown = rows if site is None else rows[rows["site"] == site]
    if shown.empty:
        raise ValueError(f"site {site!r} was not captured (sites: {data.attrs.get('sites')})")
    grid = shown.pivot_table(
        index="layer", columns="step", values=value, aggfunc="max", observed=True
    )
    origin = divergence_origin(rows, tol=tol, by="step").dropna(subset=["layer"])
    # a mark below the site's layers (e.g. embeddings, for the residual) gets a blank row
    marked = origin["layer"].to_numpy(dtype="int64")
    low = min(int(grid.index.min()), *marked) if len(marked) else int(grid.index.min())
    layers = np.arange(low, int(grid.index.max()) + 1)
    steps = np.arange(int(rows["step"].max()) + 1)
    grid = grid.reindex(index=layers, columns=steps)
    ax = own_axes(ax, (min(4.0 + 0.12 * len(steps), 14.0), 2.5 + 0.12 * len(layers)))
    _log_image(ax, grid.to_numpy(dtype="float64"), value, norm)
    ax.set_xticks(np.arange(len(steps)) if len(steps) <= 40 else ax.get_xticks()[1:-1])
    every = max(1, -(-len(layers) // 16))
    ticks = [v for v in layers if v % every == 0 or v in (layers[0], layers[-1])]
    ax.set_yticks(np.asarray(ticks) - layers[0], [str(v) for v in ticks])
    if len(origin):
        ax.plot(
            origin["step"].to_numpy(),
            marked - layers[0],
            "o",
            color=MARK,
            ms=4,
            label="first divergent layer",
        )
        ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
    ax.set_xlabel("step")
    num_layers = data.attrs.get("num_layers")
    ax.set_ylabel(
        "layer"
        + (
            f" (-1 embeddings, {num_layers} final norm/logits)"
            if site is None and num_layers is not None
            else ""
        )
    )
    ax.set_title(
        f"{value} of {site or 'any site'} · {_pair_label(data.attrs)} · {trace_id}", fontsize=9
    )
    return finish(ax)


def plot_layer_profile(
    data: pd.DataFrame,
    *,
    y: str = "rel_l2",
    hue: str | None = "site",
    estimator: str = "median",
    ax: Axes | None = None,
) -> Axes:
    """``y`` per layer, aggregated over traces and steps, one line per ``hue`` level.

    Parameters
    ----------
    data : DataFrame
        Output of :func:`~trace_replay.locate_divergence` (or several, concatenated, with a
        column to use as ``hue``).
    y : str
        Metric column, e.g. ``"rel_l2"``, ``"max_abs_diff"`` or ``"bitwise_equal"`` (then
        the fraction of bitwise-equal rows, on a linear axis).
    hue : str, optional
        Column whose levels get one line each (default the site).
    estimator : str
        A pandas aggregation: ``"median"``, ``"mean"``, ``"max"``...
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes

    Examples
    --------
    >>> import trace_replay as tr
    >>> frame = tr.locate_divergence([{"id": "t", "prompt": "Hi", "completion": " there"}],
    ...                              {"dtype": "float32"}, {"dtype": "bfloat16"}, progress=False)
    >>> ax = plot_layer_profile(frame, y="rel_l2", estimator="max")
    >>> ax.get_title()
    'bfloat16 vs float32'
    """
    ax = own_axes(ax, (8.0, 4.0))
    values = data.assign(_y=data[y].astype("float64"))
    groups = [(None, values)] if hue is None else values.groupby(hue, sort=True, observed=True)
    for level, part in groups:
        line = part.groupby("layer")["_y"].agg(estimator)
        ax.plot(line.index, line.to_numpy(), marker=".", label=None if level is None else level)
    if y != "bitwise_equal":
        if (values["_y"] == 0).any():  # zeros stay visible, on a linear stretch
            ax.set_yscale("symlog", linthresh=_linthresh(values["_y"]))
        else:
            ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"{estimator} {y}" if y != "bitwise_equal" else "fraction bitwise equal")
    ax.set_title(_pair_label(data.attrs), fontsize=9)
    if hue is not None:
        ax.legend(fontsize=7, title=hue)
    return finish(ax)


def _linthresh(values: pd.Series) -> float:
    positive = values[(values > 0) & np.isfinite(values)]
    return float(positive.min()) if len(positive) else 1e-12


def plot_sweep(
    data: pd.DataFrame,
    *,
    metric: str = "mean_abs_delta",
    x: str | None = None,
    y: str | Sequence[str] | None = None,
    annotate: bool = True,
    norm: Normalize | None = None,
    ax: Axes | None = None,
) -> Axes:
    """The sweep as a matrix: one cell per configuration, coloured by ``metric``.

    Parameters
    ----------
    data : DataFrame
        Output of :func:`~trace_replay.analysis.sweep`.
    metric : str
        A metric column (any of :func:`~trace_replay.dataset_summary`'s metrics).
    x : str, optional
        Grid key along the columns; default the first of ``data.attrs["grid"]``.
    y : str or list of str, optional
        Grid key(s) along the rows (several are joined as ``"k=v, k=v"``); default the
        other grid keys.
    annotate : bool
        Write each cell's value in it.
    norm : Normalize, optional
        Colour scale to use; default log over the positive values.
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes

    Examples
    --------
    >>> table = pd.DataFrame({"dtype": ["float32", "float32", "bfloat16", "bfloat16"],
    ...                       "batch_size": [1, 8, 1, 8],
    ...                       "max_abs_delta": [0.0, 2e-6, 0.02, 0.03]})
    >>> table.attrs["grid"] = ["dtype", "batch_size"]  # as sweep() sets it
    >>> ax = plot_sweep(table, metric="max_abs_delta", x="batch_size")
    >>> [label.get_text() for label in ax.get_yticklabels()]
    ['dtype=float32', 'dtype=bfloat16']
    """
    if metric not in data.columns:
        raise KeyError(f"no metric {metric!r} in the sweep frame")
    keys = list(data.attrs.get("grid") or [])
    x = x or (keys[0] if keys else None)
    if x is None or x not in data.columns:
        raise ValueError(f"x must name a grid column, got {x!r}")
    y = [k for k in keys if k != x] if y is None else ([y] if isinstance(y, str) else list(y))
    cells = data.assign(_x=data[x].astype(str))
    cells["_y"] = (
        cells[y].astype(str).apply(lambda r: ", ".join(f"{k}={v}" for k, v in r.items()), axis=1)
        if y
        else metric
    )
    if cells.duplicated(["_x", "_y"]).any():
        raise ValueError(
            f"several configurations share a cell of x={x!r}, y={y!r}: "
            "name every varying grid key in x or y"
        )
    grid = cells.pivot(index="_y", columns="_x", values=metric)
    grid = grid.reindex(index=pd.unique(cells["_y"]), columns=pd.unique(cells["_x"]))
    ax = own_axes(ax, (2.5 + 1.3 * grid.shape[1], 1.5 + 0.45 * grid.shape[0]))
    values = grid.to_numpy(dtype="float64")
    image = _log_image(ax, values, metric, norm)
    ax.invert_yaxis()  # first configuration on top, as in the frame
    ax.set_xticks(np.arange(grid.shape[1]), list(grid.columns))
    ax.set_yticks(np.arange(grid.shape[0]), list(grid.index))
    ax.set_xlabel(x)
    if annotate:
        for (i, j), v in np.ndenumerate(values):
            text = "equal" if v == 0 else f"{v:.2g}"
            light = np.isfinite(v) and v > 0 and image.norm(v) > 0.6
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if light else "black",
            )
    ax.set_title(f"{metric} against the base run", fontsize=9)
    return finish(ax)
