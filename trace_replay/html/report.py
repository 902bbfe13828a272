"""Self-contained HTML report of one replay or of two compared replays.

Figures are embedded as base64 PNG, styles are inline; the page loads nothing from
elsewhere. Every string that comes from data (token text, trace ids, attrs, the title) is
escaped.
"""

from __future__ import annotations

import base64
import html
import io
import os
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from trace_replay._io import write_atomic, write_target
from trace_replay.analysis.metrics import (
    compare,
    dataset_summary,
    rank_bucket_transitions,
    summarize,
    trace_summary,
)
from trace_replay.html.tokens import render_tokens
from trace_replay.plots._figures import run_label
from trace_replay.plots.frames import (
    plot_delta_hist,
    plot_divergence_heatmap,
    plot_first_divergence,
    plot_logprob_scatter,
    plot_rank_buckets,
    plot_trace,
)
from trace_replay.runs.frame import check_frame
from trace_replay.runs.result_file import check_scores, read_result
from trace_replay.wording import plural

__all__ = ["write_report"]

_MAX_TABLE_ROWS = 50
_CSS = """<style>
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1200px;
 color:#222;padding:0 16px}
h1{font-size:22px}
h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
.tr-wide{max-width:100%;overflow-x:auto}
table.tr-table{border-collapse:collapse;font-size:12px;margin:8px 0}
table.tr-table td,table.tr-table th{padding:2px 6px;border-bottom:1px solid #eee;text-align:right}
table.tr-table th{background:#f5f5f5;overflow-wrap:anywhere;vertical-align:bottom}
.tr-figs{display:flex;flex-wrap:wrap;gap:12px} img{max-width:100%;height:auto}
.tr-note{color:#666;font-size:12px}
.tr-warn{color:#a40000;font-weight:600}
</style>"""


def _load(x: pd.DataFrame | str | os.PathLike, side: str) -> tuple[pd.DataFrame, str | None]:
    """The frame and, for a file, its stem (the name the user gave the run).

    A file passes every check ``merge`` runs on it
    (:func:`~trace_replay.runs.result_file.read_result`); a frame in memory, which may be a
    slice of a result on purpose, needs the replay columns and possible scores. Either is
    refused naming the side (and the file) and what is wrong.
    """
    if isinstance(x, pd.DataFrame):
        check_frame(x, side)
        check_scores(x, side)
        return x, None
    return read_result(x, f"{side}:"), Path(x).stem


def _partial_notes(sides: list[tuple[str, dict]]) -> list[str]:
    """One line per side that holds part of a run: an incomplete merge (its missing shards
    named) or a single shard, so a partial result never reads as the whole."""
    notes = []
    for label, attrs in sides:
        if attrs.get("complete") is False:
            missing = ", ".join(f"{i}/{n}" for i, n in attrs.get("missing_shards") or [])
            notes.append(
                f"{label} is incomplete: shard {missing or '?'} missing; its numbers "
                "cover only the shards merged"
            )
        elif attrs.get("shard") and not isinstance(attrs["shard"][0], (list, tuple)):
            index, count = attrs["shard"]
            notes.append(f"{label} is shard {index}/{count} of a run, not the whole of it")
    return notes


def _table(df: pd.DataFrame, *, index: bool = False) -> str:
    """The frame as an HTML table that fits the page: long headers wrap, and a table still
    wider than the page scrolls inside its own box."""
    table = df.to_html(
        index=index,
        escape=True,
        border=0,
        classes="tr-table",
        na_rep="—",
        float_format=lambda v: f"{v:.4g}",
    )
    return f'<div class="tr-wide">{table}</div>'


def _head(df: pd.DataFrame) -> str:
    note = ""
    if len(df) > _MAX_TABLE_ROWS:
        note = f'<p class="tr-note">first {_MAX_TABLE_ROWS} of {len(df)} rows</p>'
    return _table(df.head(_MAX_TABLE_ROWS)) + note


def _attrs_table(attrs: dict, label: str) -> str:
    rows = pd.DataFrame({"key": list(attrs), "value": [str(v) for v in attrs.values()]})
    return f"<h3>{html.escape(label)}</h3>" + (_table(rows) if len(rows) else "<p>no attrs</p>")


