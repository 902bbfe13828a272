"""Tests for trace_replay.html.tokens: escaping, data-step spans, highlight, tooltips."""

from __future__ import annotations

import os
import re
import stat
from html.parser import HTMLParser

import pandas as pd
import pytest

from trace_replay.analysis.metrics import compare
from trace_replay.html.tokens import TokenHTML, render_tokens, visible_token


class SpanCollector(HTMLParser):
    """Attributes and text of each token span, as a browser would parse them."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict] = []
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            raise AssertionError("a <script> element was parsed")
        if tag == "span" and "data-step" in attrs:
            self.spans.append({**attrs, "text": ""})
            self._depth = 1
        elif tag == "span" and self._depth:
            self._depth += 1

    def handle_endtag(self, tag):
        if tag == "span" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._depth:
            self.spans[-1]["text"] += data


def spans(html: str) -> list[dict]:
    parser = SpanCollector()
    parser.feed(html)
    return parser.spans


def tiny(tokens: list[str], ranks: list[int] | None = None) -> pd.DataFrame:
    n = len(tokens)
    return pd.DataFrame(
        {
            "trace_id": "t",
            "step": range(n),
            "position": range(3, 3 + n),
            "token_id": range(100, 100 + n),
            "token": tokens,
            "logprob": [-0.5 * (i + 1) for i in range(n)],
            "rank": ranks or [1] * n,
            "top_token_ids": [[100 + i, 7] for i in range(n)],
            "top_logprobs": [[-0.5 * (i + 1), -9.0] for i in range(n)],
        }
    )


def test_script_token_renders_as_text():
    """A token '<script>alert(1)</script>' is escaped: no element, the text survives."""
    out = render_tokens(tiny(["a", "<script>alert(1)</script>"]), "t")
    assert "<script>" not in out.html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out.html
    assert spans(out.html)[1]["text"] == "<script>alert(1)</script>"


def test_quotes_cannot_break_out_of_the_tooltip_attribute():
    """A token with quotes and an event handler stays inside the title attribute."""
    evil = '" onmouseover="alert(1)'
    (span,) = spans(render_tokens(tiny([evil]), "t").html)
    assert "onmouseover" not in span and visible_token(evil) in span["title"]


def test_one_span_per_step_with_data_step(replay_df):
    """Every token is a span with data-step, in step order."""
    found = spans(render_tokens(replay_df, "t1").html)
    assert [int(s["data-step"]) for s in found] == list(range(40))


def test_highlight_step_outlines_exactly_one_token(replay_df):
    """highlight_step puts tr-highlight on that step's span only."""
    html = render_tokens(replay_df, "t0", highlight_step=12).html
    marked = [s for s in spans(html) if "tr-highlight" in s["class"].split()]
    assert [s["data-step"] for s in marked] == ["12"]
    plain = spans(render_tokens(replay_df, "t0").html)
    assert not [s for s in plain if "tr-highlight" in s["class"]]


def test_whitespace_is_visible():
    """Spaces show as ·, tabs as →, newlines as ↵ followed by a real line break."""
    html = render_tokens(tiny([" a", "\t", "b\nc", ""]), "t").html
    texts = [s["text"] for s in spans(html)]
    assert texts == ["·a", "→", "b↵c", "∅"]
    assert "↵</span><br>" in html


def test_visible_token_marks():
    """visible_token maps whitespace to marks and empty text to ∅."""
    assert visible_token(" x\t\r\n") == "·x→␍↵" and visible_token("") == "∅"


def test_rank_colours_follow_gltr_buckets():
    """Rank 1 green, 50 yellow, 500 red, 5000 purple."""
    found = spans(render_tokens(tiny(list("abcd"), [1, 50, 500, 5000]), "t").html)
    colours = [re.search(r"background:(#\w+)", s["style"]).group(1) for s in found]
    assert colours == ["#b8e6b8", "#fbe99a", "#f7b3ae", "#dcc6f2"]


def test_tooltip_lists_step_id_logprob_rank_and_alternatives():
    """The title holds step, token id, logprob, rank and top-k (ids when not decoded)."""
    (span, _) = spans(render_tokens(tiny(["x", "y"], [1, 2]), "t").html)
    title = span["title"]
    assert "step 0" in title and "token id 100" in title
    assert "logprob -0.5000 · rank 1" in title and "#100 -0.500 | #7 -9.000" in title


