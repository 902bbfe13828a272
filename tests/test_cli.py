"""The trace-replay command line: results on disk, one-line errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from trace_replay.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "trace_replay.cli", *args],
                          capture_output=True, text=True)


def test_bad_trace_file_is_one_line_error(tmp_path):
    """A malformed JSONL line gives one error line naming file and line, exit 2, no traceback."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "completion": "y"}\n{not json\n')
    out = _run("replay", str(path), "--engine", "prefill", "--out", str(tmp_path / "r.parquet"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"{path}:2" in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.slow
def test_replay_then_merge_and_report(tmp_path):
    """replay writes Parquet with provenance; shards merge; report writes HTML."""
    traces = tmp_path / "t.jsonl"
    traces.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "The capital of France is", "completion": " Paris."},
        {"id": "b", "prompt": "1, 2, 3,", "completion": " 4, 5"},
        {"id": "c", "prompt": "Hello", "completion": " world"}]) + "\n")
    outs = []
    for i in range(2):
        out = tmp_path / f"s{i}.parquet"
        assert main(["replay", str(traces), "--engine", "prefill", "--shard", f"{i}/2",
                     "--out", str(out), "--quiet"]) == 0
        outs.append(out)
    merged = tmp_path / "all.parquet"
    assert main(["merge", *map(str, outs), "--out", str(merged)]) == 0
    df = pd.read_parquet(merged)
    assert sorted(df["trace_id"].unique()) == ["a", "b", "c"]
    assert df.attrs.get("engine") == "prefill"
    assert main(["report", str(merged), "--out", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").read_text().lower().startswith("<!doctype html>")
