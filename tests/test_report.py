"""Tests for trace_replay.report: one self-contained, escaped HTML page."""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from trace_replay.report import write_report  # noqa: E402

EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


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
    for text in ("trace replay: vllm bfloat16 vs hf float32", "Dataset", "mean_abs_delta",
                 "first_divergence_step", "chi2_token", "frac_bit_mismatch",
                 "Rank-bucket transitions (rows: hf float32, columns: vllm bfloat16)",
                 "Worst traces", "Provenance"):  # fmt: skip
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
    path = write_report(tmp_path / "fp32.parquet", str(tmp_path / "bf16.parquet"),
                        out=tmp_path / "r.html", n_traces=1)  # fmt: skip
    assert "trace replay: bf16 vs fp32" in path.read_text(encoding="utf-8")
