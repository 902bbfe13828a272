"""One trace's per-token logprob and rank (:func:`plot_trace`, re-exported by plots)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.transforms import offset_copy

from trace_replay.analysis.metrics import compare
from trace_replay.analysis.ranks import exact_ranks
from trace_replay.plots._figures import finish, own_axes, run_label, side_labels
from trace_replay.wording import visible_token

__all__ = ["plot_trace"]

_SHADE = "#e8615a"
_LEGEND_GAP_IN = 0.75  # room right of the axes for the rank axis's tick labels and label


def _one_trace(df: pd.DataFrame, trace_id: str) -> pd.DataFrame:
    part = df[df["trace_id"] == trace_id]
    if part.empty:
        raise KeyError(f"trace {trace_id!r} not in the frame")
    part.attrs = dict(df.attrs)
    return part


def _as_comparison(df: pd.DataFrame, other: pd.DataFrame | None) -> pd.DataFrame | None:
    if other is not None:
        return compare(df, other)
    if "logprob_a" in df.columns and "logprob_b" in df.columns:
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
    ax.set_xticklabels(
        [visible_token(t)[:16] for t in tokens[::every]],
        rotation=90,
        fontsize=7,
        fontfamily="monospace",
    )


def _window(data: pd.DataFrame, window: tuple[int, int] | None) -> pd.DataFrame:
    data = data.sort_values("step", kind="stable")
    if window is None:
        return data
    return data[(data["step"] >= window[0]) & (data["step"] < window[1])]


def plot_trace(
    data: pd.DataFrame,
    trace_id: str,
    *,
    other: pd.DataFrame | None = None,
    hue: str | None = None,
    labels: tuple[str, str] | None = None,
    max_labels: int = 60,
    window: tuple[int, int] | None = None,
    tol: float = 1e-3,
    ax: Axes | None = None,
) -> Axes:
    """Per-token logprob of one trace, with rank on a secondary log axis (rank 1 at top).

    Draws a second run's logprob too when ``other`` is given, when ``data`` is a comparison
    frame, or when ``data`` carries ``ref_logprob``; steps with ``abs_delta > tol`` (or a
    non-finite delta) are then shaded. With ``hue``, ``data`` is a long-form replay frame
    holding several runs and each value of the column gets its own line.

    Parameters
    ----------
    data : DataFrame
        Replay frame or comparison frame.
    trace_id : str
        Trace to draw.
    other : DataFrame, optional
        A second replay of the same traces, compared with :func:`~trace_replay.compare`
        (``data`` is side a).
    hue : str, optional
        Column naming the run of each row of a long-form replay frame.
    labels : (str, str), optional
        Names of sides a and b of a comparison; default from the runs' attrs.
    max_labels : int
        At most this many token tick labels (every n-th token otherwise).
    window : (int, int), optional
        Only steps ``start <= step < stop``.
    tol : float
        Divergence threshold on ``abs_delta``.
    ax : Axes, optional
        Axes to draw on; a new figure when omitted.

    Returns
    -------
    Axes
        The logprob Axes, left current; the rank twin is ``ax.rank_ax``.

    Examples
    --------
    >>> fp32 = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                      "token": [" a", " b", " c"], "logprob": [-0.5, -1.0, -2.0],
    ...                      "rank": [1, 2, 1]})
    >>> ax = plot_trace(fp32, "t", window=(0, 2))
    >>> ax.get_title(), ax.rank_ax.get_ylabel()
    ('trace t', 'rank (log, 1 at top)')
    >>> ax = plot_trace(fp32, "t", other=fp32.assign(logprob=[-0.5, -1.25, -2.0]))
    >>> [text.get_text() for text in ax.get_legend().get_texts()]
    ['logprob a', 'logprob b', '|Δ| > 0.001', 'rank a', 'rank b']
    """
    ax = own_axes(ax, (11.0, 4.0))
    df = _one_trace(data, trace_id)
    second = None if other is None else _one_trace(other, trace_id)
    cmp = None if hue else _as_comparison(df, second)
    rank_ax = ax.twinx()
    rank_ax.set_yscale("log")
    if hue is not None:
        lines = [
            (str(level), part, "logprob", "rank", f"C{i}", "-")
            for i, (level, part) in enumerate(df.groupby(hue, sort=False))
        ]
        shown = _window(df, window)
    elif cmp is None:
        lines = [("", df, "logprob", "rank", "C0", ".-")]
        shown = _window(df, window)
    else:
        label_a, label_b = side_labels(cmp, labels)
        lines = [
            (label_a, cmp, "logprob_a", "rank_a", "C1", "-"),
            (label_b, cmp, "logprob_b", "rank_b", "C0", ".-"),
        ]
        shown = _window(cmp, window)
    for name, part, logprob, rank, color, style in lines:
        part = _window(part, window)
        steps = part["step"].to_numpy()
        wide = cmp is not None and logprob == "logprob_a"  # side a under side b, both visible
        ax.plot(
            steps,
            part[logprob],
            style,
            color=color,
            lw=3 if wide else 1,
            ms=4,
            alpha=0.45 if wide else 1.0,
            label=f"logprob {name}".strip(),
        )
        ranks = part[rank].astype("float64")
        bound = ~exact_ranks(part, rank[len("rank") :]).to_numpy()
        if ranks[~bound].notna().any():
            rank_ax.plot(
                steps[~bound],
                ranks[~bound],
                "x",
                color=color,
                ms=4,
                alpha=0.5,
                label=f"rank {name}".strip(),
            )
        if bound.any():  # a lower bound: the rank is this or below it (the axis runs down)
            rank_ax.plot(
                steps[bound],
                ranks[bound],
                "v",
                color=color,
                ms=4,
                alpha=0.5,
                label=f"rank {name} (lower bound)".replace("  ", " "),
            )
    steps = np.unique(shown["step"].to_numpy())
    if cmp is not None:
        delta = shown["delta"].to_numpy(dtype="float64")
        spans = _runs(shown["step"].to_numpy()[(np.abs(delta) > tol) | ~np.isfinite(delta)])
        if spans:
            ax.broken_barh(
                spans,
                (0, 1),
                facecolor=_SHADE,
                edgecolor="none",
                alpha=0.18,
                transform=ax.get_xaxis_transform(),
                label=f"|Δ| > {tol:g}",
            )
    rank_ax.set_ylim(bottom=max(rank_ax.get_ylim()[1], 10) * 1.5, top=0.7)
    rank_ax.set_ylabel("rank (log, 1 at top)")
    ax.set_ylabel("logprob (nats)")
    ax.set_xlabel("token (step numbers on top)")
    if len(steps):
        first = shown.drop_duplicates("step")
        tokens = first["token"].astype(str).tolist() if "token" in first else [""] * len(steps)
        ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        _thin_ticks(ax, first["step"].to_numpy(), tokens, max_labels)
        ax.secondary_xaxis("top").tick_params(labelsize=7)
    attrs = df.attrs if cmp is None else {**cmp.attrs.get("attrs_b", {}), **df.attrs}
    single = run_label(df.attrs) if hue is None and cmp is None else None
    parts = [f"trace {trace_id}", attrs.get("model"), single]
    ax.set_title(" · ".join(str(p) for p in parts if p), fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    rank_handles, rank_names = rank_ax.get_legend_handles_labels()
    # outside the axes, right of the rank axis's labels: inside, it would hide lines
    beside = offset_copy(ax.transAxes, fig=ax.figure, x=_LEGEND_GAP_IN, units="inches")
    ax.legend(
        handles + rank_handles,
        names + rank_names,
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        bbox_transform=beside,
        title=hue,
    )
    ax.set_zorder(rank_ax.get_zorder() + 1)  # logprob lines and legend above the rank marks
    ax.patch.set_visible(False)
    ax.rank_ax = rank_ax
    return finish(ax)
