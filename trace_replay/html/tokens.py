"""GLTR-style coloured token strips as self-contained HTML (inline CSS, no scripts).

Every piece of token text passes through :func:`html.escape`; tooltips are ``title``
attributes, so the strip needs no JavaScript and renders the same in Jupyter, a saved file
or the HTML report.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from trace_replay._io import write_atomic
from trace_replay.analysis.metrics import compare, rank_bucket
from trace_replay.analysis.ranks import exact_ranks, rank_label
from trace_replay.wording import WHITESPACE_MARKS, plural, visible_token

__all__ = ["TokenHTML", "render_tokens"]

_BUCKET_BG = {
    "1-10": "#b8e6b8",
    "11-100": "#fbe99a",
    "101-1000": "#f7b3ae",
    ">1000": "#dcc6f2",
    "bound": "#b9d3ee",
}
_UNKNOWN_BG = "#e6e6e6"
_NONFINITE_BG = "#555555"
_LOGPROB_FLOOR = -10.0
_CSS = """<style>
.tr-tokens-view{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px;
 line-height:2;color:#111;background:#fff;padding:4px}
.tr-tokens-view .tr-tok{border-radius:3px;padding:1px 0;margin-right:1px}
.tr-tokens-view .tr-tok:hover{outline:1px solid #444}
.tr-tokens-view .tr-ws{color:#8a8a8a}
.tr-tokens-view .tr-nonfinite{color:#fff}
.tr-tokens-view .tr-highlight{outline:2px solid #d62728;outline-offset:1px}
.tr-tokens-view .tr-legend{font-family:sans-serif;font-size:11px;color:#444;line-height:1.6}
.tr-tokens-view .tr-swatch{padding:0 6px;margin-right:4px;border-radius:3px}
.tr-tokens-view .tr-ramp{display:inline-block;width:110px;height:10px;margin:0 4px;
 vertical-align:middle;border:1px solid #ccc}
</style>"""


@dataclass(frozen=True)
class TokenHTML:
    """An HTML fragment that Jupyter displays inline; ``.html`` is the markup itself."""

    html: str

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html

    def save(self, path: str | Path) -> Path:
        """Write a standalone UTF-8 page holding the fragment and return its path.

        Written atomically through :func:`~trace_replay._io.write_atomic`: a symlink is
        written through, a device, FIFO or folder is refused and left as it was.
        """
        path = Path(path)
        head = '<!doctype html>\n<html><head><meta charset="utf-8"></head><body>'
        page = f"{head}{self.html}</body></html>\n"
        write_atomic(path, lambda temporary: temporary.write_text(page, encoding="utf-8"))
        return path


def _token_markup(token: str) -> str:
    if not token:
        return '<span class="tr-ws">∅</span>'
    parts = []
    for ch in str(token):
        mark = WHITESPACE_MARKS.get(ch)
        if mark is None:
            parts.append(html.escape(ch))
        else:
            parts.append(f'<span class="tr-ws">{mark}</span>' + ("<br>" if ch == "\n" else ""))
    return "".join(parts)


def _mix(stops: list[str], t: float) -> str:
    """Colour at ``t`` in [0, 1] along evenly spaced hex colour ``stops``."""
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    lo, hi = (np.array([int(c[k : k + 2], 16) for k in (1, 3, 5)]) for c in stops[i : i + 2])
    r, g, b = np.round(lo + (hi - lo) * (t - i)).astype(int)
    return f"#{r:02x}{g:02x}{b:02x}"


_LOGPROB_STOPS = [_BUCKET_BG["1-10"], _BUCKET_BG["11-100"], _BUCKET_BG["101-1000"]]
_DELTA_STOPS = ["#e06666", "#ffffff", "#6fa8dc"]


def _background(value: float, color_by: str, tol: float) -> str:
    if color_by == "rank":
        return _BUCKET_BG.get(value, _UNKNOWN_BG)
    if math.isnan(value):
        return _NONFINITE_BG if color_by == "delta" else _UNKNOWN_BG
    if color_by == "logprob":
        return _mix(_LOGPROB_STOPS, value / _LOGPROB_FLOOR) if value > -math.inf else _NONFINITE_BG
    if not math.isfinite(value):
        return _NONFINITE_BG
    size = abs(value)
    strength = 0.0 if size <= tol else min(1.0, math.log(size / tol) / math.log(1.0 / tol))
    return _mix(_DELTA_STOPS, 0.5 + math.copysign(strength / 2, value))


def _legend(color_by: str, tol: float, labels: tuple[str, str] | None) -> str:
    if color_by == "rank":
        swatches = "".join(
            f'<span class="tr-swatch" style="background:{bg}">{html.escape(name)}</span>'
            for name, bg in _BUCKET_BG.items()
        )
        return f"rank bucket: {swatches}"
    if color_by == "logprob":
        ramp = ",".join(_LOGPROB_STOPS)
        return (
            f'logprob: 0<span class="tr-ramp" style="background:linear-gradient(90deg,{ramp})">'
            f"</span>≤ {_LOGPROB_FLOOR:g} nats"
        )
    ramp = ",".join(_DELTA_STOPS)
    sides = html.escape(f"{labels[1]} − {labels[0]}") if labels else "b − a"
    return (
        f'Δ logprob ({sides}): ≤ −1<span class="tr-ramp" style="background:linear-gradient'
        f'(90deg,{ramp})"></span>≥ +1 · white: |Δ| ≤ {tol:g} · '
        f'<span class="tr-swatch tr-nonfinite" style="background:{_NONFINITE_BG}">non-finite</span>'
    )


def _listed(row: pd.Series, column: str) -> list | None:
    """A list cell as a list; None when the column is absent or the cell missing."""
    value = row.get(column)
    return list(value) if value is not None and hasattr(value, "__len__") else None


def _alternatives(row: pd.Series, suffix: str, limit: int = 10) -> str:
    ids = _listed(row, f"top_token_ids{suffix}") or []
    logprobs = _listed(row, f"top_logprobs{suffix}")
    names = _listed(row, f"top_tokens{suffix}")
    shown = []
    for i, token_id in enumerate(ids[:limit]):
        name = repr(names[i]) if names else f"#{token_id}"
        shown.append(name + (f" {logprobs[i]:.3f}" if logprobs else ""))
    return " | ".join(shown)


def _tooltip(row: pd.Series, comparison: bool, labels: tuple[str, str] | None) -> str:
    token = visible_token(row.get("token", ""))
    lines = [f"step {row['step']} · token id {row['token_id']} · {token}"]
    sides = [("a", labels[0]), ("b", labels[1])] if comparison else [("", None)]
    for side, label in sides:
        suffix = f"_{side}" if side else ""
        rank = row.get(f"rank{suffix}")
        rank_text = rank_label(rank, row.get(f"rank_exact{suffix}", True))
        prefix = f"{label}: " if label else ""
        lines.append(f"{prefix}logprob {float(row[f'logprob{suffix}']):.4f} · rank {rank_text}")
        top = _alternatives(row, suffix)
        if top:
            lines.append(f"{prefix}top: {top}")
    if comparison:
        lines.append(f"Δ {float(row['delta']):+.3g}")
    elif "ref_logprob" in row and pd.notna(row["ref_logprob"]):
        lines.append(f"ref logprob {float(row['ref_logprob']):.4f}")
    if "entropy" in row and pd.notna(row["entropy"]):
        lines.append(f"entropy {float(row['entropy']):.3f} nats")
    return "\n".join(lines)


def render_tokens(
    df: pd.DataFrame,
    trace_id: str,
    color_by: str = "rank",
    *,
    highlight_step: int | None = None,
    tol: float = 1e-3,
) -> TokenHTML:
    """Coloured, hoverable token strip of one trace.

    Parameters
    ----------
    df : DataFrame
        Replay frame or comparison frame. A comparison colours by side b (rank falls back to
        side a when b's is unknown) and shows both sides in tooltips.
    trace_id : str
        Trace to render.
    color_by : {"rank", "delta", "logprob"}
        GLTR rank buckets (green ranks 1-10, yellow 11-100, red 101-1000, purple >1000),
        Δlogprob on a log scale from ``tol`` (white) to 1 nat (red below, blue above; needs a
        comparison frame or a ``ref_logprob`` column), or logprob from 0 (green) to -10 (red).
    highlight_step : int, optional
        Step whose token gets an outline and the CSS class ``tr-highlight``.
    tol : float
        |Δ| at or below which a token stays white under ``color_by="delta"``.

    Returns
    -------
    TokenHTML
        ``.html`` holds the fragment; every token is a ``<span data-step="N">`` with a
        ``title`` tooltip (step, token id, logprob, rank, top-k alternatives).

    Examples
    --------
    >>> df = pd.DataFrame({"trace_id": "t", "step": [0, 1], "token_id": [11, 12],
    ...                    "token": [" Paris", "."], "logprob": [-0.2, -3.5], "rank": [1, 40],
    ...                    "ref_logprob": [-0.2, -3.0]})
    >>> strip = render_tokens(df, "t", highlight_step=1)
    >>> strip.html.count("data-step="), 'class="tr-tok tr-highlight" data-step="1"' in strip.html
    (2, True)
    >>> "Δ" in render_tokens(df, "t", "delta").html  # against the trace's own ref_logprob
    True
    """
    if color_by not in ("rank", "delta", "logprob"):
        raise ValueError(f'color_by must be "rank", "delta" or "logprob", got {color_by!r}')
    comparison = "logprob_a" in df.columns
    if color_by == "delta" and not comparison and "ref_logprob" not in df.columns:
        raise ValueError('color_by="delta" needs a comparison frame or a ref_logprob column')
    rows = df[df["trace_id"] == trace_id]
    if rows.empty:
        raise KeyError(f"trace {trace_id!r} not in the frame")
    rows.attrs = dict(df.attrs)
    if color_by == "delta" and not comparison:
        rows, comparison = compare(rows, "ref"), True
    labels = tuple(rows.attrs.get("labels", ("a", "b"))) if comparison else None
    rows = rows.sort_values("step")

    if color_by == "rank":
        if comparison:  # side b's rank, or side a's where b has none
            on_b = rows["rank_b"].notna()
            rank = rows["rank_b"].fillna(rows["rank_a"])
            exact = exact_ranks(rows, "_b").where(on_b, exact_ranks(rows, "_a"))
        else:
            rank, exact = rows["rank"], exact_ranks(rows)
        values = rank_bucket(rank, exact).astype(object).tolist()
    elif color_by == "delta":
        values = rows["delta"].to_numpy(dtype="float64").tolist()
    else:
        values = rows["logprob_b" if comparison else "logprob"].to_numpy(dtype="float64").tolist()

    spans = []
    for value, (_, row) in zip(values, rows.iterrows(), strict=True):
        step = int(row["step"])
        bg = _background(value, color_by, tol)
        classes = "tr-tok" + (" tr-nonfinite" if bg == _NONFINITE_BG else "")
        classes += " tr-highlight" if step == highlight_step else ""
        title = html.escape(_tooltip(row, comparison, labels), quote=True)
        text = _token_markup(row["token"] if "token" in row else f"#{row['token_id']}")
        spans.append(
            f'<span class="{classes}" data-step="{step}" style="background:{bg}" '
            f'title="{title}">{text}</span>'
        )
    header = (
        f"trace <b>{html.escape(str(trace_id))}</b> · {plural(len(rows), 'token')} · "
        f"{_legend(color_by, tol, labels)}"
    )
    body = "<wbr>".join(spans)
    return TokenHTML(
        f'{_CSS}<div class="tr-tokens-view"><div class="tr-legend">{header}</div>'
        f'<div class="tr-strip">{body}</div></div>'
    )
