"""Deterministic mode: a trace's rows are the same bits however the run is cut up.

Property tests over ``replay(..., deterministic=True)`` on the embedded model: any subset
of the traces, in any order, at batch size 1, 3 or 8, in chunks, sharded, or interrupted
and resumed from a checkpoint, gives every trace exactly the rows of one reference run;
decode replay, speculative verify and teacher-forced prefill give the same bits.
"""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from trace_replay.engines import make_engine
from trace_replay.runs.replay import replay

pytestmark = pytest.mark.slow

POOL = [
    {"id": "paris", "prompt": "The capital of France is", "completion": " Paris."},
    {"id": "ids", "prompt_token_ids": [504], "trace_token_ids": [3575, 282, 4649]},
    {"id": "code", "prompt": "def add(a, b):", "completion": "\n    return"},
    # " Hi!<|im_end|>" with the real EOS (id 2): completion text may not hold special tokens
    {"id": "eos", "prompt": "Say hi.", "trace_token_ids": [21041, 17, 2]},
    {"id": "count", "prompt": "1, 2, 3,", "completion": " 4"},
]
BATCH_SIZES = (1, 3, 8)
# few examples, no shrinking: every example replays real traces through the model
CHECK = settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
runs = st.fixed_dictionaries(
    {
        "traces": st.permutations(POOL).flatmap(
            lambda order: st.integers(1, len(order)).map(lambda n: order[:n])
        ),
        "batch_size": st.sampled_from(BATCH_SIZES),
        "chunk_size": st.sampled_from([None, 1, 2]),
    }
)


@pytest.fixture(scope="module")
def engines(lm):
    """Deterministic torch engines at batch sizes 1, 3 and 8, and a prefill engine."""
    made = {b: make_engine("torch", lm, batch_size=b, deterministic=True) for b in BATCH_SIZES}
    made["prefill"] = make_engine("prefill", lm, batch_size=2, deterministic=True)
    return made


@pytest.fixture(scope="module")
def reference(engines):
    """Every pool trace's rows from one run: all traces, batch 8, one chunk."""
    return replay(POOL, engine=engines[8], progress=False)


def rows_of(reference: pd.DataFrame, traces: list[dict]) -> pd.DataFrame:
    """The reference rows of ``traces``, in their order."""
    parts = [reference[reference["trace_id"] == t["id"]] for t in traces]
    return pd.concat(parts, ignore_index=True)


@CHECK
@given(run=runs)
def test_torch_replay_ignores_batch_order_and_chunks(
    engines, reference, run, assert_frames_bitwise_equal
):
    """Any subset, order, batch size and chunk size: each trace's rows are the reference's."""
    got = replay(
        run["traces"],
        engine=engines[run["batch_size"]],
        progress=False,
        chunk_size=run["chunk_size"],
    )
    assert_frames_bitwise_equal(got, rows_of(reference, run["traces"]))


@CHECK
@given(run=runs)
def test_prefill_equals_decode_replay_bitwise(engines, reference, run, assert_frames_bitwise_equal):
    """Teacher-forced prefill, in any grouping, gives the decode replay's bits."""
    got = replay(
        run["traces"], engine=engines["prefill"], progress=False, chunk_size=run["chunk_size"]
    )
    assert_frames_bitwise_equal(got, rows_of(reference, run["traces"]))


@CHECK
@given(run=runs, fail_at=st.integers(1, 3))
def test_resume_equals_uninterrupted_bitwise(
    engines, reference, run, fail_at, tmp_path_factory, assert_frames_bitwise_equal
):
    """A run killed after some chunks and resumed from its checkpoint equals the reference."""
    engine = engines[run["batch_size"]]
    folder = tmp_path_factory.mktemp("ckpt")
    calls = {"n": 0}
    real_run = engine.run

    def dying_run(requests, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise KeyboardInterrupt
        return real_run(requests, **kwargs)

    engine.run = dying_run
    try:
        replay(
            run["traces"],
            engine=engine,
            progress=False,
            checkpoint=folder,
            chunk_size=run["chunk_size"] or 1,
        )
    except KeyboardInterrupt:
        pass
    finally:
        del engine.run
    resumed = replay(
        run["traces"],
        engine=engine,
        progress=False,
        checkpoint=folder,
        chunk_size=run["chunk_size"] or 1,
    )
    assert resumed["trace_id"].drop_duplicates().tolist() == [t["id"] for t in run["traces"]]
    assert_frames_bitwise_equal(resumed, rows_of(reference, run["traces"]))


def test_shards_are_slices_of_the_reference(engines, reference, assert_frames_bitwise_equal):
    """Each shard's rows are the reference's rows of its traces."""
    for index in range(3):
        part = replay(POOL, engine=engines[3], progress=False, shard=(index, 3))
        ids = part["trace_id"].drop_duplicates().tolist()
        assert_frames_bitwise_equal(part, rows_of(reference, [{"id": i} for i in ids]))


@pytest.mark.parametrize("method", ["trace", "ngram"])
def test_speculative_verify_equals_step_by_step_bitwise(
    lm, reference, method, assert_frames_bitwise_equal
):
    """Verify (rejected drafts are always trailing, so slots realign) gives the same bits."""
    engine = make_engine(
        "torch",
        lm,
        batch_size=3,
        deterministic=True,
        speculative={"method": method, "num_tokens": 2},
    )
    assert_frames_bitwise_equal(replay(POOL, engine=engine, progress=False), reference)


def test_engine_object_must_match_the_flag(lm, engines):
    """deterministic=True with an engine built without it is an error, not a silent no-op."""
    plain = make_engine("prefill", lm)
    with pytest.raises(ValueError, match="deterministic"):
        replay(POOL[:1], engine=plain, progress=False, deterministic=True)
    df = replay(POOL[:1], engine=engines["prefill"], progress=False, deterministic=True)
    assert df.attrs["deterministic"] is True
