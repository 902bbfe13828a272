"""Tests for trace_replay.html.report: one self-contained, escaped HTML page."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pandas as pd
import pytest

from trace_replay.html.report import write_report

EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def frames(make_replay, make_pair):
    a, b = make_pair(make_replay(n_traces=3, n_steps=24, seed=0))
    a.attrs = {**a.attrs, "model": EVIL}
    return a, b


@pytest.fixture(scope="module")
def comparison_page(frames, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("report") / "cmp.html"
    path = write_report(*frames, out=out, n_traces=2)
    assert path == out
    return path.read_text(encoding="utf-8")


def external_refs(page: str) -> list[str]:
    return re.findall(r'(?:src|href)\s*=\s*"(?!data:)[^"]*"', page) + re.findall(r"url\(", page)


def test_comparison_report_is_self_contained(comparison_page):
    """Figures are base64 PNGs and nothing is loaded from elsewhere."""
    assert comparison_page.startswith("<!doctype html>")
    assert comparison_page.count('src="data:image/png;base64,') == 5 + 2
    assert external_refs(comparison_page) == []


def test_comparison_report_sections(comparison_page):
    """Summary tables, transitions, figures and the worst traces' tokens are all there."""
    for text in (
        "trace replay: vllm bfloat16 vs hf float32",
        "Dataset",
        "mean_abs_delta",
        "first_divergence_step",
        "chi2_token",
        "frac_bit_mismatch",
        "Rank-bucket transitions (rows: hf float32, columns: vllm bfloat16)",
        "Worst traces",
        "Provenance",
    ):
        assert text in comparison_page
    assert comparison_page.count('class="tr-tokens-view"') == 2


def test_comparison_report_worst_traces_by_max_abs_delta(comparison_page):
    """The token strips are those of the traces with the largest max |delta| (not t0)."""
    shown = re.findall(r"<h3>trace (\w+)</h3>", comparison_page)
    assert sorted(shown) == ["t1", "t2"]


def test_report_escapes_tokens_and_attrs(comparison_page):
    """Token text and attrs are escaped: no <script> element, no injected <img>."""
    assert "<script" not in comparison_page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in comparison_page
    assert EVIL not in comparison_page and "&lt;img src=x onerror=alert(1)&gt;" in comparison_page


def test_single_replay_report(tmp_path, make_replay):
    """Without b: trace_summary, rank buckets, ref comparison, lowest-logprob traces by rank."""
    df = make_replay(n_traces=2, n_steps=16, seed=3)
    page = write_report(df, out=tmp_path / "one.html", n_traces=1, title="<b>run</b>").read_text()
    assert "<title>&lt;b&gt;run&lt;/b&gt;</title>" in page and "<b>run</b>" not in page
    assert "mean_logprob" in page and "recorded logprobs" in page
    worst = df.groupby("trace_id").logprob.mean().idxmin()
    assert re.findall(r"<h3>trace (\w+)</h3>", page) == [worst]
    assert "rank bucket:" in page and external_refs(page) == []


def test_report_reads_parquet_paths(tmp_path, frames):
    """a and b may be Parquet paths; the file stems label the runs."""
    pytest.importorskip("pyarrow")
    a, b = frames
    a.to_parquet(tmp_path / "fp32.parquet")
    b.to_parquet(tmp_path / "bf16.parquet")
    path = write_report(
        tmp_path / "fp32.parquet",
        str(tmp_path / "bf16.parquet"),
        out=tmp_path / "r.html",
        n_traces=1,
    )
    assert "trace replay: bf16 vs fp32" in path.read_text(encoding="utf-8")


