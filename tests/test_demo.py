"""Tests for trace_replay.demo: the bundled traces through an engine, to files."""

from __future__ import annotations

import matplotlib
import pandas as pd
import pytest

from trace_replay.demo import run_demo

pytestmark = pytest.mark.slow


def test_demo_writes_results_and_figure(tmp_path, capsys):
    """One engine over the first trace of each bundled file: a Parquet result with the
    engine's provenance, the figure, a per-engine table; the matplotlib backend is the
    caller's (library code does not switch it)."""
    matplotlib.use("pdf")  # any backend but Agg, the one the CLI picks
    try:
        results = run_demo(out=tmp_path / "out", engines="prefill", limit=1)
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use("Agg")
    df = pd.read_parquet(tmp_path / "out" / "results_prefill.parquet")
    assert df["trace_id"].unique().tolist() == results["prefill"]["trace_id"].unique().tolist()
    assert df["trace_id"].nunique() == 4 and df.attrs["engine"] == "prefill"
    assert (tmp_path / "out" / "demo.png").stat().st_size > 0
    assert "Per engine:" in capsys.readouterr().out


def test_demo_refuses_a_folder_among_its_files_before_any_replay(tmp_path, capsys):
    """A folder (like a device or a FIFO) where the demo would write a result is refused
    before the first replay (nothing printed, nothing written) and left as it is."""
    out = tmp_path / "out"
    (out / "results_prefill.parquet").mkdir(parents=True)
    with pytest.raises(ValueError, match="results_prefill.parquet is a folder, not a regular"):
        run_demo(out=out, engines="torch,prefill", limit=1)
    assert capsys.readouterr().out == ""
    assert [p.name for p in out.iterdir()] == ["results_prefill.parquet"]
    assert list((out / "results_prefill.parquet").iterdir()) == []


@pytest.mark.parametrize(
    "engines, problem",
    [
        ("prefill,bogus", "unknown engine 'bogus'"),
        ("prefill,prefill", "'prefill' is named twice"),
        ("prefill,vllm-server", "vllm-server needs a server's base_url"),
        (" , ", "name at least one engine"),
    ],
)
def test_demo_checks_every_engine_name_before_any_replay(tmp_path, capsys, engines, problem):
    """An unknown, repeated or option-needing engine anywhere in the list is refused before
    the first replay: nothing printed, nothing written."""
    with pytest.raises(ValueError, match=problem):
        run_demo(out=tmp_path / "out", engines=engines, limit=1)
    assert capsys.readouterr().out == "" and not (tmp_path / "out").exists()