def test_tooltip_decodes_alternatives_when_top_tokens_present():
    """With top_tokens, alternatives are shown as quoted text."""
    df = tiny(["x"]).assign(top_tokens=[["x", "<b>"]])
    (span,) = spans(render_tokens(df, "t").html)
    assert "'x' -0.500 | '<b>' -9.000" in span["title"]


def test_delta_colouring_of_a_comparison(replay_pair):
    """color_by="delta": agreeing tokens white, the legend names both runs."""
    a, b = replay_pair
    html = render_tokens(compare(a, b, labels=("hf", "vllm")), "t0", "delta").html
    assert {s["style"] for s in spans(html)} == {"background:#ffffff"}
    assert "vllm − hf" in html


def test_delta_colouring_uses_ref_logprob(replay_df):
    """A single replay with ref_logprob is coloured by replay − ref; tooltips show both."""
    found = spans(render_tokens(replay_df, "t0", "delta").html)
    assert "ref: logprob" in found[0]["title"] and "replay: logprob" in found[0]["title"]


def test_delta_colouring_needs_a_second_side():
    """Without a comparison or ref_logprob, delta colouring is an error."""
    with pytest.raises(ValueError, match="ref_logprob"):
        render_tokens(tiny(["a"]), "t", "delta")


def test_logprob_colouring_ramps_green_to_red():
    """color_by="logprob": near 0 green, -10 or less red; a legend ramp is drawn."""
    df = tiny(["a", "b"]).assign(logprob=[0.0, -12.0])
    html = render_tokens(df, "t", "logprob").html
    assert [s["style"] for s in spans(html)] == ["background:#b8e6b8", "background:#f7b3ae"]
    assert "tr-ramp" in html


def test_unknown_colouring_and_trace_rejected(replay_df):
    """Bad color_by is a ValueError; an unknown trace a KeyError."""
    with pytest.raises(ValueError, match="color_by"):
        render_tokens(replay_df, "t0", "entropy")
    with pytest.raises(KeyError):
        render_tokens(replay_df, "missing")


def test_token_html_displays_and_saves(tmp_path, replay_df):
    """_repr_html_ is the fragment; save writes a standalone UTF-8 page."""
    out = render_tokens(replay_df, "t2")
    assert isinstance(out, TokenHTML) and out._repr_html_() == out.html == str(out)
    path = out.save(tmp_path / "t2.html")
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and out.html in page and 'charset="utf-8"' in page
    assert "<script" not in page and "http" not in page


def test_save_refuses_a_fifo_and_writes_through_a_link(tmp_path, replay_df):
    """save never replaces what its path names: a FIFO is refused (not opened, so nothing
    blocks) and stays a FIFO; a symlink stays a link and its target gets the page."""
    out = render_tokens(replay_df, "t2")
    fifo = tmp_path / "pipe.html"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a plain write would not block then
    try:
        with pytest.raises(ValueError, match="FIFO"):
            out.save(fifo)
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target, link = tmp_path / "page.html", tmp_path / "link.html"
    target.write_text("old")
    link.symlink_to(target)
    out.save(link)
    assert link.is_symlink() and out.html in target.read_text(encoding="utf-8")


def test_a_lower_bound_rank_is_shown_as_a_bound():
    """A rank the server only bounds (rank 21, rank_exact False: past its 20 alternatives)
    shows as ">20" in the tooltip and takes the bound bucket's colour, not 11-100's "rank
    21"; an exact rank beside it keeps its own; in a comparison each side says its own."""
    df = tiny([" a", " b", " c"], [21, 21, 1]).assign(rank_exact=[False, True, True])
    got = spans(render_tokens(df, "t").html)
    assert "rank >20" in got[0]["title"] and "rank 21" not in got[0]["title"]
    assert "rank 21" in got[1]["title"]
    colours = [re.search(r"background:(#\w+)", s["style"]).group(1) for s in got]
    assert colours[0] != colours[1] and colours[0] not in (colours[2], "#e6e6e6")
    assert ">bound</span>" in render_tokens(df, "t").html  # the legend names its swatch
    exact = df.drop(columns="rank_exact")
    cmp = spans(render_tokens(compare(exact, df), "t").html)
    assert "a: logprob -0.5000 · rank 21" in cmp[0]["title"]
    assert "b: logprob -0.5000 · rank >20" in cmp[0]["title"]
    assert re.search(r"background:(#\w+)", cmp[0]["style"]).group(1) == colours[0]
