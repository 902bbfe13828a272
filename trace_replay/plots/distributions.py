"""Figures of full-distribution divergence and MoE routing flips.

``data`` is a :func:`~trace_replay.analysis.distributions.replay_pair` frame (exact form: one
column per metric) or a :func:`~trace_replay.analysis.distribution_bounds.distribution_bounds`
frame (bounded form: ``<metric>_lower`` and ``<metric>_upper``); a bounded frame is drawn as
its band, the lower bound as the line. Each function draws on ``ax`` or on a new figure,
returns the Axes and never shows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from trace_replay.analysis.routing import flip_matrix
from trace_replay.plots._figures import MARK, finish, own_axes

__all__ = [
    "plot_distribution_hist",
    "plot_distribution_strip",
    "plot_first_past",
    "plot_routing_flips",
]

_FLOOR = 1e-12  # log axes: a zero is drawn here


def _values(data: pd.DataFrame, metric: str) -> tuple[pd.Series, pd.Series | None, str]:
    """The metric's values (exact, or the lower bound), its upper bound (bounded form) and
    the word for the form."""
    if metric in data.columns:
        return data[metric].astype(float), None, "exact"
    if f"{metric}_lower" not in data.columns:
        raise ValueError(
            f"no {metric!r} column (exact) nor {metric}_lower (bounded) in the "
            "frame: pass a replay_pair or distribution_bounds frame"
        )
    return data[f"{metric}_lower"].astype(float), data[f"{metric}_upper"].astype(float), "bounded"


def plot_distribution_strip(
    data: pd.DataFrame, trace_id: str, *, metric: str = "kl_ab", ax: Axes | None = None
) -> Axes:
    """One trace's per-token divergence against its step, on a log axis, to stack under
    :func:`~trace_replay.plots.trace.plot_trace`'s logprob strip (same x: the step).

    Examples
    --------
    >>> import pandas as pd
    >>> df = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "kl_ab": [0.0, 1e-4, 2e-3]})
    >>> plot_distribution_strip(df, "t").get_yscale()
    'log'
    """
    rows = data[data["trace_id"] == trace_id].sort_values("step")
    if rows.empty:
        raise ValueError(f"no rows of trace {trace_id!r}")
    ax = own_axes(ax, (8, 2.2))
    value, upper, form = _values(rows, metric)
    steps = rows["step"].to_numpy()
    ax.plot(
        steps,
        value.clip(lower=_FLOOR),
        lw=1,
        color="C0",
        label=f"{metric} ({'lower bound' if upper is not None else form})",
    )
    if upper is not None:
        top = upper.replace(np.inf, np.nan).fillna(1.0).clip(lower=_FLOOR)
        ax.fill_between(
            steps, value.clip(lower=_FLOOR), top, color="C0", alpha=0.2, step="mid", label="bounds"
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{trace_id}: {metric} per token ({form})")
    ax.legend(loc="upper right", fontsize="small")
    return finish(ax)


def plot_distribution_hist(
    data: pd.DataFrame, *, metric: str = "kl_ab", ax: Axes | None = None, bins: int = 40
) -> Axes:
    """The metric over every token of the frame (a dataset): histogram of log10 values,
    zeros counted in the leftmost bin."""
    ax = own_axes(ax, (6, 3.5))
    value, upper, form = _values(data, metric)
    logs = np.log10(value.clip(lower=_FLOOR))
    ax.hist(logs, bins=bins, color="C0", alpha=0.8)
    which = "lower bound" if upper is not None else form
    ax.set_xlabel(f"log10 {metric} ({which})")
    ax.set_ylabel("tokens")
    ax.set_title(
        f"{metric} over {len(data)} tokens; mean {value.mean():.3g}, p99 {value.quantile(0.99):.3g}"
    )
    return finish(ax)


def plot_first_past(
    data: pd.DataFrame, *, metric: str = "kl_ab", tol: float = 1e-3, ax: Axes | None = None
) -> Axes:
    """Per trace, the first step whose metric exceeds ``tol`` (a bounded frame: whose lower
    bound does, so the step surely diverges); traces that never do are marked at their end."""
    ax = own_axes(ax, (6, 0.3 * data["trace_id"].nunique() + 1.5))
    value, _, form = _values(data, metric)
    frame = data.assign(_v=value.to_numpy())
    order = list(pd.unique(frame["trace_id"]))
    first, ends = [], []
    for trace_id in order:
        rows = frame[frame["trace_id"] == trace_id]
        past = rows.loc[rows["_v"] > tol, "step"]
        first.append(past.min() if len(past) else np.nan)
        ends.append(rows["step"].max())
    y = np.arange(len(order))
    ax.barh(y, np.nan_to_num(first, nan=0), color="C1", label=f"first step {metric} > {tol:g}")
    never = np.isnan(first)
    ax.scatter(
        np.array(ends)[never], y[never], marker="|", color=MARK, s=80, label="never (trace end)"
    )
    ax.set_yticks(y, order)
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_title(f"first token past {metric} = {tol:g} ({form})")
    ax.legend(loc="lower right", fontsize="small")
    return finish(ax)


def plot_routing_flips(
    routing_a: pd.DataFrame, routing_b: pd.DataFrame, trace_id: str, *, ax: Axes | None = None
) -> Axes:
    """Layers by steps of one trace: dark where the two runs routed the token to different
    experts (:func:`~trace_replay.analysis.routing.flip_matrix`)."""
    matrix = flip_matrix(routing_a, routing_b, trace_id)
    ax = own_axes(ax, (8, 0.25 * len(matrix) + 1.5))
    ax.imshow(
        matrix.to_numpy(),
        aspect="auto",
        cmap="Greys",
        vmin=0,
        vmax=1,
        interpolation="nearest",
        origin="lower",
        extent=(-0.5, matrix.shape[1] - 0.5, -0.5, matrix.shape[0] - 0.5),
    )
    ax.set_yticks(range(len(matrix)), matrix.index)
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title(
        f"{trace_id}: routing flips ({int(matrix.to_numpy().sum())} of {matrix.size} step x layer)"
    )
    return finish(ax)
