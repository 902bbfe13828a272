"""Interactive notebook explorer of a replay or comparison frame (ipywidgets).

With full-distribution divergences (a :func:`~trace_replay.replay_pair` or
:func:`~trace_replay.distribution_bounds` frame) the logprob strip gets the per-token
divergence strip under it, on the same steps; with two MoE routing records
(:func:`~trace_replay.analysis.routing.record_routing`), the layers x steps routing flips.
ipywidgets is imported inside :func:`explore` only, so ``import trace_replay.explorer``
works without the notebook extra.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from trace_replay.analysis.distributions import METRICS
from trace_replay.analysis.metrics import compare, summarize, trace_summary
from trace_replay.analysis.ranks import rank_label
from trace_replay.html.tokens import render_tokens
from trace_replay.wording import visible_token

__all__ = ["Explorer", "explore"]

_WINDOW = 80  # steps drawn around the selected one when a trace is longer than 2 windows
_TABLE_CSS = (
    "<style>.tr-topk-table{border-collapse:collapse;font-size:12px;margin-right:12px}"
    ".tr-topk-table td,.tr-topk-table th{padding:1px 6px;text-align:left}"
    ".tr-topk-table .tr-trace-token{background:#fde2a8}"
    ".tr-topk-table caption{text-align:left;font-weight:bold}</style>"
)


def _topk_table(row: pd.Series, suffix: str, label: str) -> str:
    """HTML table of one side's top-k at one step; the trace token's row is highlighted."""
    ids = row.get(f"top_token_ids{suffix}")
    ids = list(ids) if ids is not None and hasattr(ids, "__len__") else []
    logprobs = row.get(f"top_logprobs{suffix}")
    names = row.get(f"top_tokens{suffix}")
    rank = row.get(f"rank{suffix}")
    rank_text = rank_label(rank, row.get(f"rank_exact{suffix}", True))
    lines = [
        f"<caption>{html.escape(label)}: trace token {html.escape(repr(row.get('token', '')))} "
        f"(id {int(row['token_id'])}) · logprob {float(row[f'logprob{suffix}']):.4f} · "
        f"rank {rank_text}</caption>",
        "<tr><th>rank</th><th>token</th><th>id</th><th>logprob</th><th>p</th></tr>",
    ]
    if not ids:
        lines.append('<tr><td colspan="5">no top-k recorded</td></tr>')
    for i, token_id in enumerate(ids):
        name = names[i] if names is not None and hasattr(names, "__len__") else f"#{token_id}"
        logprob = float(logprobs[i]) if logprobs is not None else np.nan
        mark = ' class="tr-trace-token"' if int(token_id) == int(row["token_id"]) else ""
        choice = " (model's choice)" if i == 0 else ""
        lines.append(
            f"<tr{mark}><td>{i + 1}{choice}</td><td><code>{html.escape(visible_token(name))}"
            f"</code></td><td>{int(token_id)}</td><td>{logprob:.4f}</td>"
            f"<td>{np.exp(logprob):.3f}</td></tr>"
        )
    return f'<table class="tr-topk-table">{"".join(lines)}</table>'


class Explorer:
    """Widgets for browsing one frame: pick a trace and a step, see tokens, plot and top-k.

    The design contract: every view is a pure function of (trace, step), recomputed by
    :meth:`refresh`; widget observers only call it. Attribute names are stable for tests and
    notebooks: ``trace_dropdown, sort_by, divergent_only, step_slider, tokens_html,
    plot_output, topk_html``, and ``metric`` (the divergence drawn, with distributions);
    ``widget`` is the top-level VBox and ``figure`` the persistent matplotlib figure shown in
    ``plot_output``, its axes the logprob strip, then the divergence strip, then the
    routing flips (those present).
    """

    def __init__(
        self,
        df: pd.DataFrame,
        widgets,
        *,
        tol: float = 1e-3,
        distributions: pd.DataFrame | None = None,
        routing: tuple[pd.DataFrame, pd.DataFrame] | None = None,
    ) -> None:
        from matplotlib.figure import Figure

        if distributions is None and _divergence_form(df) is not None:
            df, distributions = _comparison_of(df), df
        if distributions is not None and _divergence_form(distributions) is None:
            raise ValueError(
                "distributions has no kl_ab (exact) nor kl_ab_lower (bounded) column: "
                "pass a replay_pair or distribution_bounds frame"
            )
        if routing is not None and len(routing) != 2:
            raise ValueError("routing takes the two sides' record_routing frames: (a, b)")
        self.df, self.tol, self.distributions, self.routing = df, tol, distributions, routing
        self._traces = {}  # trace_id -> its rows, sorted by step, carrying df.attrs
        for trace_id, part in df.groupby("trace_id", sort=False):
            part = part.sort_values("step")
            part.attrs = dict(df.attrs)
            self._traces[trace_id] = part
        self.comparison = "logprob_a" in df.columns
        if self.comparison:
            summary = summarize(df, tol=tol)
            self.first_off = summary.set_index("trace_id")["first_divergence_step"]
            self.color_by = "delta"
        else:
            summary = trace_summary(df)
            self.first_off = summary.set_index("trace_id")["first_off_top1_step"]
            self.color_by = "rank"
        self.summary = summary
        extra = (distributions is not None) + (routing is not None)
        self.figure = Figure(figsize=(10, 3.6 + 2.2 * extra), layout="constrained")

        self.trace_dropdown = widgets.Dropdown(description="trace")
        self.sort_by = widgets.Dropdown(
            options=["trace order", "first divergence"], value="trace order", description="sort"
        )
        self.divergent_only = widgets.Checkbox(value=False, description="only divergent traces")
        self.step_slider = widgets.IntSlider(
            description="step", min=0, max=0, continuous_update=False
        )
        self.tokens_html = widgets.HTML()
        self.plot_output = widgets.Output()
        self.topk_html = widgets.HTML()
        self.tokens_html.add_class("tr-tokens")
        self.topk_html.add_class("tr-topk")
        self.step_slider.add_class("tr-step")
        self.trace_dropdown.add_class("tr-trace")
        self.metric = widgets.Dropdown(options=list(METRICS), value="kl_ab", description="metric")
        self.metric.add_class("tr-metric")
        controls = [self.trace_dropdown, self.sort_by, self.divergent_only]
        self.widget = widgets.VBox(
            [
                widgets.HBox(controls + ([self.metric] if distributions is not None else [])),
                self.step_slider,
                self.tokens_html,
                self.plot_output,
                self.topk_html,
            ]
        )

        self._busy = False
        self._update_options()
        self.trace_dropdown.observe(self._on_trace, names="value")
        self.step_slider.observe(lambda _: self.refresh(), names="value")
        self.sort_by.observe(lambda _: self._update_options(), names="value")
        self.divergent_only.observe(lambda _: self._update_options(), names="value")
        self.metric.observe(lambda _: self.refresh(), names="value")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    @property
    def trace_id(self) -> str | None:
        """The selected trace, or None when the filter leaves no trace."""
        return self.trace_dropdown.value

    def _update_options(self) -> None:
        """Fill the dropdown from the filter and sort controls, keeping the selection if shown."""
        summary = self.summary
        first = summary["first_divergence_step" if self.comparison else "first_off_top1_step"]
        if self.divergent_only.value:
            summary = summary[first.notna()]
        if self.sort_by.value == "first divergence":
            summary = summary.assign(_first=first.astype("float64")).sort_values(
                "_first", na_position="last", kind="stable"
            )
        kind = "diverges" if self.comparison else "off top-1"
        options = []
        first_steps = self.first_off.reindex(summary["trace_id"]).tolist()
        rows = zip(summary["trace_id"], summary["n_tokens"], first_steps, strict=True)
        for trace_id, n, step in rows:
            note = f"{kind} @ {step}" if pd.notna(step) else "never"
            options.append((f"{trace_id} ({n} tok, {note})", trace_id))
        previous = self.trace_dropdown.value
        self._busy = True
        self.trace_dropdown.options = options
        values = [value for _, value in options]
        self.trace_dropdown.value = previous if previous in values else (values or [None])[0]
        self._busy = False
        self._on_trace(None)

    def _on_trace(self, _change) -> None:
        if self._busy:
            return
        trace_id = self.trace_id
        if trace_id is not None:
            steps = self._traces[trace_id]["step"]
            start = self.first_off.get(trace_id)
            low, high = int(steps.min()), int(steps.max())
            self._busy = True
            if low > self.step_slider.max:  # keep min <= max at every assignment
                self.step_slider.max, self.step_slider.min = high, low
            else:
                self.step_slider.min, self.step_slider.max = low, high
            self.step_slider.value = int(start) if pd.notna(start) else low
            self._busy = False
        self.refresh()

    def refresh(self) -> None:
        """Redraw the token strip, the plot and the top-k table for the current selection."""
        if self._busy:
            return
        trace_id, step = self.trace_id, self.step_slider.value
        if trace_id is None:
            self.tokens_html.value = "<i>no trace matches the filter</i>"
            self.topk_html.value = ""
            self.figure.clear()
            return
        trace = self._traces[trace_id]
        self.tokens_html.value = render_tokens(
            trace, trace_id, self.color_by, highlight_step=step, tol=self.tol
        ).html
        self._draw(trace, trace_id, step)
        rows = trace[trace["step"] == step]
        if rows.empty:
            self.topk_html.value = f"<i>no step {step} in trace {html.escape(str(trace_id))}</i>"
            return
        row = rows.iloc[0]
        if self.comparison:
            label_a, label_b = self.df.attrs.get("labels", ("a", "b"))
            tables = _topk_table(row, "_a", label_a) + _topk_table(row, "_b", label_b)
            tables += f"<div>Δ logprob {float(row['delta']):+.4g}</div>"
        else:
            tables = _topk_table(row, "", "replay")
        notes = self._step_notes(trace_id, step)
        self.topk_html.value = f'{_TABLE_CSS}<div style="display:flex">{tables}</div>{notes}'

    def _step_notes(self, trace_id: str, step: int) -> str:
        """The step's divergences and routed-differently layers, as HTML lines."""
        lines = []
        if self.distributions is not None:
            dist = self.distributions
            rows = dist[(dist["trace_id"] == trace_id) & (dist["step"] == step)]
            if len(rows):
                row = rows.iloc[0]
                parts = [
                    f"{name} {float(row[name]):.3g}"
                    if name in row
                    else f"{name} in [{float(row[f'{name}_lower']):.3g}, "
                    f"{float(row[f'{name}_upper']):.3g}]"
                    for name in METRICS
                ]
                form = _divergence_form(dist)
                lines.append(f"full distributions ({form}): " + " · ".join(parts))
        if self.routing is not None:
            flips = self._flips(trace_id)
            if flips is not None and step in flips.columns:
                layers = [int(layer) for layer in flips.index[flips[step].to_numpy()]]
                lines.append(f"routing flips at this step: layers {layers or 'none'}")
        return "".join(f'<div class="tr-step-notes">{html.escape(x)}</div>' for x in lines)

    def _flips(self, trace_id: str) -> pd.DataFrame | None:
        """Layers x steps flips of ``trace_id`` (None when either record lacks the trace)."""
        from trace_replay.analysis.routing import flip_matrix

        a, b = self.routing
        if not ((a["trace_id"] == trace_id).any() and (b["trace_id"] == trace_id).any()):
            return None
        return flip_matrix(a, b, trace_id)

    def _draw(self, trace: pd.DataFrame, trace_id: str, step: int) -> None:
        import io

        from IPython import get_ipython
        from IPython.display import Image, display

        from trace_replay.plots.distributions import (
            plot_distribution_strip,
            plot_routing_flips,
        )
        from trace_replay.plots.frames import plot_trace

        steps = trace["step"]
        window = None
        if steps.max() - steps.min() + 1 > 2 * _WINDOW:
            window = (step - _WINDOW // 2, step + _WINDOW // 2)
        self.figure.clear()
        count = 1 + (self.distributions is not None) + (self.routing is not None)
        axes = list(
            self.figure.subplots(count, 1, squeeze=False, height_ratios=[2] + [1] * (count - 1))[
                :, 0
            ]
        )
        ax = axes[0]
        plot_trace(trace, trace_id, ax=ax, window=window, tol=self.tol)
        below = iter(axes[1:])
        if self.distributions is not None:
            plot_distribution_strip(
                self.distributions, trace_id, metric=self.metric.value, ax=next(below)
            )
        if self.routing is not None:
            routed = next(below)
            if self._flips(trace_id) is None:
                routed.text(0.5, 0.5, f"no routing recorded for {trace_id}", ha="center")
            else:
                plot_routing_flips(*self.routing, trace_id, ax=routed)
        for other in axes[1:]:  # the same steps under the logprob strip
            other.set_xlim(ax.get_xlim())
        for each in axes:
            each.axvline(step, color="#d62728", lw=1.5, label="selected step")
        if get_ipython() is None:  # no frontend to show it; the figure itself is up to date
            return
        # a bare Figure has a PNG form only once pyplot's inline backend is active
        png = io.BytesIO()
        self.figure.savefig(png, format="png")
        with self.plot_output:
            self.plot_output.clear_output(wait=True)
            display(Image(data=png.getvalue(), format="png"))


def explore(
    df_or_cmp: pd.DataFrame,
    *,
    tol: float = 1e-3,
    distributions: pd.DataFrame | None = None,
    routing: tuple[pd.DataFrame, pd.DataFrame] | None = None,
) -> Explorer:
    """Notebook explorer of a replay frame or a comparison frame.

    Parameters
    ----------
    df_or_cmp : DataFrame
        A replay frame (tokens coloured by rank, "divergent" = has a rank > 1 step), the
        output of :func:`~trace_replay.compare` (coloured by Δ, "divergent" = has a first
        divergence at ``tol``), or a :func:`~trace_replay.replay_pair` or
        :func:`~trace_replay.distribution_bounds` frame (explored as the comparison of its
        two logprob columns, with its divergences).
    tol : float
        Divergence threshold on ``abs_delta``.
    distributions : DataFrame, optional
        Full-distribution divergences of the same traces (a ``replay_pair`` or
        ``distribution_bounds`` frame): a per-token strip of ``metric`` (bounded: its band)
        under the logprob strip, and the step's values under the top-k tables.
    routing : (DataFrame, DataFrame), optional
        The two sides' :func:`~trace_replay.analysis.routing.record_routing` frames: the
        trace's layers x steps routing flips, and the step's flipped layers.

    Returns
    -------
    Explorer
        Displays itself in Jupyter; its widgets are attributes (``step_slider`` ...).

    Raises
    ------
    ImportError
        When ipywidgets is not installed.

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> ex = explore(compare(a, a.assign(logprob=[-0.5, -1.25, -2.0])))
    >>> ex.step_slider.max
    2
    >>> ex.step_slider.value = 1  # selects step 1: the plot, the token strip and the tables follow
    """
    try:
        import ipywidgets as widgets
    except ImportError as err:
        raise ImportError(
            "explore() needs ipywidgets: pip install 'trace-replay[notebook]'"
        ) from err
    return Explorer(df_or_cmp, widgets, tol=tol, distributions=distributions, routing=routing)


def _divergence_form(frame: pd.DataFrame) -> str | None:
    """``"exact"`` or ``"bounded"`` for a frame of per-token divergences, else None."""
    if "kl_ab" in frame.columns:
        return "exact"
    return "bounded" if "kl_ab_lower" in frame.columns else None


def _comparison_of(pair: pd.DataFrame) -> pd.DataFrame:
    """The comparison of a divergence frame's two logprob columns (ranks unknown: NA)."""
    key = pair[["trace_id", "step", "token_id"]]
    unknown = pd.array([pd.NA] * len(pair), dtype="Int64")
    sides = []
    for side in ("a", "b"):
        frame = key.assign(logprob=pair[f"logprob_{side}"].to_numpy(), rank=unknown)
        frame.attrs = dict(pair.attrs.get(f"attrs_{side}", {}))
        sides.append(frame)
    return compare(*sides, labels=pair.attrs.get("labels"))
