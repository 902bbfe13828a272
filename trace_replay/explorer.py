"""Interactive notebook explorer of a replay or comparison frame (ipywidgets).

ipywidgets is imported inside :func:`explore` only, so ``import trace_replay.explorer``
works without the notebook extra.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from trace_replay.analysis.metrics import summarize, trace_summary
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
    plot_output, topk_html``; ``widget`` is the top-level VBox and ``figure`` the persistent
    matplotlib figure shown in ``plot_output``.
    """

    def __init__(self, df: pd.DataFrame, widgets, *, tol: float = 1e-3) -> None:
        from matplotlib.figure import Figure

        self.df, self.tol = df, tol
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
        self.figure = Figure(figsize=(10, 3.6), layout="constrained")

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
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.trace_dropdown, self.sort_by, self.divergent_only]),
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
        self.topk_html.value = f'{_TABLE_CSS}<div style="display:flex">{tables}</div>'

    def _draw(self, trace: pd.DataFrame, trace_id: str, step: int) -> None:
        import io

        from IPython import get_ipython
        from IPython.display import Image, display

        from trace_replay.plots.frames import plot_trace

        steps = trace["step"]
        window = None
        if steps.max() - steps.min() + 1 > 2 * _WINDOW:
            window = (step - _WINDOW // 2, step + _WINDOW // 2)
        self.figure.clear()
        ax = self.figure.add_subplot()
        plot_trace(trace, trace_id, ax=ax, window=window, tol=self.tol)
        ax.axvline(step, color="#d62728", lw=1.5, label="selected step")
        if get_ipython() is None:  # no frontend to show it; the figure itself is up to date
            return
        # a bare Figure has a PNG form only once pyplot's inline backend is active
        png = io.BytesIO()
        self.figure.savefig(png, format="png")
        with self.plot_output:
            self.plot_output.clear_output(wait=True)
            display(Image(data=png.getvalue(), format="png"))


def explore(df_or_cmp: pd.DataFrame, *, tol: float = 1e-3) -> Explorer:
    """Notebook explorer of a replay frame or a comparison frame.

    Parameters
    ----------
    df_or_cmp : DataFrame
        A replay frame (tokens coloured by rank, "divergent" = has a rank > 1 step) or the
        output of :func:`~trace_replay.compare` (coloured by Δ, "divergent" = has a first
        divergence at ``tol``).
    tol : float
        Divergence threshold on ``abs_delta``.

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
    return Explorer(df_or_cmp, widgets, tol=tol)
