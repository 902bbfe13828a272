"""replay(): tidy frame, provenance, checkpoints, shards and errors (prefill engine: fast)."""

from __future__ import annotations

import pandas as pd
import pytest

from trace_replay import TraceError
from trace_replay.engines import make_engine
from trace_replay.runs.replay import replay

pytestmark = pytest.mark.slow

REQUIRED = [
    "trace_id",
    "step",
    "position",
    "token_id",
    "token",
    "logprob",
    "rank",
    "top_token_ids",
    "top_logprobs",
    "entropy",
]


@pytest.fixture(scope="module")
def engine(lm):
    return make_engine("prefill", lm, batch_size=4, top_k=3)


def test_frame_columns_and_attrs(engine, real_traces):
    """One row per (trace, step), required columns, provenance in attrs."""
    df = replay(real_traces, engine=engine, progress=False)
    assert set(REQUIRED) <= set(df.columns)
    assert list(df.columns[:3]) == ["trace_id", "step", "position"]
    assert len(df) == sum(len(t.trace_token_ids) for t in real_traces)
    assert not df.duplicated(["trace_id", "step"]).any()
    assert df["top_token_ids"].map(len).eq(3).all()
    for key in (
        "model",
        "engine",
        "engine_path",
        "dtype",
        "device",
        "top_k",
        "batch_size",
        "versions",
        "started_at",
    ):
        assert key in df.attrs, key
    assert "ref_logprob" not in df.columns


def test_prefill_matches_reference(engine, real_traces, assert_matches_reference):
    """Teacher-forced float32 scoring agrees with the float64 computation."""

    assert_matches_reference(replay(real_traces, engine=engine, progress=False))


def test_ref_logprob_column(engine):
    """A trace's ref_logprobs come back as the ref_logprob column, NaN for traces without."""
    traces = [
        {"id": "a", "prompt": "Hello", "trace_token_ids": [28, 45], "ref_logprobs": [-1, -2]},
        {"id": "b", "prompt": "Hello", "trace_token_ids": [28]},
    ]
    df = replay(traces, engine=engine, progress=False)
    assert df["ref_logprob"].iloc[:2].tolist() == [-1.0, -2.0]
    assert df["ref_logprob"].iloc[2:].isna().all()


def test_resume_equals_uninterrupted(lm, real_traces, tmp_path, assert_frames_bitwise_equal):
    """A run interrupted after some traces, rerun with its checkpoint, equals a full run.

    Bitwise, so in deterministic mode: the resumed chunks (2 traces) and the full run (one
    batch of 4) batch the traces differently (tests/runs/test_resume.py: default mode, tolerance).
    """
    engine = make_engine("prefill", lm, batch_size=4, top_k=3, deterministic=True)
    full = replay(real_traces, engine=engine, progress=False)
    ckpt = tmp_path / "ckpt"

    class Interrupted(Exception):
        pass

    calls = {"n": 0}
    real_run = engine.run

    def dying_run(requests, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Interrupted
        return real_run(requests, **kwargs)

    engine.run = dying_run
    try:
        with pytest.raises(Interrupted):
            replay(real_traces, engine=engine, progress=False, checkpoint=ckpt, chunk_size=2)
    finally:
        del engine.run
    partial = pd.read_parquet(next(ckpt.glob("part-*.parquet")))
    assert partial["trace_id"].nunique() == 2
    resumed = replay(real_traces, engine=engine, progress=False, checkpoint=ckpt, chunk_size=2)
    assert resumed.attrs["resumed_traces"] == 2
    assert_frames_bitwise_equal(resumed, full)


def test_resumed_run_says_what_it_skipped(engine, real_traces, tmp_path, capsys):
    """A rerun over a checkpoint names how many traces and tokens were already done, and
    the progress bar counts tokens."""
    replay(real_traces[:2], engine=engine, progress=False, checkpoint=tmp_path)
    capsys.readouterr()
    replay(real_traces, engine=engine, progress=True, checkpoint=tmp_path)
    err = capsys.readouterr().err
    done = sum(len(t.trace_token_ids) for t in real_traces[:2])
    assert f"2 of 6 traces ({done} tokens) already done, 4 to replay" in err
    total = sum(len(t.trace_token_ids) for t in real_traces)
    assert f"{total}/{total}" in err and "tok/s" in err


def test_checkpoint_refuses_other_settings(engine, real_traces, tmp_path, lm):
    """A checkpoint written with one top_k is not silently extended with another."""
    replay(real_traces[:2], engine=engine, progress=False, checkpoint=tmp_path)
    other = make_engine("prefill", lm, batch_size=4, top_k=5)
    with pytest.raises(ValueError, match="other settings"):
        replay(real_traces, engine=other, progress=False, checkpoint=tmp_path)


def test_shards_partition_the_dataset(engine, real_traces):
    """Shards (i, n) are disjoint and together give the whole result."""
    full = replay(real_traces, engine=engine, progress=False)
    parts = [replay(real_traces, engine=engine, progress=False, shard=(i, 3)) for i in range(3)]
    merged = pd.concat(parts, ignore_index=True)
    assert sorted(merged["trace_id"].unique()) == sorted(full["trace_id"].unique())
    assert len(merged) == len(full)


def test_too_long_trace_is_named(lm):
    """A trace beyond max_model_len is an error naming it, or cut with truncate=True."""
    engine = make_engine("prefill", lm, batch_size=4, top_k=3)
    engine.max_model_len = 16  # the model's real 8192 would make this test slow
    long = [{"id": "too-long", "prompt": "Hi", "trace_token_ids": [28] * 20}]
    with pytest.raises(TraceError, match="too-long.*max_model_len"):
        replay(long, engine=engine, progress=False)
    with pytest.warns(UserWarning, match="too-long"):
        df = replay(long, engine=engine, progress=False, truncate=True)
    assert len(df) == 16 - 1
    assert df.attrs["truncated"]


def test_out_of_vocab_is_named(engine):
    """A token id outside the model's vocabulary is refused before any work, naming the trace."""
    with pytest.raises(TraceError, match="oov"):
        replay(
            [{"id": "oov", "prompt": "Hi", "trace_token_ids": [49152]}],
            engine=engine,
            progress=False,
        )


def test_ids_past_the_models_vocabulary_are_named(tiny_llama):
    """A token id the tokenizer knows but the model's logits do not reach (a 128-token model
    beside the embedded 49,152-token tokenizer) is refused naming the trace and the field,
    not an IndexError from the embedding."""
    from trace_replay.models.load import load_tokenizer

    with make_engine("torch", tiny_llama) as engine:
        engine.tokenizer = load_tokenizer()
        with pytest.raises(TraceError, match=r"past-vocab.*trace_token_ids\[1\] = 500 .*128"):
            replay(
                [{"id": "past-vocab", "prompt_token_ids": [1, 2], "trace_token_ids": [3, 500]}],
                engine=engine,
                progress=False,
            )


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("chunk_size", -1),
        ("chunk_size", 0),
        ("shard", (0, 0)),
        ("shard", (2, 2)),
        ("checkpoint_every", -1.0),
        ("truncate", "yes"),
    ],
)
def test_bad_arguments_are_refused(engine, real_traces, argument, value):
    """A bad argument is a ValueError naming it, never a silently dropped trace."""
    with pytest.raises(ValueError, match=argument):
        replay(real_traces, engine=engine, progress=False, **{argument: value})


