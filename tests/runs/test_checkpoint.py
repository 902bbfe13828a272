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
from trace_replay.engines.validate import ImpossibleResult
from trace_replay.runs.replay import replay

TOL = 1e-4  # batch composition moves float32 results by ~1e-6; a stale trace moves them by >0.1


@pytest.fixture(scope="module")
def engine(lm):
    return make_engine("prefill", lm, batch_size=2, top_k=3)


@pytest.fixture(scope="module")
def records(tokenizer, real_records):
    """Four traces; 'long' as token ids so that it can be cut."""
    chosen = {r["id"]: r for r in real_records if r["id"] in ("paris", "code", "long")}
    long = chosen.pop("long")
    chosen["long"] = {
        "id": "long",
        "prompt": long["prompt"],
        "trace_token_ids": tokenizer.encode(long["completion"]),
    }
    chosen["ref"] = {
        "id": "ref",
        "prompt": "Hello",
        "trace_token_ids": [28, 45, 314],
        "ref_logprobs": [-1.0, -2.0, -3.0],
    }
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
    from trace_replay.runs.parts import write_part

    want = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    [part] = tmp_path.glob("part-*.parquet")
    bad = pd.read_parquet(part)
    bad.loc[bad.index[bad["rank"] == 1][0], "rank"] = 2**60
    part.unlink()
    write_part(tmp_path, bad)
    with pytest.warns(RuntimeWarning, match="rank 1152921504606846976 is impossible"):
        got = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    assert_same_replay(got, want)
    assert got["rank"].max() < 49152


def test_a_part_is_held_to_the_vocabulary_bound(engine, records, tmp_path):
    """A part whose rank-1 row has logprob -20, below -log(49152) = -10.8 (as a server's
    answer was written before the bound was checked), its top-k agreeing, is not served: the
    checkpoint reads parts back with the engine's vocabulary size."""
    from trace_replay.runs.parts import write_part

    want = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    [part] = tmp_path.glob("part-*.parquet")
    bad = pd.read_parquet(part)
    row = bad.index[bad["rank"] == 1][0]
    bad.at[row, "logprob"] = -20.0
    bad.at[row, "top_logprobs"] = np.array([-20.0, -21.0, -22.0])
    part.unlink()
    write_part(tmp_path, bad)
    with pytest.warns(
        RuntimeWarning,
        match=r"rank 1 is impossible: rank 1 is the most likely "
        r"token: its logprob is finite and >= -log\(vocabulary size 49152\)",
    ):
        got = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    assert_same_replay(got, want)


def test_unreadable_settings_are_named(engine, records, tmp_path):
    """A damaged settings.json is an error naming the file, not a traceback from json."""
    (tmp_path / "settings.json").write_text('{"engine": "pre')
    with pytest.raises(ValueError, match=f"{tmp_path / 'settings.json'}.*unreadable"):
        replay(records, engine=engine, progress=False, checkpoint=tmp_path)


def test_parts_bounded_in_traces_and_time(engine, records, tmp_path):
    """chunk_size caps the traces of a part; checkpoint_every=0 writes after every batch."""

    def part_sizes(folder):
        return [
            pd.read_parquet(p)["trace_id"].nunique() for p in sorted(folder.glob("part-*.parquet"))
        ]

    replay(
        records,
        engine=engine,
        progress=False,
        checkpoint=tmp_path / "a",
        chunk_size=3,
        checkpoint_every=3600,
    )
    assert part_sizes(tmp_path / "a") == [3, 1]
    replay(
        records,
        engine=engine,
        progress=False,
        checkpoint=tmp_path / "b",
        chunk_size=100,
        checkpoint_every=0,
    )
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
    return {
        "id": "chat",
        "messages": [
            {"role": "user", "content": "Capital of Italy?"},
            {"role": "assistant", "content": " Rome, of course."},
        ],
        "trace_token_ids": ids,
        "trace_turns": [1] * len(ids),
        "trace_roles": [role] * len(ids),
    }