def _figure(draw: Callable[[Axes], object], alt: str, size: tuple[float, float] = (6, 4)) -> str:
    """One figure drawn by ``draw(ax)``, as an <img> holding a base64 PNG."""
    fig = Figure(figsize=size, layout="constrained")
    draw(fig.add_subplot())
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _comparison_sections(cmp: pd.DataFrame, tol: float) -> list[str]:
    label_a, label_b = cmp.attrs["labels"]
    summary = summarize(cmp, tol=tol)
    n = len(summary)
    heat_size = (11.0, min(2.0 + 0.2 * n, 14.0))
    figures = [
        _figure(lambda ax: plot_delta_hist(cmp, ax=ax), "delta histogram"),
        _figure(lambda ax: plot_logprob_scatter(cmp, ax=ax, tol=tol), "logprob scatter"),
        _figure(lambda ax: plot_first_divergence(summary, ax=ax), "first divergence CDF"),
        _figure(lambda ax: plot_rank_buckets(cmp, ax=ax), "rank buckets"),
    ]
    worst = summary.sort_values("max_abs_delta", ascending=False, kind="stable")
    return [
        "<h2>Dataset</h2>",
        '<div class="tr-figs">',
        _table(dataset_summary(cmp)),
        f"<div><h3>Rank-bucket transitions (rows: {html.escape(label_a)}, "
        f"columns: {html.escape(label_b)})</h3>",
        _table(rank_bucket_transitions(cmp), index=True),
        "</div></div>",
        f"<h2>Traces</h2><p class='tr-note'>sorted by max |Δ|, tol = {tol:g}</p>",
        _head(worst),
        "<h2>Figures</h2>",
        _figure(lambda ax: plot_divergence_heatmap(cmp, tol=tol, ax=ax), "heatmap", heat_size),
        f'<div class="tr-figs">{"".join(figures)}</div>',
    ]


def _bounds(df_a: pd.DataFrame, df_b: pd.DataFrame, cmp: pd.DataFrame) -> pd.DataFrame | None:
    """The bounded divergences of two frames that both recorded their tail mass, else None."""
    from trace_replay.analysis.distribution_bounds import distribution_bounds

    if not all("tail_logmass" in f and f["tail_logmass"].notna().all() for f in (df_a, df_b)):
        return None
    keep = cmp[["trace_id", "step"]]
    return distribution_bounds(
        df_a.merge(keep, on=["trace_id", "step"]),
        df_b.merge(keep, on=["trace_id", "step"]),
        labels=cmp.attrs["labels"],
    )


def _distribution_sections(dist: pd.DataFrame, tol: float) -> list[str]:
    """Full-distribution divergence: a table of means and p99s, the KL and TV histograms and
    the first token past ``tol`` in KL, saying which form (exact or bounded) each is."""
    from trace_replay.plots.distributions import plot_distribution_hist, plot_first_past

    form = dist.attrs.get("distribution_form", "exact")
    rows = []
    for metric in ("kl_ab", "kl_ba", "tv", "js"):
        for column in [metric] if form == "exact" else [f"{metric}_lower", f"{metric}_upper"]:
            values = dist[column].astype(float)
            rows.append(
                {
                    "column": column,
                    "mean": values.mean(),
                    "p99": values.quantile(0.99, interpolation="higher"),  # inf-safe
                    "max": values.max(),
                }
            )
    note = (
        "exact: from both engines' full logits (a paired replay)"
        if form == "exact"
        else "bounded: from each run's top-k and tail mass; the exact value lies between "
        "_lower and _upper (KL's upper bound is infinite)"
    )
    return [
        f"<h2>Full distributions ({form})</h2><p class='tr-note'>{html.escape(note)}</p>",
        _table(pd.DataFrame(rows)),
        _figure(lambda ax: plot_distribution_hist(dist, metric="kl_ab", ax=ax), "KL hist"),
        _figure(lambda ax: plot_distribution_hist(dist, metric="tv", ax=ax), "TV hist"),
        _figure(
            lambda ax: plot_first_past(dist, metric="kl_ab", tol=tol, ax=ax),
            "first token past tol in KL",
        ),
    ]


def _trace_sections(frame: pd.DataFrame, trace_ids: list, color_by: str, tol: float) -> list[str]:
    parts = ["<h2>Worst traces</h2>"]
    for trace_id in trace_ids:
        parts.append(f"<h3>trace {html.escape(str(trace_id))}</h3>")
        draw = lambda ax, t=trace_id: plot_trace(frame, t, ax=ax, tol=tol)  # noqa: E731
        parts.append(_figure(draw, f"trace {trace_id}", (11.0, 3.6)))
        parts.append(render_tokens(frame, trace_id, color_by, tol=tol).html)
    return parts


