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