def test_edited_chat_labels_are_recomputed(engine, records, tokenizer, tmp_path):
    """A rerun after editing only a chat trace's roles serves the new roles, not the old."""
    replay(
        [chat_record(tokenizer, "assistant"), records[1]],
        engine=engine,
        progress=False,
        checkpoint=tmp_path,
    )
    resumed = replay(
        [chat_record(tokenizer, "template"), records[1]],
        engine=engine,
        progress=False,
        checkpoint=tmp_path,
    )
    assert set(resumed.loc[resumed["trace_id"] == "chat", "role"]) == {"template"}
    assert resumed.attrs["resumed_traces"] == 1  # the plain trace alone is unchanged


def test_plain_run_gets_no_chat_columns_from_a_chat_runs_parts(
    engine, records, tokenizer, tmp_path
):
    """Rows served from a part that a chat run wrote have the columns of a run without the
    checkpoint: no ``turn``/``role`` when none of this run's traces is a chat trace."""
    replay(
        [chat_record(tokenizer, "assistant"), records[1]],
        engine=engine,
        progress=False,
        checkpoint=tmp_path,
    )
    resumed = replay([records[1]], engine=engine, progress=False, checkpoint=tmp_path)
    assert resumed.attrs["resumed_traces"] == 1
    assert list(resumed.columns) == list(
        replay([records[1]], engine=engine, progress=False).columns
    )


def test_digest_covers_every_trace_field_its_rows_copy(tokenizer):
    """Editing any Trace field that changes the trace's rows (``to_frame``) changes its
    digest: no edit can be served stale."""
    from dataclasses import replace

    from trace_replay.engines.base import ReplayRequest, TraceResult
    from trace_replay.runs.checkpoint import trace_digest
    from trace_replay.runs.frame import TokenDecoder, to_frame
    from trace_replay.traces.trace import FIELDS, Trace, TraceError

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    common = {
        "prompt_token_ids": (1, 2),
        "trace_token_ids": (3, 4),
        "ref_logprobs": (-1.0, -2.0),
        "meta": {"k": 1},
    }
    bases = [
        Trace("a", prompt="Hi", completion="Yo", **common),
        Trace(
            "a",
            completion="Yo",
            messages=messages,
            tools=[{"type": "function"}],
            turns="all",
            trace_turns=(1, 1),
            trace_roles=("assistant", "assistant"),
            **common,
        ),
    ]
    edits = {
        "id": "b",
        "prompt": "Ho",
        "prompt_token_ids": (1, 5),
        "completion": "Ya",
        "trace_token_ids": (3, 6),
        "ref_logprobs": (-1.0, -2.5),
        "meta": {"k": 2},
        "messages": messages[:1] + [{"role": "assistant", "content": "Ye"}],
        "tools": [],
        "turns": "last",
        "trace_turns": (1, 2),
        "trace_roles": ("assistant", "template"),
    }
    decode = TokenDecoder(tokenizer)

    def rows_and_digest(trace):
        request = ReplayRequest(trace.id, trace.prompt_token_ids, trace.trace_token_ids)
        result = TraceResult(
            trace.id,
            2,
            np.array(trace.trace_token_ids),
            np.full(2, -1.0),
            np.ones(2, int),
            np.zeros((2, 1), int),
            np.full((2, 1), -0.5),
            np.ones(2),
        )
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


