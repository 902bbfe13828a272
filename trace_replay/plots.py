"""Figures of replay and comparison frames, seaborn style.

Every function takes a DataFrame (and column names), draws on ``ax`` (default
``plt.gca()``), returns the Axes and never shows. Comparison frames are recognised by their
``logprob_a``/``logprob_b`` columns; their ``attrs["labels"]`` name the two sides.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm, SymLogNorm

from trace_replay.analysis import RANK_BUCKETS, compare, rank_bucket, summarize
from trace_replay.tokens_html import visible_token

__all__ = [
    "BUCKET_COLORS",
    "plot_trace",
    "plot_divergence_heatmap",
    "plot_delta_hist",
    "plot_logprob_scatter",
    "plot_first_divergence",
    "plot_rank_buckets",
]

BUCKET_COLORS = {"top-10": "#5fb85f", "top-100": "#f2d14b", "top-1000": "#e8615a",
                 "rest": "#9d6fd6"}  # fmt: skip
_MARK = "#00c8ff"  # first divergence / tol marks, visible on light and dark cells


def _labels(df: pd.DataFrame) -> tuple[str, str]:
    return tuple(df.attrs.get("labels", ("a", "b")))


def _is_comparison(df: pd.DataFrame) -> bool:
    return "logprob_a" in df.columns and "logprob_b" in df.columns


def _one_trace(df: pd.DataFrame, trace_id: str) -> pd.DataFrame:
    part = df[df["trace_id"] == trace_id]
    if part.empty:
        raise KeyError(f"trace {trace_id!r} not in the frame")
    part.attrs = dict(df.attrs)
    return part


def _as_comparison(df: pd.DataFrame, other: pd.DataFrame | None) -> pd.DataFrame | None:
    if other is not None:
        names = (df.attrs.get("engine", "run"), other.attrs.get("engine", "other"))
        return compare(df, other, labels=names if names[0] != names[1] else ("run", "other"))
    if _is_comparison(df):
        return df
    if "ref_logprob" in df.columns and df["ref_logprob"].notna().any():
        return compare(df.dropna(subset=["ref_logprob"]), "ref")
    return None


def _runs(steps: np.ndarray) -> list[tuple[float, float]]:
    """(start, width) spans covering consecutive steps, for one shaded patch per run."""
    if not len(steps):
        return []
    breaks = np.flatnonzero(np.diff(steps) != 1)
    starts = np.r_[steps[0], steps[breaks + 1]]
    stops = np.r_[steps[breaks], steps[-1]]
    return [(start - 0.5, stop - start + 1.0) for start, stop in zip(starts, stops, strict=True)]


def _thin_ticks(ax: Axes, steps: np.ndarray, tokens: list[str], max_labels: int) -> None:
    every = max(1, math.ceil(len(steps) / max(1, max_labels)))
    ax.set_xticks(steps[::every])
    ax.set_xticklabels([visible_token(t)[:16] for t in tokens[::every]], rotation=90,
                       fontsize=7, fontfamily="monospace")  # fmt: skip


def plot_trace(
    df: pd.DataFrame,
    trace_id: str,
    *,
    other: pd.DataFrame | None = None,
    ax: Axes | None = None,
    max_labels: int = 60,
    window: tuple[int, int] | None = None,
    tol: float = 1e-3,
) -> Axes:
    """Per-token logprob of one trace, with rank on a secondary log axis.

    Draws the second run's logprob too when ``other`` is given, when ``df`` is a comparison
    frame, or when ``df`` carries ``ref_logprob``; steps with ``abs_delta > tol`` (or a
    non-finite delta) are shaded.

    Parameters
    ----------
    df : DataFrame
        Replay frame or comparison frame.
    trace_id : str
        Trace to draw.
    other : DataFrame, optional
        A second replay of the same traces, compared with :func:`~trace_replay.compare`.
    ax : Axes, optional
        Axes to draw on; ``plt.gca()`` by default.
    max_labels : int
        At most this many token tick labels (every n-th token otherwise).
    window : (int, int), optional
        Only steps ``start <= step < stop``.
    tol : float
        Divergence threshold on ``abs_delta``.

    Returns
    -------
    Axes
        The logprob Axes; the rank twin is ``ax.rank_ax`` (also in ``ax.figure.axes``).

    Examples
    --------
    >>> df = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token": [" a", " b", " c"],
    ...                    "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> fig, ax = plt.subplots()
    >>> ax = plot_trace(df, "t", ax=ax)
    >>> ax.get_title(), ax.rank_ax.get_ylabel()
    ('trace t', 'rank (log, 1 at top)')
    >>> plt.close(fig)
    """
    ax = ax or plt.gca()
    df = _one_trace(df, trace_id)
    cmp = _as_comparison(df, None if other is None else _one_trace(other, trace_id))
    data = (df if cmp is None else cmp).sort_values("step")
    if window is not None:
        data = data[(data["step"] >= window[0]) & (data["step"] < window[1])]
    steps = data["step"].to_numpy()
    tokens = data["token"].astype(str).tolist() if "token" in data else [""] * len(steps)

    rank_ax = ax.twinx()
    rank_ax.set_yscale("log")
    if cmp is None:
        ax.plot(steps, data["logprob"], ".-", color="C0", lw=1, ms=4, label="logprob")
        ranks = [("rank", data["rank"], "C0")]
    else:
        label_a, label_b = _labels(cmp)
        ax.plot(steps, data["logprob_a"], "-", color="C1", lw=3, alpha=0.45,
                label=f"logprob {label_a}")  # fmt: skip
        ax.plot(steps, data["logprob_b"], ".-", color="C0", lw=1, ms=4,
                label=f"logprob {label_b}")  # fmt: skip
        ranks = [(f"rank {label_a}", data["rank_a"], "C1"),
                 (f"rank {label_b}", data["rank_b"], "C0")]  # fmt: skip
        delta = data["delta"].to_numpy(dtype="float64")
        spans = _runs(steps[(np.abs(delta) > tol) | ~np.isfinite(delta)])
        if spans:
            ax.broken_barh(spans, (0, 1), facecolor="#e8615a", edgecolor="none", alpha=0.18,
                           transform=ax.get_xaxis_transform(), label=f"|Δ| > {tol:g}")  # fmt: skip
    for label, rank, color in ranks:
        rank = rank.astype("float64")
        if rank.notna().any():
            rank_ax.plot(steps, rank, "x", color=color, ms=4, alpha=0.5, label=label)
    rank_ax.set_ylim(bottom=max(rank_ax.get_ylim()[1], 10) * 1.5, top=0.7)
    rank_ax.set_ylabel("rank (log, 1 at top)")
    ax.set_ylabel("logprob (nats)")
    ax.set_xlabel("token (step numbers on top)")
    if len(steps):
        ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        _thin_ticks(ax, steps, tokens, max_labels)
        ax.secondary_xaxis("top").tick_params(labelsize=7)
    attrs = df.attrs if cmp is None else {**cmp.attrs.get("attrs_b", {}), **df.attrs}
    model = attrs.get("model")
    ax.set_title(f"trace {trace_id}" + (f" · {model}" if model else ""), fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    rank_handles, rank_labels = rank_ax.get_legend_handles_labels()
    ax.legend(handles + rank_handles, labels + rank_labels, fontsize=7, loc="upper left",
              bbox_to_anchor=(1.07, 1.0), borderaxespad=0)  # fmt: skip
    ax.set_zorder(rank_ax.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.rank_ax = rank_ax
    return ax


def plot_divergence_heatmap(
    cmp: pd.DataFrame,
    *,
    value: str = "abs_delta",
    tol: float = 1e-3,
    ax: Axes | None = None,
) -> Axes:
    """Traces x steps image of a comparison column, traces sorted by first divergence.

    Non-negative columns (``abs_delta``, ``k3``, ranks) use a log colour scale whose floor
    (zeros, bitwise-equal tokens) is the lowest colour; signed columns (``delta``) a
    symmetric log scale around zero. Non-finite deltas take the top colour, steps past a
    trace's end are grey, and a cyan tick marks each trace's first divergence (and ``tol``
    on the colour bar).

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`~trace_replay.compare`.
    value : str
        Column to draw, e.g. ``"abs_delta"``, ``"delta"``, ``"k3"``, ``"rank_b"``.
    tol : float
        Divergence threshold; marked on the colour bar for ``abs_delta``.
    ax : Axes, optional
        Axes to draw on; ``plt.gca()`` by default.

    Returns
    -------
    Axes
        The Axes holding the image; its colour bar is ``ax.images[0].colorbar``.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> fig, ax = plt.subplots()
    >>> ax = plot_divergence_heatmap(compare(a, b), tol=0.1, ax=ax)
    >>> ax.images[0].get_array().shape  # traces x steps
    (1, 3)
    >>> plt.close(fig)
    """
    ax = ax or plt.gca()
    summary = summarize(cmp, tol=tol)
    order = summary.sort_values("first_divergence_step", na_position="last", kind="stable")
    cells = cmp[["trace_id", "step"]].assign(value=cmp[value].astype("float64"))
    if value in ("abs_delta", "k3"):
        cells["value"] = cells["value"].fillna(np.inf)  # a NaN delta is a divergence
    grid = cells.pivot(index="trace_id", columns="step", values="value")
    grid = grid.reindex(index=order["trace_id"], columns=range(int(cmp["step"].max()) + 1))
    values = grid.to_numpy()
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() < 0:
        bound = max(np.abs(finite).max(), 10 * tol)
        norm, cmap = SymLogNorm(linthresh=tol, vmin=-bound, vmax=bound), "RdBu_r"
    else:
        positive = finite[finite > 0]
        floor = positive.min() if positive.size else tol / 100
        floor = min(floor, tol / 10) if value == "abs_delta" else floor
        top = max(positive.max() if positive.size else 1.0, floor * 10)
        values = np.where(np.isnan(values), np.nan, np.clip(values, floor, top))
        norm, cmap = LogNorm(vmin=floor, vmax=top), "magma_r"
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest",
                      norm=norm, cmap=cmap)  # fmt: skip
    ax.set_facecolor("#dddddd")  # steps past a trace's end
    cbar = ax.figure.colorbar(image, ax=ax, extend="both", pad=0.01)
    cbar.set_label(value)
    if value == "abs_delta":
        cbar.ax.axhline(tol, color=_MARK, lw=2)
    rows = np.arange(len(order))
    first = order["first_divergence_step"].astype("float64").to_numpy()
    ax.plot(first, rows, "|", color=_MARK, ms=10, mew=2.5, label="first divergence")
    ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
    every = max(1, math.ceil(len(rows) / 40))
    ax.set_yticks(rows[::every], [str(t) for t in grid.index[::every]], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("trace (sorted by first divergence)")
    ax.set_title(f"{value} per token · {' vs '.join(_labels(cmp))}")
    return ax


def plot_delta_hist(cmp: pd.DataFrame, ax: Axes | None = None, *, bins: int = 80) -> Axes:
    """Histogram of finite Δlogprob (b − a) on a log count axis.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> fig, ax = plt.subplots()
    >>> plot_delta_hist(compare(a, b), ax=ax).get_title()
    'Δ logprob over 3 tokens'
    >>> plt.close(fig)
    """
    ax = ax or plt.gca()
    delta = cmp["delta"].to_numpy(dtype="float64")
    finite = delta[np.isfinite(delta)]
    bound = max(np.abs(finite).max() if finite.size else 0.0, 1e-6)
    ax.hist(finite, bins=np.linspace(-bound, bound, bins + 1), color="C0", log=True)
    ax.axvline(0, color="0.3", lw=0.8, ls="--")
    label_a, label_b = _labels(cmp)
    ax.set_xlabel(f"Δ logprob ({label_b} − {label_a}, nats)")
    ax.set_ylabel("tokens (log)")
    hidden = delta.size - finite.size
    note = f" · {hidden} non-finite not shown" if hidden else ""
    ax.set_title(f"Δ logprob over {delta.size} tokens{note}")
    return ax


def plot_logprob_scatter(
    cmp: pd.DataFrame, ax: Axes | None = None, *, tol: float = 1e-3
) -> Axes:
    """Scatter of logprob b against logprob a, with the diagonal; divergent tokens in red.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> fig, ax = plt.subplots()
    >>> ax = plot_logprob_scatter(compare(a, b, labels=("fp32", "bf16")), ax=ax, tol=0.1)
    >>> ax.get_xlabel(), ax.get_ylabel()
    ('logprob fp32', 'logprob bf16')
    >>> plt.close(fig)
    """
    ax = ax or plt.gca()
    x, y = cmp["logprob_a"].to_numpy(dtype="float64"), cmp["logprob_b"].to_numpy(dtype="float64")
    divergent = np.abs(y - x) > tol
    for mask, color, label in ((~divergent, "C0", f"|Δ| ≤ {tol:g}"),
                               (divergent, "#e8615a", f"|Δ| > {tol:g}")):  # fmt: skip
        ax.scatter(x[mask], y[mask], s=6, alpha=0.6, color=color, label=label)
    both = np.concatenate([x, y])
    both = both[np.isfinite(both)]
    low, high = (both.min(), both.max()) if both.size else (-1.0, 0.0)
    ax.plot([low, high], [low, high], "--", color="0.4", lw=0.8, label="y = x")
    label_a, label_b = _labels(cmp)
    ax.set_xlabel(f"logprob {label_a}")
    ax.set_ylabel(f"logprob {label_b}")
    ax.set_title(f"logprob {label_b} vs {label_a}")
    ax.legend(fontsize=7, loc="upper left")
    return ax


def plot_first_divergence(summary: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """CDF over traces of the first divergence step; never-diverging traces keep it below 1.

    Parameters
    ----------
    summary : DataFrame
        Output of :func:`~trace_replay.summarize` (a comparison frame is summarized first).
    ax : Axes, optional
        Axes to draw on; ``plt.gca()`` by default.

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> fig, ax = plt.subplots()
    >>> ax = plot_first_divergence(summarize(compare(a, b), tol=0.1), ax=ax)
    >>> [text.get_text() for text in ax.get_legend().get_texts()]
    ['diverged by step', 'never diverged: 0/1 traces']
    >>> plt.close(fig)
    """
    ax = ax or plt.gca()
    if "first_divergence_step" not in summary.columns:
        summary = summarize(summary)
    first = summary["first_divergence_step"].astype("float64")
    n, diverged = len(first), np.sort(first.dropna().to_numpy())
    x = np.concatenate([[0], diverged, [max(summary["n_tokens"].max(), 1)]])
    y = np.concatenate([[0], np.arange(1, diverged.size + 1), [diverged.size]]) / max(n, 1)
    ax.step(x, y, where="post", color="C0", label="diverged by step")
    never = n - diverged.size
    ax.axhline(y[-1], color="0.5", ls=":", lw=1,
               label=f"never diverged: {never}/{n} traces")  # fmt: skip
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("first divergence step")
    ax.set_ylabel("fraction of traces")
    ax.set_title("first divergence (CDF over traces)")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_rank_buckets(
    df: pd.DataFrame, *, by: str | None = None, ax: Axes | None = None
) -> Axes:
    """Stacked bars of GLTR rank-bucket fractions, one bar per value of ``by``.

    A comparison frame gets one bar per side with a known rank (``by`` ignored).

    Examples
    --------
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> b = a.assign(logprob=[-0.5, -1.25, -2.0], rank=[1, 3, 1])
    >>> runs = pd.concat([a, b], keys=["fp32", "bf16"], names=["run", None]).reset_index("run")
    >>> fig, ax = plt.subplots()
    >>> ax = plot_rank_buckets(runs, by="run", ax=ax)
    >>> [label.get_text() for label in ax.get_xticklabels()]
    ['fp32', 'bf16']
    >>> plt.close(fig)
    """
    ax = ax or plt.gca()
    if _is_comparison(df):
        label_a, label_b = _labels(df)
        sides = [(label_a, df["rank_a"]), (label_b, df["rank_b"])]
        groups = [(name, rank) for name, rank in sides if rank.notna().any()]
    elif by is None:
        groups = [("all", df["rank"])]
    else:
        groups = [(str(key), part["rank"]) for key, part in df.groupby(by, sort=False)]
    fractions = pd.DataFrame(
        {name: rank_bucket(rank).value_counts(normalize=True) for name, rank in groups}
    ).reindex(list(RANK_BUCKETS)).fillna(0.0)
    bottom = np.zeros(fractions.shape[1])
    for bucket, row in fractions.iterrows():
        ax.bar(fractions.columns, row.to_numpy(), bottom=bottom, color=BUCKET_COLORS[bucket],
               label=bucket, edgecolor="white", linewidth=0.5)  # fmt: skip
        bottom += row.to_numpy()
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of tokens")
    ax.set_xlabel(by or ("run" if _is_comparison(df) else ""))
    ax.set_title("GLTR rank buckets")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