def write_report(
    a: pd.DataFrame | str | os.PathLike,
    b: pd.DataFrame | str | os.PathLike | None = None,
    *,
    out: str | os.PathLike = "report.html",
    tol: float = 1e-3,
    n_traces: int = 5,
    title: str | None = None,
    drop_mismatched: bool = False,
    distributions: pd.DataFrame | None = None,
) -> Path:
    """Write a self-contained HTML report of a replay, or of two replays compared.

    With ``b``: dataset summary, rank-bucket transitions, per-trace summary, heatmap, Δ
    histogram, logprob scatter, first-divergence CDF, rank buckets, and the ``n_traces``
    traces with the largest max |Δ| (plot and tokens coloured by Δ). Without ``b``: per-trace
    summary, rank buckets and the ``n_traces`` traces with the lowest mean logprob (tokens
    coloured by rank), plus the comparison sections against the trace's ``ref_logprob`` when
    the frame has that column.

    Parameters
    ----------
    a, b : DataFrame or path
        Replay frames, or paths to Parquet files holding them; a is the behaviour run
        (rollout), b the target (trainer). Each side is named by its file's stem, else by
        the attrs that tell the runs apart (:func:`~trace_replay.compare`).
    out : path
        Where to write the page: a new path or a regular file (a link is written through),
        not one of the inputs; checked before any work.
    tol : float
        Divergence threshold on ``abs_delta``.
    n_traces : int
        Number of worst traces drawn and rendered token by token.
    title : str, optional
        Page title; by default names the run(s), "b vs a" for a comparison.
    drop_mismatched : bool
        Leave out traces whose prompt or trace tokens differ between a and b (the page and
        a warning say how many) instead of refusing them (:func:`~trace_replay.compare`).
    distributions : DataFrame, optional
        A :func:`~trace_replay.replay_pair` frame of the same traces (exact full-distribution
        divergence). Without it, a comparison of two frames that recorded their tail mass
        gets the bounded form (:func:`~trace_replay.distribution_bounds`).

    Returns
    -------
    pathlib.Path
        The written file.

    Examples
    --------
    >>> import tempfile
    >>> a = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                   "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> out = Path(tempfile.mkdtemp()) / "a_vs_b.html"
    >>> write_report(a, a.assign(logprob=[-0.5, -1.25, -2.0]), out=out) == out
    True
    >>> "<h2>Provenance</h2>" in out.read_text()
    True
    """
    write_target(out, [x for x in (a, b) if isinstance(x, (str, os.PathLike))])
    df_a, name_a = _load(a, "a")
    parts: list[str] = []
    if b is not None:
        df_b, name_b = _load(b, "b")
        named = name_a is not None and name_b is not None and name_a != name_b
        cmp = compare(
            df_a, df_b, labels=(name_a, name_b) if named else None, drop_mismatched=drop_mismatched
        )
        labels = cmp.attrs["labels"]
        if cmp.attrs.get("left_out"):
            left_out = cmp.attrs["left_out"]
            parts.append(
                f"<p class='tr-warn'>left out {plural(len(left_out), 'trace')} whose "
                f"prompt or trace tokens differ between the runs: "
                f"{html.escape(', '.join(map(repr, left_out[:20])))}"
                f"{' …' if len(left_out) > 20 else ''}</p>"
            )
        title = title or f"trace replay: {labels[1]} vs {labels[0]}"
        sides = [(f"a: {labels[0]}", df_a.attrs), (f"b: {labels[1]}", df_b.attrs)]
        parts += _comparison_sections(cmp, tol)
        dist = distributions if distributions is not None else _bounds(df_a, df_b, cmp)
        if dist is not None:
            parts += _distribution_sections(dist, tol)
        worst = summarize(cmp, tol=tol).nlargest(n_traces, "max_abs_delta", keep="first")
        parts += _trace_sections(cmp, worst["trace_id"].tolist(), "delta", tol)
    else:
        label_a = name_a or run_label(df_a.attrs) or "replay"
        title = title or f"trace replay: {label_a}"
        sides = [(label_a, df_a.attrs)]
        summary = trace_summary(df_a)
        parts += [
            "<h2>Traces</h2><p class='tr-note'>sorted by mean logprob</p>",
            _head(summary.sort_values("mean_logprob", kind="stable")),
            _figure(lambda ax: plot_rank_buckets(df_a, ax=ax), "rank buckets"),
        ]
        if "ref_logprob" in df_a.columns and df_a["ref_logprob"].notna().any():
            parts.append("<h2>Replay vs the trace's recorded logprobs</h2>")
            parts += _comparison_sections(compare(df_a, "ref"), tol)
        worst = summary.nsmallest(n_traces, "mean_logprob", keep="first")
        parts += _trace_sections(df_a, worst["trace_id"].tolist(), "rank", tol)

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    partial = _partial_notes(sides)
    for note in partial:
        warnings.warn(f"report: {note}", stacklevel=2)
    provenance = "".join(_attrs_table(dict(attrs), label) for label, attrs in sides)
    page = "\n".join(
        [
            '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>{_CSS}</head><body>",
            f"<h1>{html.escape(title)}</h1><p class='tr-note'>generated {stamp}</p>",
            *(f"<p class='tr-warn'>{html.escape(note)}</p>" for note in partial),
            *parts,
            f"<h2>Provenance</h2>{provenance}",
            "</body></html>",
        ]
    )
    path = Path(out)
    write_atomic(path, lambda temporary: temporary.write_text(page, encoding="utf-8"))
    return path
