"""Figures of replay and comparison frames, seaborn style.

Every function takes ``data`` (a DataFrame) and column names, draws on ``ax`` or, when none
is given, on a new figure of its own (constrained layout, so legends and colour bars are not
clipped), leaves that Axes current (never a twin or colour-bar axis), returns it and never
shows. ``hue=`` names a column whose values get one colour each, for long-form frames that
hold several runs or pairs. Comparison frames are recognised by their ``logprob_a`` /
``logprob_b`` columns; their sides are named by ``labels=``, else by ``attrs["labels"]``,
which :func:`~trace_replay.compare` fills from the runs' engine, dtype and device. A pair is
"b vs a" and a difference b − a, as in :mod:`trace_replay.analysis.metrics`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import Normalize

from trace_replay.analysis.metrics import NegativeEstimateWarning, summarize
from trace_replay.analysis.mismatch import require_comparison
from trace_replay.analysis.ranks import RANK_BUCKETS, exact_ranks, rank_bucket
from trace_replay.plots._figures import (
    BUCKET_COLORS,
    MARK,
    finish,
    heatmap_norm,
    own_axes,
    run_label,
    side_labels,
)
from trace_replay.plots.trace import plot_trace
from trace_replay.wording import plural

__all__ = [
    "BUCKET_COLORS",
    "plot_trace",
    "plot_divergence_heatmap",
    "plot_delta_hist",
    "plot_logprob_scatter",
    "plot_first_divergence",
    "plot_rank_buckets",
]


def _is_comparison(df: pd.DataFrame) -> bool:
    return "logprob_a" in df.columns and "logprob_b" in df.columns


def _check_hue(data: pd.DataFrame, hue: str | None) -> None:
    if hue is not None and hue not in data.columns:
        raise ValueError(
            f"hue={hue!r} is not a column of data; valid hue columns: "
            f"{', '.join(map(str, data.columns))}"
        )


def _check_columns(data: pd.DataFrame, caller: str, *columns: str) -> None:
    """Raise a `ValueError` naming ``caller`` and the ``columns`` that ``data`` lacks (a replay
    frame given where a comparison is needed: `require_comparison`'s message)."""
    missing = [c for c in columns if c not in data.columns]
    if missing and not _is_comparison(data):
        require_comparison(data, caller)
    if missing:
        raise ValueError(
            f"{caller}: {missing} not among the columns of data: "
            f"{', '.join(map(str, data.columns))}"
        )


def _require_rows(data: pd.DataFrame, caller: str) -> None:
    """Raise a `ValueError` naming ``caller`` when ``data`` has no rows to draw."""
    if data.empty:
        raise ValueError(f"{caller}: data has no rows, so there is nothing to draw")


def _groups(data: pd.DataFrame, hue: str | None) -> list[tuple[str | None, pd.DataFrame]]:
    _check_hue(data, hue)
    if hue is None:
        return [(None, data)]
    return [(str(level), part) for level, part in data.groupby(hue, sort=False)]


def _summary(data: pd.DataFrame, tol: float, hue: str | None = None) -> pd.DataFrame:
    """`summarize` of a comparison frame, per value of ``hue`` (kept as a column) when given.

    Concatenated comparisons share trace ids, so each ``hue`` level is summarized on its own.
    A figure draws no KL estimate, so summarize's `NegativeEstimateWarning` is not raised.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NegativeEstimateWarning)
        if hue is None:
            return summarize(data, tol=tol)
        parts = [
            summarize(part, tol=tol).assign(**{hue: level}) for level, part in _groups(data, hue)
        ]
    return pd.concat(parts, ignore_index=True)


def plot_divergence_heatmap(
    data: pd.DataFrame,
    *,
    value: str = "abs_delta",
    tol: float = 1e-3,
    labels: tuple[str, str] | None = None,
    norm: Normalize | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Traces x steps image of a comparison column, traces sorted by first divergence.

    Non-negative columns (``abs_delta``, ``k3``, ``ulp_distance``, ranks) use a log colour
    scale on which zeros (bit-equal tokens) take the lowest colour; signed columns
    (``delta``, ``k1``) a symmetric log scale around zero, linear within ``tol``.
    Non-finite deltas take the top colour, steps past a trace's end are grey, and a cyan
    tick marks each trace's first divergence (with a legend only when some trace diverged;
    ``tol`` is marked on the colour bar for ``abs_delta``).

    Heatmaps of the same ``value`` on axes of one figure share one colour scale: a later
    panel widens the scale of the earlier ones, so equal colours mean equal values.

    Parameters
    ----------
    data : DataFrame
        Output of :func:`~trace_replay.compare`.
    value : str
        Column to draw, e.g. ``"abs_delta"``, ``"delta"``, ``"k3"``, ``"rank_b"``.
    tol : float
        Divergence threshold on ``abs_delta``.
    labels : (str, str), optional
        Names of sides a and b for the title; default ``data.attrs["labels"]``.
    norm : Normalize, optional
        Colour scale to use as it is (e.g. one shared with another figure).
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes
        The Axes holding the image; its colour bar is ``ax.images[0].colorbar``.

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> ax = plot_divergence_heatmap(compare(a, b), tol=0.1)
    >>> ax.images[0].get_array().shape  # traces x steps
    (1, 3)
    >>> import matplotlib.pyplot as plt
    >>> fig, (top, bottom) = plt.subplots(2, 1, layout="constrained")
    >>> for axis, other in zip((top, bottom), (b, a.assign(logprob=[-0.5, -1.0, -2.5]))):
    ...     _ = plot_divergence_heatmap(compare(a, other), ax=axis)
    >>> top.images[0].norm is bottom.images[0].norm  # one colour scale for both
    True
    """
    _require_rows(data, "plot_divergence_heatmap")
    n_traces = data["trace_id"].nunique()
    ax = own_axes(ax, (11.0, min(2.2 + 0.22 * n_traces, 14.0)))
    summary = _summary(data, tol)
    order = summary.sort_values("first_divergence_step", na_position="last", kind="stable")
    cells = data[["trace_id", "step"]].assign(value=data[value].astype("float64"))
    if value in ("abs_delta", "k3"):
        cells["value"] = cells["value"].fillna(np.inf)  # a NaN delta is a divergence
    grid = cells.pivot(index="trace_id", columns="step", values="value")
    grid = grid.reindex(index=order["trace_id"], columns=range(int(data["step"].max()) + 1))
    values = grid.to_numpy()
    norm, cmap, values = heatmap_norm(ax.figure, value, values, tol, norm)
    image = ax.imshow(
        np.ma.masked_invalid(values), aspect="auto", interpolation="nearest", norm=norm, cmap=cmap
    )
    image.set_gid(f"trace_replay.heatmap:{value}")
    ax.set_facecolor("#dddddd")  # steps past a trace's end
    cbar = ax.figure.colorbar(image, ax=ax, extend="both", pad=0.01)
    cbar.set_label(value)
    if value == "abs_delta":
        cbar.ax.axhline(tol, color=MARK, lw=2)
    rows = np.arange(len(order))
    first = order["first_divergence_step"].astype("float64").to_numpy()
    if np.isfinite(first).any():
        ax.plot(first, rows, "|", color=MARK, ms=10, mew=2.5, label="first divergence")
        ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
    every = max(1, math.ceil(len(rows) / 40))
    ax.set_yticks(rows[::every], [str(t) for t in grid.index[::every]], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("trace (sorted by first divergence)")
    label_a, label_b = side_labels(data, labels)
    ax.set_title(f"{value} per token · {label_b} vs {label_a}")
    return finish(ax)


def plot_delta_hist(
    data: pd.DataFrame,
    *,
    x: str = "delta",
    hue: str | None = None,
    bins: int = 80,
    labels: tuple[str, str] | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Histogram of finite Δlogprob (b − a) on a log count axis, symmetric around zero.

    Parameters
    ----------
    data : DataFrame
        A comparison frame, or several concatenated with a column naming each (``hue``).
    x : str
        Column to count.
    hue : str, optional
        One outlined histogram per value of this column, on shared bins.
    bins : int
        Number of bins.
    labels : (str, str), optional
        Names of sides a and b for the axis label; default ``data.attrs["labels"]``.
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> plot_delta_hist(compare(a, b)).get_title()
    'Δ logprob over 3 tokens'
    >>> pairs = [compare(a, b), compare(a, a.assign(logprob=[-0.5, -1.0, -2.5]))]
    >>> both = pd.concat(pairs, keys=["fp32", "bf16"], names=["pair", None])
    >>> ax = plot_delta_hist(both.reset_index("pair"), hue="pair")
    >>> [text.get_text() for text in ax.get_legend().get_texts()]
    ['fp32', 'bf16']
    """
    _check_columns(data, "plot_delta_hist", x)
    ax = own_axes(ax, (6.0, 4.0))
    values = data[x].to_numpy(dtype="float64", na_value=np.nan)
    finite = values[np.isfinite(values)]
    bound = max(np.abs(finite).max() if finite.size else 0.0, 1e-6)
    edges = np.linspace(-bound, bound, bins + 1)
    for i, (level, part) in enumerate(_groups(data, hue)):
        part_values = part[x].to_numpy(dtype="float64", na_value=np.nan)
        ax.hist(
            part_values[np.isfinite(part_values)],
            bins=edges,
            log=True,
            color=f"C{i}",
            histtype="bar" if hue is None else "step",
            lw=0 if hue is None else 1.2,
            label=level,
        )
    ax.axvline(0, color="0.3", lw=0.8, ls="--")
    if hue is not None:
        ax.legend(title=hue, fontsize=7, loc="upper right")
    label_a, label_b = side_labels(data, labels)
    name = "Δ logprob" if x == "delta" else x
    ax.set_xlabel(f"{name} ({label_b} − {label_a}, nats)" if x == "delta" else name)
    ax.set_ylabel("tokens (log)")
    hidden = values.size - finite.size
    note = f" · {hidden} non-finite not shown" if hidden else ""
    ax.set_title(f"{name} over {plural(values.size, 'token')}{note}")
    return finish(ax)


def plot_logprob_scatter(
    data: pd.DataFrame,
    *,
    x: str = "logprob_a",
    y: str = "logprob_b",
    hue: str | None = None,
    tol: float = 1e-3,
    labels: tuple[str, str] | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Scatter of one side's logprob against the other's, with the diagonal.

    Without ``hue`` the tokens with ``|y - x| > tol`` are red, the others blue.

    Parameters
    ----------
    data : DataFrame
        A comparison frame.
    x, y : str
        Columns on the two axes.
    hue : str, optional
        Colour the points by this column instead (e.g. ``"trace_id"``).
    tol : float
        Divergence threshold (without ``hue``).
    labels : (str, str), optional
        Names of sides a and b for the axis labels; default ``data.attrs["labels"]``.
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> ax = plot_logprob_scatter(compare(a, b, labels=("fp32", "bf16")), tol=0.1)
    >>> ax.get_xlabel(), ax.get_ylabel()
    ('logprob fp32', 'logprob bf16')
    """
    _check_columns(data, "plot_logprob_scatter", x, y)
    ax = own_axes(ax, (5.0, 5.0))
    xs, ys = (data[c].to_numpy(dtype="float64", na_value=np.nan) for c in (x, y))
    if hue is None:
        divergent = np.abs(ys - xs) > tol
        sets = [(~divergent, "C0", f"|Δ| ≤ {tol:g}"), (divergent, "#e8615a", f"|Δ| > {tol:g}")]
    else:
        _check_hue(data, hue)
        levels = data[hue].astype(str).to_numpy()
        sets = [(levels == lv, f"C{i}", lv) for i, lv in enumerate(pd.unique(levels))]
    for mask, color, label in sets:
        ax.scatter(xs[mask], ys[mask], s=6, alpha=0.6, color=color, label=label)
    both = np.concatenate([xs, ys])
    both = both[np.isfinite(both)]
    low, high = (both.min(), both.max()) if both.size else (-1.0, 0.0)
    ax.plot([low, high], [low, high], "--", color="0.4", lw=0.8, label="y = x")
    label_a, label_b = side_labels(data, labels)
    names = {"logprob_a": f"logprob {label_a}", "logprob_b": f"logprob {label_b}"}
    ax.set_xlabel(names.get(x, x))
    ax.set_ylabel(names.get(y, y))
    ax.set_title(f"{names.get(y, y)} vs {names.get(x, x)}")
    ax.legend(fontsize=7, loc="upper left", title=hue)
    return finish(ax)


def plot_first_divergence(
    data: pd.DataFrame,
    *,
    hue: str | None = None,
    tol: float = 1e-3,
    ax: Axes | None = None,
) -> Axes:
    """CDF over traces of the first divergence step; never-diverging traces keep it below 1.

    Parameters
    ----------
    data : DataFrame
        Output of :func:`~trace_replay.summarize`, or a comparison frame (summarized here
        with ``tol``); with ``hue``, several summaries or comparison frames concatenated
        with a column naming each.
    hue : str, optional
        One CDF per value of this column (a comparison frame is summarized per value).
    tol : float
        Divergence threshold, used only when ``data`` is a comparison frame.
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes

    Raises
    ------
    ValueError
        If ``hue`` is not a column of ``data`` (the message lists the columns).

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> ax = plot_first_divergence(summarize(compare(a, b), tol=0.1))
    >>> [text.get_text() for text in ax.get_legend().get_texts()]
    ['diverged by step', 'never diverged: 0/1 traces']
    """
    if "first_divergence_step" not in data.columns:
        data = _summary(data, tol, hue)
    _require_rows(data, "plot_first_divergence")
    ax = own_axes(ax, (6.0, 4.0))
    end = max(int(data["n_tokens"].max()), 1)
    for i, (level, part) in enumerate(_groups(data, hue)):
        first = part["first_divergence_step"].astype("float64")
        n, diverged = len(first), np.sort(first.dropna().to_numpy())
        x = np.concatenate([[0], diverged, [end]])
        y = np.concatenate([[0], np.arange(1, diverged.size + 1), [diverged.size]]) / max(n, 1)
        name = "diverged by step" if level is None else level
        ax.step(x, y, where="post", color=f"C{i}", label=name)
        never = f"never diverged: {n - diverged.size}/{n} traces"
        ax.axhline(
            y[-1],
            color=f"C{i}" if hue else "0.5",
            ls=":",
            lw=1,
            label=never if level is None else f"{level}: {never}",
        )
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("first divergence step")
    ax.set_ylabel("fraction of traces")
    ax.set_title("first divergence (CDF over traces)")
    ax.legend(fontsize=7, loc="lower right")
    return finish(ax)


def plot_rank_buckets(
    data: pd.DataFrame,
    *,
    hue: str | None = None,
    by: str | None = None,
    labels: tuple[str, str] | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Stacked bars of GLTR rank-bucket fractions, one bar per value of ``hue``.

    A comparison frame gets one bar per side with a known rank (``hue`` ignored), named by
    ``labels``; a single run without ``hue`` one bar named from its attrs. Lower-bound
    ranks (``rank_exact`` False) that do not decide their range make a bucket of their own,
    ``"bound"``.

    Parameters
    ----------
    data : DataFrame
        Replay frame (with ``rank``) or comparison frame.
    hue : str, optional
        One bar per value of this column, in order of appearance.
    by : str, optional
        Same as ``hue`` (its earlier name).
    labels : (str, str), optional
        Names of sides a and b of a comparison; default ``data.attrs["labels"]``.
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes

    Examples
    --------
    >>> fp32 = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "rank": [1, 2, 40]})
    >>> bf16 = fp32.assign(rank=[1, 3, 2000])
    >>> runs = pd.concat([fp32, bf16], keys=["fp32", "bf16"], names=["run", None])
    >>> ax = plot_rank_buckets(runs.reset_index("run"), hue="run")
    >>> [label.get_text() for label in ax.get_xticklabels()]
    ['fp32', 'bf16']
    """
    hue = hue or by
    if _is_comparison(data):
        label_a, label_b = side_labels(data, labels)
        sides = [
            (label_a, rank_bucket(data["rank_a"], exact_ranks(data, "_a"))),
            (label_b, rank_bucket(data["rank_b"], exact_ranks(data, "_b"))),
        ]
        groups = [(name, buckets) for name, buckets in sides if buckets.notna().any()]
    elif hue is None:
        groups = [(run_label(data.attrs) or "all", rank_bucket(data["rank"], exact_ranks(data)))]
    else:
        groups = [
            (key, rank_bucket(part["rank"], exact_ranks(part))) for key, part in _groups(data, hue)
        ]
    ax = own_axes(ax, (max(4.0, 1.1 * len(groups) + 2.5), 4.0))
    fractions = (
        pd.DataFrame({name: buckets.value_counts(normalize=True) for name, buckets in groups})
        .reindex(list(RANK_BUCKETS))
        .fillna(0.0)
    )
    bottom = np.zeros(fractions.shape[1])
    for bucket, row in fractions.iterrows():
        ax.bar(
            fractions.columns,
            row.to_numpy(),
            bottom=bottom,
            color=BUCKET_COLORS[bucket],
            label=bucket,
            edgecolor="white",
            linewidth=0.5,
        )
        bottom += row.to_numpy()
    ax.set_ylim(0, 1.2)  # the band above 1 holds the legend, inside the Axes
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_ylabel("fraction of tokens")
    ax.set_xlabel(hue or ("run" if _is_comparison(data) else ""))
    ax.set_title("GLTR rank buckets")
    ax.legend(fontsize=7, loc="upper center", ncols=len(RANK_BUCKETS), frameon=False)
    return finish(ax)
