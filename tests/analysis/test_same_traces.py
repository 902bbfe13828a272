"""Tests for trace_replay.analysis.same_traces: two runs' traces are paired by id only where
both scored the same prompt and trace tokens; the rest is refused, or left out on request."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest

from trace_replay.analysis.metrics import compare, summarize
from trace_replay.analysis.same_traces import TracesDiffer, TracesLeftOut, mismatched_traces
from trace_replay.cli import main


def _other_prompt(frame: pd.DataFrame, trace_id: str, longer_by: int) -> pd.DataFrame:
    """``frame`` with ``trace_id``'s prompt ``longer_by`` tokens longer (positions move)."""
    moved = frame.copy()
    moved.loc[moved["trace_id"] == trace_id, "position"] += longer_by
    moved.attrs = dict(frame.attrs)
    return moved


def test_compare_refuses_a_trace_id_holding_another_prompt(replay_pair):
    """Same trace ids and trace tokens, another prompt (positions 10… vs 19…): compare
    refuses it naming the trace, instead of reporting the scores' differences as a
    divergence (it gave max |delta| of another prompt's scores, exit 0)."""
    a, b = replay_pair
    with pytest.raises(
        TracesDiffer,
        match=r"1 trace \('t1'\) holds other prompt or trace "
        r"tokens in a \(hf float32\) than in b",
    ) as error:
        compare(a, _other_prompt(b, "t1", 9))
    assert error.value.trace_ids == ["t1"] and isinstance(error.value, ValueError)


def test_drop_mismatched_leaves_them_out_and_says_how_many(replay_pair):
    """drop_mismatched=True compares the other traces, warns "left out 1 of 3 traces" and
    records the ids in attrs["left_out"]."""
    a, b = replay_pair
    with pytest.warns(TracesLeftOut, match="left out 1 of 3 traces: 1 trace"):
        cmp = compare(a, _other_prompt(b, "t1", 9), drop_mismatched=True)
    assert cmp["trace_id"].unique().tolist() == ["t0", "t2"]
    assert cmp.attrs["left_out"] == ["t1"]
    assert summarize(cmp)["trace_id"].tolist() == ["t0", "t2"]


def test_the_digest_decides_where_both_runs_carry_one(replay_pair):
    """With tokens_digest on both sides a prompt of the same length with other tokens is
    told apart (the token columns cannot), and a trace of another length is one mismatch,
    not a (trace, step) error."""
    a, b = replay_pair
    digest = {"t0": "00", "t1": "11", "t2": "22"}
    a = a.assign(tokens_digest=a["trace_id"].map(digest))
    same = b.assign(tokens_digest=b["trace_id"].map(digest))
    assert mismatched_traces(a, same) == []
    other = b.assign(tokens_digest=b["trace_id"].map({**digest, "t2": "99"}))
    assert mismatched_traces(a, other) == ["t2"]
    shorter = same[~((same["trace_id"] == "t0") & (same["step"] == 39))]
    shorter = shorter.assign(tokens_digest=shorter["trace_id"].map({**digest, "t0": "0x"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TracesLeftOut)
        assert compare(a, shorter, drop_mismatched=True).attrs["left_out"] == ["t0"]


def test_frames_without_a_digest_are_paired_by_their_token_columns(replay_pair):
    """Frames written before the digest: equal token ids and positions pair (in any row
    order); another token at one step is a mismatch of that trace."""
    a, b = replay_pair
    assert mismatched_traces(a, b.iloc[::-1]) == []
    edited = b.copy()
    edited.loc[(edited["trace_id"] == "t2") & (edited["step"] == 3), "token_id"] += 1
    assert mismatched_traces(a, edited) == ["t2"]


def test_report_refuses_mismatched_results_unless_asked(replay_pair, tmp_path, capsys):
    """trace-replay report A B exits 2 naming the trace whose tokens differ; with
    --drop-mismatched it writes the page, warning how many traces it left out."""
    a, b = replay_pair
    a.to_parquet(tmp_path / "a.parquet")
    _other_prompt(b, "t1", 9).to_parquet(tmp_path / "b.parquet")
    args = [
        "report",
        str(tmp_path / "a.parquet"),
        str(tmp_path / "b.parquet"),
        "--out",
        str(tmp_path / "r.html"),
    ]
    assert main(args) == 2
    assert "1 trace ('t1') holds other prompt or trace tokens" in capsys.readouterr().err
    assert main([*args, "--drop-mismatched"]) == 0
    err = capsys.readouterr().err
    assert "warning: left out 1 of 3 traces" in err
    page = (tmp_path / "r.html").read_text()
    assert "left out 1 trace whose prompt or trace tokens differ" in page
