"""Checkpoints serve only what they verifiably hold: content digests, checksums, parts."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest

from trace_replay.engines import make_engine
from trace_replay.replay import replay

TOL = 1e-4  # batch composition moves float32 results by ~1e-6; a stale trace moves them by >0.1


@pytest.fixture(scope="module")
def engine(lm):
    return make_engine("prefill", lm, batch_size=2, top_k=3)


@pytest.fixture(scope="module")
def records(tokenizer, real_records):
    """Four traces; 'long' as token ids so that it can be cut."""
    chosen = {r["id"]: r for r in real_records if r["id"] in ("paris", "code", "long")}
    long = chosen.pop("long")
    chosen["long"] = {"id": "long", "prompt": long["prompt"],
                      "trace_token_ids": tokenizer.encode(long["completion"])}
    chosen["ref"] = {"id": "ref", "prompt": "Hello", "trace_token_ids": [28, 45, 314],
                     "ref_logprobs": [-1.0, -2.0, -3.0]}
    return list(chosen.values())


def assert_same_replay(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Same traces, steps and tokens, and scores within TOL."""
    assert got["trace_id"].tolist() == want["trace_id"].tolist()
    assert got["step"].tolist() == want["step"].tolist()
    assert got["token_id"].tolist() == want["token_id"].tolist()
    np.testing.assert_allclose(got["logprob"], want["logprob"], atol=TOL, rtol=0)
    if "ref_logprob" in want:
        np.testing.assert_array_equal(got["ref_logprob"], want["ref_logprob"])


def test_edited_traces_are_recomputed(engine, records, tmp_path):
    """A rerun after editing traces serves no stale row: edited traces are recomputed."""
    replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    edited = [dict(r) for r in records]
    edited[0]["completion"] = " Lyon. It is not the capital."  # rewritten text
    edited[2]["trace_token_ids"] = edited[2]["trace_token_ids"][:5]  # cut to 5 tokens
    edited[3]["ref_logprobs"] = [-0.5, -0.5, -0.5]  # only the reference changed
    resumed = replay(edited, engine=engine, progress=False, checkpoint=tmp_path)
    assert_same_replay(resumed, replay(edited, engine=engine, progress=False))
    assert (resumed["trace_id"] == "long").sum() == 5
    assert resumed.attrs["resumed_traces"] == 1  # 'code' alone is unchanged