class ShiftedPrompt:
    """A real engine whose results claim a prompt one token longer than the request's (rows a
    read-back refuses), counting its calls so that a loop fails the test instead of hanging."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, requests, on_tokens=None):
        from dataclasses import replace

        self.calls += 1
        assert self.calls <= 10, "the checkpoint computes the same traces over and over"
        return [
            replace(result, prompt_len=result.prompt_len + 1)
            for result in self.engine.run(requests, on_tokens=on_tokens)
        ]


def test_results_a_read_back_refuses_are_an_error_not_a_loop(engine, records, tmp_path):
    """Rows that the read-back check would refuse are never written: the run stops with an
    error naming the trace and the problem, after computing each trace once."""
    shifted = ShiftedPrompt(engine)
    with pytest.raises(ImpossibleResult, match="trace 'paris'.*(position|prompt)"):
        replay(records[:1], engine=shifted, progress=False, checkpoint=tmp_path)
    assert shifted.calls == 1
    assert not list(tmp_path.glob("part-*"))


def _requests_and_rows(engine, records):
    """Tokenized requests of ``records`` and their real replay rows."""
    from trace_replay.runs.replay import prepare_requests
    from trace_replay.traces.sets import load_traces

    traces = load_traces(records).tokenize(engine.tokenizer)
    return prepare_requests(traces, None)[0], replay(traces, engine=engine, progress=False)


def test_impossible_rows_are_named_and_the_rest_saved(engine, records, tmp_path):
    """A NaN logprob in a batch: an error names its trace, step and problem; the batch's
    other traces are saved, and a rerun resumes them."""
    from trace_replay.runs.checkpoint import Checkpoint

    requests, rows = _requests_and_rows(engine, records[:2])
    rows.loc[rows.index[rows["trace_id"] == "code"][1], "logprob"] = np.nan
    with Checkpoint(tmp_path, engine.settings(), requests, batch_size=2) as store:
        assert [r.trace_id for r in store.claim()] == ["paris", "code"]
        store.add(rows)
        with pytest.raises(
            ImpossibleResult, match="trace 'code', step 1: logprob nan is impossible"
        ):
            store.waiting()
    with Checkpoint(tmp_path, engine.settings(), requests) as store:
        assert store.resumed == 1
    assert not list(tmp_path.glob("*.corrupt"))


def test_a_part_that_fails_verification_is_never_written(engine, records, tmp_path):
    """``verify`` hears of each part's traces, in order, before it is written; a part it
    refuses (the engine's weights changed) is not written, not even by the save on the way
    out of the error, while the parts verified before it stay."""
    from trace_replay.runs.checkpoint import Checkpoint

    requests, rows = _requests_and_rows(engine, records[:3])
    heard = []

    def verify(trace_ids: list[str]) -> None:
        heard.append(trace_ids)
        if len(heard) == 2:
            raise RuntimeError("weights changed")

    with pytest.raises(RuntimeError, match="weights changed"):
        with Checkpoint(
            tmp_path, engine.settings(), requests, batch_size=1, max_traces=1, verify=verify
        ) as store:
            while group := store.claim():
                store.add(rows[rows["trace_id"].isin([r.trace_id for r in group])])
    assert heard == [["paris"], ["code"]]
    with Checkpoint(tmp_path, engine.settings(), requests) as store:
        assert store.resumed == 1
        assert [r.trace_id for r in store.claim(most=3)] == ["code", "long"]


def test_rows_lost_again_and_again_are_an_error_not_a_loop(engine, records, tmp_path):
    """A trace whose rows never reach a part (here: left out of every frame added) is
    computed at most ``max_computations`` times, then an error names it."""
    from trace_replay.runs.checkpoint import Checkpoint

    requests, rows = _requests_and_rows(engine, records[:2])
    with Checkpoint(tmp_path, engine.settings(), requests, batch_size=2) as store:
        with pytest.raises(RuntimeError, match="trace 'code' was computed 2 times"):
            for _ in range(10):
                if group := store.claim():
                    ids = [r.trace_id for r in group if r.trace_id != "code"]
                    store.add(rows[rows["trace_id"].isin(ids)])
                elif not store.waiting():
                    assert store.read() is None, "a result without trace 'code'"


def test_a_folder_named_like_a_part_is_skipped(engine, records, tmp_path):
    """A folder (or FIFO) named like a part: a warning saying what it is; the run goes on."""
    import os

    want = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    (tmp_path / f"part-{0:020d}-{'0' * 16}.parquet").mkdir()
    (tmp_path / "part-1.parquet").mkdir()
    os.mkfifo(tmp_path / f"part-{1:020d}-{'0' * 16}.parquet")  # reading it would block
    with pytest.warns(RuntimeWarning) as caught:
        got = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    said = sorted(str(w.message).split(" is named like a part but is ")[1] for w in caught)
    assert said == ["a folder; ignored, nothing is read from it"] * 2 + [
        "not a regular file; ignored, nothing is read from it"
    ]
    assert_same_replay(got, want)
    assert got.attrs["resumed_traces"] == len(records)


def test_a_stray_file_named_like_a_part_is_said_to_be_ignored(engine, records, tmp_path):
    """A file named part-*.parquet without a content digest: the warning says what is true
    (it is not a part this version wrote, and nothing is read from it)."""
    replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "part-mine.parquet")
    with pytest.warns(RuntimeWarning) as caught:
        replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    [message] = [str(w.message) for w in caught if "part-mine" in str(w.message)]
    assert "not a part written by this version" in message
    assert "nothing is read from it" in message


def test_a_stray_part_with_a_digest_like_name_is_told_the_real_form(engine, records, tmp_path):
    """A copy named part-0-<16 hex>.parquet (it has a digest, in the wrong form): the warning
    gives the form a part's name has, and does not claim the name lacks a digest."""
    replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    stray = tmp_path / f"part-0-{'0' * 16}.parquet"
    stray.write_bytes(next(tmp_path.glob("part-*.parquet")).read_bytes())
    with pytest.warns(RuntimeWarning) as caught:
        replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    [message] = [str(w.message) for w in caught if stray.name in str(w.message)]
    assert "part-<20-digit time in ns>-<16 hex digits of its SHA-256>.parquet" in message
    assert "no content digest" not in message


def test_a_deleted_settings_file_is_written_again_for_its_own_parts(engine, records, tmp_path):
    """settings.json deleted, same settings: a warning says so, the file is written again and
    every part is served (none called corrupt)."""
    replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    (tmp_path / "settings.json").unlink()
    with pytest.warns(RuntimeWarning, match="settings.json was missing; written again"):
        got = replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    assert got.attrs["resumed_traces"] == len(records)
    assert json.loads((tmp_path / "settings.json").read_text())["top_k"] == 3
    assert not list(tmp_path.glob("*.corrupt"))


def test_a_deleted_settings_file_with_other_settings_is_refused(lm, engine, records, tmp_path):
    """settings.json deleted, other settings: an error saying settings.json is missing; the
    parts stay as they are (valid parts are never called corrupt)."""
    replay(records, engine=engine, progress=False, checkpoint=tmp_path)
    (tmp_path / "settings.json").unlink()
    parts = sorted(tmp_path.glob("part-*.parquet"))
    other = make_engine("prefill", lm, batch_size=2, top_k=4)
    with pytest.raises(
        ValueError,
        match="settings.json is missing, and its parts were computed with other settings",
    ):
        replay(records, engine=other, progress=False, checkpoint=tmp_path)
    assert sorted(tmp_path.glob("part-*.parquet")) == parts
    assert not list(tmp_path.glob("*.corrupt"))


def test_a_fifo_named_settings_json_is_refused_not_read(engine, records, tmp_path):
    """settings.json replaced by a FIFO: an error names it, without blocking on a read (a
    writer feeding the FIFO is left waiting, then released)."""
    import os
    import threading

    replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    settings = tmp_path / "settings.json"
    settings.unlink()
    os.mkfifo(settings)

    def feed() -> None:
        try:
            settings.write_text("{}")
        except BrokenPipeError:  # the reader that releases it closes at once
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with pytest.raises(ValueError, match=r"settings\.json is not a regular file"):
            replay(records[:1], engine=engine, progress=False, checkpoint=tmp_path)
    finally:
        os.close(os.open(settings, os.O_RDONLY | os.O_NONBLOCK))  # lets the writer finish
        writer.join(5)


def test_weights_edited_under_the_same_name_are_not_served(lm, records, tmp_path):
    """The checkpoint keys on the weights, not only the model's name: a model edited in
    place (same object, same label) and rerun on the folder is refused by name, never
    served the rows of the old weights."""
    import copy

    import torch

    model = copy.deepcopy(lm)
    engine = make_engine("prefill", model, batch_size=2, top_k=3)
    replay(records[:2], engine=engine, progress=False, checkpoint=tmp_path)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1.5)
    with pytest.raises(ValueError, match="other settings.*weights_digest"):
        replay(records[:2], engine=engine, progress=False, checkpoint=tmp_path)
    fresh = replay(records[:2], engine=engine, progress=False, checkpoint=tmp_path / "new")
    assert_same_replay(fresh, replay(records[:2], engine=engine, progress=False))


