"""Tests for trace_replay.runs.result_file: the checks merge and report both run on a file."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from trace_replay.html.report import write_report
from trace_replay.runs.merge import merge_results
from trace_replay.runs.result_file import read_result


@pytest.fixture
def result(make_replay, tmp_path):
    """A whole run of two traces of six steps, with the attrs replay writes."""
    frame = make_replay(n_traces=2, n_steps=6, seed=4).drop(columns="ref_logprob")
    frame.attrs = {
        **frame.attrs,
        "settings_keys": ["engine", "top_k", "weights_digest"],
        "weights_digest": "d" * 32,
        "num_traces": 2,
        "num_tokens": 12,
        "shard": None,
    }
    return frame


def _rows(frame: pd.DataFrame, trace_id: str, step: int) -> pd.Series:
    return (frame["trace_id"] == trace_id) & (frame["step"] == step)


TAMPERED = {  # edit of the file -> what the error names (trace, step, field)
    "positive logprob": (
        lambda f: f.assign(logprob=f["logprob"].mask(_rows(f, "t1", 3), 0.5)),
        "trace 't1', step 3: logprob 0.5 is impossible",
    ),
    "rank 0": (
        lambda f: f.assign(rank=f["rank"].mask(_rows(f, "t0", 2), 0)),
        "trace 't0', step 2: rank 0 is impossible",
    ),
    "middle step deleted": (
        lambda f: f[~_rows(f, "t0", 3)],
        "trace 't0', step 4: steps are not 0, 1, 2",
    ),
    "last step deleted": (
        lambda f: f[~_rows(f, "t1", 5)],
        "records 12 rows (num_tokens) but holds 11 rows",
    ),
    "short top-k list": (
        lambda f: f.assign(
            top_logprobs=[lp[:4] if i == 7 else lp for i, lp in enumerate(f["top_logprobs"])]
        ),
        "trace 't1', step 1: top-k lists of the wrong length",
    ),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_merge_and_report_refuse_a_tampered_file_alike(result, tmp_path, case):
    """A result file edited after replay is refused by merge and by report with the same
    message, naming the file, the trace, the step and the field; the untouched file passes
    both."""
    edit, problem = TAMPERED[case]
    path = tmp_path / "run.parquet"
    result.to_parquet(path, index=False)
    assert merge_results([path])["trace_id"].nunique() == 2
    tampered = edit(pd.read_parquet(path))
    tampered.to_parquet(path, index=False)
    messages = []
    for run in (lambda: merge_results([path]), lambda: write_report(path, out=tmp_path / "r.html")):
        with pytest.raises(ValueError, match=re.escape(problem)) as error:
            run()
        assert str(path) in str(error.value)
        messages.append(str(error.value).split(str(path), 1)[1])
    assert messages[0] == messages[1]
    assert not (tmp_path / "r.html").exists()


def test_a_slice_in_memory_is_no_file_to_check(result, tmp_path):
    """A frame in memory may be a slice of a run on purpose (late steps, one trace): report
    takes it; the same rows as a file are refused (a step missing)."""
    late = result[result["step"] >= 2]
    write_report(late, out=tmp_path / "late.html")
    late.to_parquet(tmp_path / "late.parquet", index=False)
    with pytest.raises(ValueError, match="steps are not 0, 1, 2"):
        read_result(tmp_path / "late.parquet", "a:")