def test_report_refuses_a_parquet_that_is_not_a_result(tmp_path, frames):
    """A Parquet file without the replay columns is refused naming the side, the file and the
    columns it lacks (not a bare KeyError)."""
    pytest.importorskip("pyarrow")
    other = tmp_path / "other.parquet"
    pd.DataFrame({"trace_id": ["t"], "score": [0.5]}).to_parquet(other)
    frames[0].to_parquet(tmp_path / "a.parquet")
    lacks = r"lacks replay columns \['step', 'token_id', 'logprob', 'rank'\]"
    with pytest.raises(
        ValueError,
        match=rf"^a: {re.escape(str(other))} is not a replay result "
        rf"file: it {lacks}",
    ):
        write_report(other, out=tmp_path / "r.html")
    with pytest.raises(ValueError, match=rf"^b: {re.escape(str(other))} .*{lacks}"):
        write_report(tmp_path / "a.parquet", other, out=tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_report_tables_wrap_their_headers_and_scroll_in_their_box(comparison_page):
    """Every table sits in a box as wide as the page at most that scrolls what still does not
    fit, and header names wrap, so no table widens the page."""
    css = re.search(r"<style>(.*?)</style>", comparison_page, re.S).group(1)
    assert re.search(r"\.tr-wide\{max-width:100%;overflow-x:auto\}", css)
    assert re.search(r"table\.tr-table th\{[^}]*overflow-wrap:anywhere", css)
    tables = comparison_page.count("<table")
    assert tables >= 4 and comparison_page.count('<div class="tr-wide"><table') == tables


_MEASURE = """<script>window.onload = () => {
  const body = document.body, style = getComputedStyle(body);
  const right = body.getBoundingClientRect().right - parseFloat(style.paddingRight);
  const tables = [...document.querySelectorAll("table")].map(t => t.getBoundingClientRect().right);
  document.title = JSON.stringify({right, tables, page: document.documentElement.scrollWidth,
                                   window: window.innerWidth});
};</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
@pytest.mark.parametrize("width", [1280, 700])
def test_report_tables_fit_the_page_in_a_browser(comparison_page, tmp_path, width):
    """Rendered by Chromium at a desktop and a narrow width, no table reaches past the page's
    text column and the page itself never scrolls sideways."""
    page = tmp_path / "measured.html"
    page.write_text(comparison_page.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            f"--window-size={width},900",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    found = json.loads(html.unescape(re.search(r"<title>(.*?)</title>", dom).group(1)))
    assert found["page"] <= found["window"], found
    if width >= 1280:  # wide enough for every table once its headers wrap
        assert max(found["tables"]) <= found["right"] + 0.5, found


@pytest.mark.parametrize(
    "column, value, problem",
    [
        ("logprob", float("nan"), r"logprob nan is impossible"),
        ("logprob", 0.5, r"logprob 0.5 is impossible"),
        ("rank", 0, r"rank 0 is impossible"),
        ("logprob", "text", r"column 'logprob' holds \w+ values, not numbers"),
    ],
)
def test_report_refuses_impossible_scores(tmp_path, frames, column, value, problem):
    """A result file whose scores no replay writes (NaN or positive logprob, rank 0, text
    where numbers belong) is refused naming the file, trace and step, not reported as a run;
    nothing is written."""
    damaged = frames[0].copy()
    if isinstance(value, str):  # the whole column as text
        damaged[column] = damaged[column].astype(str)
    else:
        damaged.loc[damaged.index[5], column] = value
    damaged.to_parquet(tmp_path / "damaged.parquet")
    step = "" if isinstance(value, str) else ": trace 't0', step 5: "
    with pytest.raises(ValueError, match=rf"^a: .*damaged\.parquet{step}.*{problem}"):
        write_report(tmp_path / "damaged.parquet", out=tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("logprob, vocab_size", [(-20.0, 49152), (float("-inf"), None)])
def test_report_refuses_a_rank_1_logprob_no_distribution_gives(
    tmp_path, frames, logprob, vocab_size
):
    """Rank 1 is the most likely of V tokens, so its logprob is at least -log(V) (the
    vocabulary size the result's attrs record) and never -inf (-9999 from a server), whatever
    V: such a file is refused naming the trace and step, not reported."""
    damaged = frames[0].copy()
    damaged.loc[damaged.index[5], ["rank", "logprob"]] = [1, logprob]
    damaged.attrs = {**damaged.attrs, "vocab_size": vocab_size}
    damaged.to_parquet(tmp_path / "damaged.parquet")
    with pytest.raises(
        ValueError,
        match=r"trace 't0', step 5: rank 1 is impossible: rank 1 is "
        "the most likely token",
    ):
        write_report(tmp_path / "damaged.parquet", out=tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_a_partial_result_is_marked_at_the_top(tmp_path, frames):
    """An incomplete merge (attrs complete False) is said so at the top of the page, naming
    its missing shards, and with a warning; so is a single shard; a whole run is not."""
    partial = frames[0].copy()
    partial.attrs = {
        **frames[0].attrs,
        "complete": False,
        "missing_shards": [[2, 3]],
        "shard": [[0, 3], [1, 3]],
    }
    with pytest.warns(UserWarning, match="incomplete: shard 2/3 missing"):
        page = write_report(partial, out=tmp_path / "p.html").read_text(encoding="utf-8")
    head = page.split("<h2>", 1)[0]
    assert "class='tr-warn'" in head and "shard 2/3 missing" in head
    shard = frames[0].copy()
    shard.attrs = {**frames[0].attrs, "shard": [1, 3]}
    with pytest.warns(UserWarning, match="is shard 1/3 of a run"):
        write_report(shard, out=tmp_path / "s.html")
    whole = write_report(frames[0], out=tmp_path / "w.html").read_text(encoding="utf-8")
    assert "tr-warn'" not in whole


def test_comparison_report_has_bounded_distributions_when_tails_were_recorded(frames, tmp_path):
    """Two frames with their tail mass get a 'Full distributions (bounded)' section (table
    and three figures); an exact replay_pair frame passed in is shown as exact."""
    import numpy as np

    from trace_replay.engines.distributions import tail_from_top

    a, b = (
        f.assign(tail_logmass=tail_from_top(np.stack(f["top_logprobs"].map(np.asarray))))
        for f in frames
    )
    page = write_report(a, b, out=tmp_path / "d.html", n_traces=2).read_text(encoding="utf-8")
    assert "Full distributions (bounded)" in page and "kl_ab_lower" in page
    assert page.count('src="data:image/png;base64,') == 5 + 2 + 3
    exact = a[["trace_id", "step"]].assign(kl_ab=1e-4, kl_ba=1e-4, tv=1e-2, js=1e-5)
    exact.attrs = {"distribution_form": "exact"}
    page = write_report(
        *frames, out=tmp_path / "e.html", n_traces=2, distributions=exact
    ).read_text(encoding="utf-8")
    assert "Full distributions (exact)" in page