def test_a_deterministic_folder_resumes_at_another_batch_size(lm, records, tmp_path):
    """Deterministic mode gives every trace the same bits whatever the batch size, so a
    folder written at batch 1 serves every trace to a rerun at batch 3, bit for bit; without
    deterministic mode another batch size is other settings, refused."""
    first = replay(
        records,
        engine=make_engine("prefill", lm, batch_size=1, top_k=3, deterministic=True),
        progress=False,
        checkpoint=tmp_path / "det",
    )
    resumed = replay(
        records,
        engine=make_engine("prefill", lm, batch_size=3, top_k=3, deterministic=True),
        progress=False,
        checkpoint=tmp_path / "det",
    )
    assert resumed.attrs["resumed_traces"] == len(records) and resumed.attrs["batch_size"] == 3
    pd.testing.assert_frame_equal(resumed, first)
    replay(
        records,
        engine=make_engine("prefill", lm, batch_size=1, top_k=3),
        progress=False,
        checkpoint=tmp_path / "plain",
    )
    with pytest.raises(ValueError, match=r"other settings \(batch_size\)"):
        replay(
            records,
            engine=make_engine("prefill", lm, batch_size=3, top_k=3),
            progress=False,
            checkpoint=tmp_path / "plain",
        )


def test_call_size_is_whole_batches_of_half_the_part_interval():
    """call_size: about every_s / 2 of compute, rounded down to whole batches, never below
    one batch, never above ``most``."""
    from trace_replay.runs.checkpoint import call_size

    assert call_size(0.1, batch_size=8, every_s=10.0, most=1000) == 48  # 50 fit, 6 batches
    assert call_size(10.0, batch_size=8, every_s=10.0, most=1000) == 8  # slow: one batch
    assert call_size(1e-9, batch_size=8, every_s=10.0, most=256) == 256  # fast: the cap
    assert call_size(0.0, batch_size=1, every_s=10.0, most=5) == 5


