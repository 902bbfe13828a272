"""Trace files that are damaged or unusual: errors name the file and line; BOM and case pass."""

from __future__ import annotations

import codecs
import gzip
import json

import pytest

from trace_replay.traces.sets import TraceError, load_traces

GOOD = {"id": "ok", "prompt_token_ids": [1], "trace_token_ids": [2]}
LINES = "".join(json.dumps({**GOOD, "id": f"t{i}"}) + "\n" for i in range(200)).encode()


def test_bytes_that_are_not_utf8_name_line_and_byte(tmp_path):
    """A non-UTF-8 byte is a TraceError naming file:line and the byte, in JSONL and JSON."""
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_bytes(json.dumps(GOOD).encode() + b'\n{"id": "caf\xe9"}\n')
    with pytest.raises(TraceError, match=rf"{jsonl}:2: not UTF-8 text: byte 0xe9"):
        load_traces(jsonl)
    whole = tmp_path / "t.json"
    whole.write_bytes(b'[\n{"id": "caf\xe9"}\n]')
    with pytest.raises(TraceError, match=rf"{whole}:2: not UTF-8 text: byte 0xe9"):
        load_traces(whole)


def test_damaged_gzip_names_the_file(tmp_path):
    """A truncated .jsonl.gz, a .gz that is not gzip, and a truncated .json.gz: TraceErrors
    naming the file (and the line reached), never EOFError or BadGzipFile."""
    packed = gzip.compress(LINES)
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(TraceError, match=rf"{truncated}:\d+: gzip data is damaged or truncated"):
        load_traces(truncated)
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_bytes(LINES)
    with pytest.raises(TraceError, match=rf"{plain}:1: gzip data is damaged"):
        load_traces(plain)
    whole = tmp_path / "cut.json.gz"
    whole.write_bytes(gzip.compress(b"[" + b",".join([json.dumps(GOOD).encode()] * 50) + b"]")[:40])
    with pytest.raises(TraceError, match=rf"{whole}: gzip data is damaged or truncated"):
        load_traces(whole)


def test_byte_order_mark_and_upper_case_extensions_are_read(tmp_path):
    """A UTF-8 BOM (as Windows tools write) and .JSONL / .JSON.GZ names load like any other."""
    jsonl = tmp_path / "T.JSONL"
    jsonl.write_bytes(codecs.BOM_UTF8 + LINES)
    assert len(load_traces(jsonl)) == 200
    whole = tmp_path / "T.JSON.GZ"
    whole.write_bytes(gzip.compress(codecs.BOM_UTF8 + json.dumps([GOOD]).encode()))
    assert load_traces(whole).ids == ["ok"]


def test_unreadable_parquet_names_the_file(tmp_path):
    """A file named .parquet that is not Parquet is a TraceError naming it."""
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(TraceError, match=rf"{path}: not a readable Parquet file"):
        load_traces(path)


@pytest.mark.parametrize("kind", ["parquet", "frame"])
def test_a_typo_column_is_named_at_the_first_row_holding_it(kind, tmp_path):
    """In a table, a column of a typo is null in the rows without it: the UnknownFieldWarning
    names the first row that holds a value, and its trace (not row 0, whose trace has none)."""
    import warnings

    import pandas as pd

    from trace_replay.traces.sources import UnknownFieldWarning

    frame = pd.DataFrame([GOOD, {**GOOD, "id": "typo", "trace_tokens_ids": [5]}])
    source = frame if kind == "frame" else tmp_path / "t.parquet"
    if kind == "parquet":
        frame.to_parquet(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownFieldWarning)
        load_traces(source)
    assert [str(w.message).split(" unknown")[0] for w in caught] == [
        f"{'<DataFrame>' if kind == 'frame' else source} row 1: trace 'typo':"
    ]