def test_flipped_bit_is_detected_and_recomputed(engine, records, tmp_path):
    """One flipped bit in a part: a warning, the part moved aside, its traces recomputed."""
    want = replay(records, engine=engine, progress=False, checkpoint=tmp_path, chunk_size=2)
    part = sorted(tmp_path.glob("part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x10
    part.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        got = replay(records, engine=engine, progress=False, checkpoint=tmp_path, chunk_size=2)
    assert_same_replay(got, want)
    assert got.attrs["resumed_traces"] == 2
    assert (tmp_path / f"{part.name}.corrupt").exists()


def test_implausible_values_are_refused(engine, records, tmp_path):
    """A part with a valid checksum but a rank its top-k contradicts is not served."""
    from trace_replay.parts import write_part

    want = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    [part] = tmp_path.glob("part-*.parquet")
    bad = pd.read_parquet(part)
    bad.loc[bad.index[bad["rank"] == 1][0], "rank"] = 2**60
    part.unlink()
    write_part(tmp_path, bad)
    with pytest.warns(RuntimeWarning, match="rank disagrees with top-k"):
        got = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    assert_same_replay(got, want)
    assert got["rank"].max() < 49152


def test_unreadable_settings_are_named(engine, records, tmp_path):
    """A damaged settings.json is an error naming the file, not a traceback from json."""
    (tmp_path / "settings.json").write_text('{"engine": "pre')
    with pytest.raises(ValueError, match=f"{tmp_path / 'settings.json'}.*unreadable"):
        replay(records, engine=engine, progress=False, checkpoint=tmp_path)


def test_parts_bounded_in_traces_and_time(engine, records, tmp_path):
    """chunk_size caps the traces of a part; checkpoint_every=0 writes after every batch."""
    def part_sizes(folder):
        return [pd.read_parquet(p)["trace_id"].nunique()
                for p in sorted(folder.glob("part-*.parquet"))]

    replay(records, engine=engine, progress=False, checkpoint=tmp_path / "a", chunk_size=3,
           checkpoint_every=3600)
    assert part_sizes(tmp_path / "a") == [3, 1]
    replay(records, engine=engine, progress=False, checkpoint=tmp_path / "b", chunk_size=100,
           checkpoint_every=0)
    assert part_sizes(tmp_path / "b") == [2, 2]


def test_temporaries_of_dead_runs_are_cleaned(engine, records, tmp_path):
    """A part temporary left by a killed run is removed when the folder is opened again."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    from trace_replay._io import HOST

    leftover = tmp_path / f".part-1.parquet.{HOST}.{child.pid}.0123abcd.tmp"
    leftover.write_bytes(b"half a part")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    assert not leftover.exists()
    assert json.loads((tmp_path / "settings.json").read_text())["top_k"] == 3


def chat_record(tokenizer, role: str) -> dict:
    """A tokenized chat trace whose labels are given, so that only they can be edited."""
    ids = tokenizer.encode(" Rome, of course.")
    return {"id": "chat", "messages": [{"role": "user", "content": "Capital of Italy?"},
                                       {"role": "assistant", "content": " Rome, of course."}],
            "trace_token_ids": ids, "trace_turns": [1] * len(ids), "trace_roles": [role] * len(ids)}


def test_edited_chat_labels_are_recomputed(engine, records, tokenizer, tmp_path):
    """A rerun after editing only a chat trace's roles serves the new roles, not the old."""
    replay([chat_record(tokenizer, "assistant"), records[1]], engine=engine, progress=False,
           checkpoint=tmp_path)
    resumed = replay([chat_record(tokenizer, "tool"), records[1]], engine=engine,
                     progress=False, checkpoint=tmp_path)
    assert set(resumed.loc[resumed["trace_id"] == "chat", "role"]) == {"tool"}
    assert resumed.attrs["resumed_traces"] == 1  # the plain trace alone is unchanged


def test_plain_run_gets_no_chat_columns_from_a_chat_runs_parts(engine, records, tokenizer,
                                                              tmp_path):
    """Rows served from a part that a chat run wrote have the columns of a run without the
    checkpoint: no ``turn``/``role`` when none of this run's traces is a chat trace."""
    replay([chat_record(tokenizer, "assistant"), records[1]], engine=engine, progress=False,
           checkpoint=tmp_path)
    resumed = replay([records[1]], engine=engine, progress=False, checkpoint=tmp_path)
    assert resumed.attrs["resumed_traces"] == 1
    assert list(resumed.columns) == list(replay([records[1]], engine=engine,
                                                progress=False).columns)


def test_digest_covers_every_trace_field_its_rows_copy(tokenizer):
    """Editing any Trace field that changes the trace's rows (``to_frame``) changes its
    digest: no edit can be served stale."""
    from dataclasses import replace

    from trace_replay.checkpoint import trace_digest
    from trace_replay.engines.base import ReplayRequest, TraceResult
    from trace_replay.frame import TokenDecoder, to_frame
    from trace_replay.trace_record import FIELDS, Trace, TraceError

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    common = {"prompt_token_ids": (1, 2), "trace_token_ids": (3, 4), "ref_logprobs": (-1.0, -2.0),
              "meta": {"k": 1}}
    bases = [Trace("a", prompt="Hi", completion="Yo", **common),
             Trace("a", completion="Yo", messages=messages, tools=[{"type": "function"}],
                   turns="all", trace_turns=(1, 1), trace_roles=("assistant", "assistant"),
                   **common)]
    edits = {"id": "b", "prompt": "Ho", "prompt_token_ids": (1, 5), "completion": "Ya",
             "trace_token_ids": (3, 6), "ref_logprobs": (-1.0, -2.5), "meta": {"k": 2},
             "messages": messages[:1] + [{"role": "assistant", "content": "Ye"}],
             "tools": [], "turns": "last", "trace_turns": (1, 2),
             "trace_roles": ("assistant", "tool")}
    decode = TokenDecoder(tokenizer)

    def rows_and_digest(trace):
        request = ReplayRequest(trace.id, trace.prompt_token_ids, trace.trace_token_ids)
        result = TraceResult(trace.id, 2, np.array(trace.trace_token_ids), np.full(2, -1.0),
                             np.ones(2, int), np.zeros((2, 1), int), np.full((2, 1), -0.5),
                             np.ones(2))
        return to_frame([result], {trace.id: trace}, decode), trace_digest("k", request, trace)

    edited = set()
    for base in bases:
        rows, digest = rows_and_digest(base)
        for name, value in edits.items():
            try:
                trace = replace(base, **{name: value})
            except TraceError:  # e.g. messages beside prompt text
                continue
            edited.add(name)
            edited_rows, edited_digest = rows_and_digest(trace)
            if not edited_rows.equals(rows):
                assert edited_digest != digest, f"{name} changes the rows, not the digest"
    assert edited == set(FIELDS)  # a new Trace field needs an edit here