@pytest.mark.parametrize("after", ["rename", "record"])
def test_an_interrupt_landing_as_a_part_is_written_saves_each_trace_once(
    engine, records, tmp_path, monkeypatch, after
):
    """Ctrl-C arriving after a part is renamed into place, before the run has noted it (the
    signal lands between two bytecodes): leaving the ``with`` block saves only what no part
    holds yet, so the folder holds each finished trace once."""
    from trace_replay.runs import checkpoint as module

    requests, rows = _requests_and_rows(engine, records[:2])
    real = module.write_checked if after == "rename" else module.Checkpoint._write

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    target = "write_checked" if after == "rename" else "Checkpoint._write"
    monkeypatch.setattr(f"trace_replay.runs.checkpoint.{target}", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with module.Checkpoint(tmp_path, engine.settings(), requests, batch_size=2) as store:
            store.claim()
            store.add(rows)
            store.waiting()  # writes the buffered part
    monkeypatch.undo()
    saved = pd.concat(pd.read_parquet(p) for p in tmp_path.glob("part-*.parquet"))
    assert sorted(saved["trace_id"].unique()) == ["code", "paris"]
    assert not saved.duplicated(["trace_id", "step"]).any()


def test_a_part_changed_after_its_first_read_is_still_caught(engine, records, tmp_path):
    """A part's values are checked at its first read only; a later read still checks its
    bytes against its name's SHA-256, so a bit flipped between the two is caught: the part
    is moved aside and the read gives nothing (its traces are computed again)."""
    from trace_replay.runs.checkpoint import Checkpoint

    requests, rows = _requests_and_rows(engine, records[:2])
    with Checkpoint(tmp_path, engine.settings(), requests, batch_size=2) as store:
        store.claim()
        store.add(rows)
        assert store.read() is not None
    with Checkpoint(tmp_path, engine.settings(), requests) as store:
        assert store.resumed == len(requests)  # every part read and checked
        part = sorted(tmp_path.glob("part-*.parquet"))[0]
        data = bytearray(part.read_bytes())
        data[len(data) // 3] ^= 0x10
        part.write_bytes(bytes(data))
        with pytest.warns(RuntimeWarning, match="corrupt"):
            assert store.read() is None
    assert (tmp_path / f"{part.name}.corrupt").exists()