def test_empty_input_is_an_error(engine):
    """No traces to replay is an error naming the source, not an empty success."""
    with pytest.raises(TraceError, match="<list>: no traces"):
        replay([], engine=engine, progress=False)


def test_top_k_above_the_vocabulary_is_named(lm):
    """top_k larger than the vocabulary is refused before any trace is scored, saying so with
    both numbers, whether replay builds the engine or is given one."""
    hello = [{"id": "t", "prompt": "Hi", "completion": " there"}]
    message = r"^top_k 60000 exceeds the model's vocabulary size 49152"
    with pytest.raises(ValueError, match=message):
        replay(hello, lm, engine="prefill", top_k=60000, progress=False)
    with pytest.raises(ValueError, match=message):
        replay(hello, engine=make_engine("prefill", lm, top_k=60000), progress=False)


def test_engine_settings_beside_an_engine_object_are_named_in_english(engine):
    """Settings given with an engine object are refused naming them, the verb agreeing."""
    hello = [{"id": "t", "prompt": "Hi", "completion": " there"}]
    with pytest.raises(ValueError, match=r"^dtype configures an engine; .* give it to make_eng"):
        replay(hello, engine=engine, dtype="float32")
    with pytest.raises(ValueError, match=r"^dtype and top_k configure an engine; .* give them"):
        replay(hello, engine=engine, dtype="float32", top_k=3)


def test_an_engine_object_lacking_protocol_members_is_refused(engine):
    """An engine object is checked against the Engine protocol before anything runs: one
    with run, settings and stats only (the old duck-typing test) is a TypeError naming the
    members it lacks, not an AttributeError deep in the replay."""

    class Scorer:
        name = "scorer"

        def run(self, requests, *, on_tokens=None):
            return engine.run(requests, on_tokens=on_tokens)

        def settings(self):
            return engine.settings()

        def stats(self):
            return {}

    hello = [{"id": "t", "prompt": "Hi", "completion": " there"}]
    with pytest.raises(
        TypeError,
        match=r"^engine must be a name \(auto, .*\) or an Engine: "
        r"Scorer is not an Engine: it lacks .*"
        r"batch_size, .*tokenizer, vocab_size, weights_digest",
    ):
        replay(hello, engine=Scorer(), progress=False)


class NanForOne:
    """A real engine whose result for one trace gets a NaN logprob at step 0 (as a broken
    model or server would give), counting its calls."""

    def __init__(self, engine, trace_id):
        self.engine, self.trace_id, self.calls = engine, trace_id, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, requests, on_tokens=None):
        self.calls += 1
        results = self.engine.run(requests, on_tokens=on_tokens)
        for result in results:
            if result.trace_id == self.trace_id:
                result.logprob[0] = float("nan")
        return results


def test_an_impossible_trace_keeps_its_batch_mates(engine, real_traces, tmp_path):
    """One trace of a batch scored NaN: replay raises naming it, and with a checkpoint the
    batch's other traces are saved, so a rerun resumes them and computes only that trace."""
    from trace_replay.engines.base import engine_identity
    from trace_replay.engines.validate import ImpossibleResult
    from trace_replay.runs.checkpoint import Checkpoint
    from trace_replay.runs.replay import prepare_requests

    traces = real_traces[:4]
    nan = NanForOne(engine, traces[1].id)
    with pytest.raises(ImpossibleResult, match=f"trace '{traces[1].id}', step 0: .*= nan"):
        replay(traces, engine=nan, progress=False, checkpoint=tmp_path)
    assert nan.calls == 1  # one batch of 4
    requests = prepare_requests(traces.tokenize(engine.tokenizer), None)[0]
    with Checkpoint(tmp_path, engine_identity(engine), requests) as store:
        assert store.resumed == 3
