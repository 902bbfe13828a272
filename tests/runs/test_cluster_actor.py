"""A cluster actor writes the parts a single-process run writes, skips written traces, and
hands every error to the driver as it was raised (runs/cluster_actor.py).

The actor is a plain class that the driver makes a Ray actor; here it runs in this
process, on the embedded model's prefill engine.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from trace_replay.engines.validate import ImpossibleResult
from trace_replay.runs.checkpoint import Checkpoint
from trace_replay.runs.cluster_actor import ReplayActor, engine_facts, pack
from trace_replay.runs.replay import prepare_run, replay
from trace_replay.traces.sets import load_traces

pytestmark = pytest.mark.slow

OPTIONS = {"name": "prefill", "device": "cpu", "batch_size": 2, "top_k": 3}
TOL = 1e-4  # the same computation in another batch; a wrong trace is off by far more


@pytest.fixture(scope="module")
def facts():
    return engine_facts(OPTIONS)


@pytest.fixture(scope="module")
def run(facts, real_records):
    """Three of the real traces, tokenized, and their requests."""
    traces = load_traces(real_records[:3])
    traces, requests, _ = prepare_run(
        traces,
        tokenizer=facts.tokenizer,
        vocab_size=facts.vocab_size,
        max_model_len=facts.max_model_len,
        top_k=3,
        truncate=False,
    )
    return traces, requests


def _open(folder, facts, run) -> Checkpoint:
    """The folder as the driver opens it (settings.json written), and each trace's digest."""
    traces, requests = run
    return Checkpoint(folder, facts.keyed, requests, {t.id: t for t in traces})


def _batch(folder, facts, run) -> bytes:
    traces, requests = run
    with _open(folder, facts, run) as store:
        by_id = {t.id: t for t in traces}
        items = [(store.digest(r), r, by_id[r.trace_id]) for r in requests]
        return pack(items)


def _actor(folder, facts) -> ReplayActor:
    return ReplayActor(OPTIONS, str(folder), facts.keyed, labelled=False, every_s=10.0)


def _error(rows) -> BaseException:
    assert len(rows["error"]) == 1 and rows["error"][0], "the batch did not fail"
    return pickle.loads(rows["error"][0])


def test_a_batch_becomes_parts_a_single_process_run_resumes(tmp_path, facts, run):
    """Every trace of a batch is written with the run's settings key: a single-process run
    on the folder resumes all of them and serves the rows a replay computes."""
    batch = _batch(tmp_path, facts, run)
    rows = _actor(tmp_path, facts).score(batch)
    assert not any(rows["error"])
    assert rows["trace_id"].tolist() == [r.trace_id for r in run[1]]
    with _open(tmp_path, facts, run) as store:
        assert store.resumed == len(run[1])
        served = store.read()
    want = replay(run[0], engine="prefill", device="cpu", batch_size=2, top_k=3, progress=False)
    assert served["token_id"].tolist() == want["token_id"].tolist()
    np.testing.assert_allclose(served["logprob"], want["logprob"], atol=TOL, rtol=0)


def test_written_traces_are_not_computed_again(tmp_path, facts, run):
    """A batch given again (as Ray retries one whose actor died) to a new actor computes
    none of the traces already in a part: no part is added."""
    batch = _batch(tmp_path, facts, run)
    _actor(tmp_path, facts).score(batch)
    parts = sorted(tmp_path.glob("part-*.parquet"))
    rows = _actor(tmp_path, facts).score(batch)
    assert not any(rows["error"]) and sorted(tmp_path.glob("part-*.parquet")) == parts


class NaNAt:
    """A real engine whose result for one trace gets a NaN logprob at step 1."""

    def __init__(self, engine, trace_id):
        self.engine, self.trace_id = engine, trace_id

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, requests, on_tokens=None):
        results = self.engine.run(requests, on_tokens=on_tokens)
        for i, result in enumerate(results):
            if result.trace_id == self.trace_id:
                logprob = result.logprob.copy()
                logprob[1] = np.nan
                results[i] = replace(result, logprob=logprob)
        return results


def test_an_impossible_score_is_the_error_and_the_rest_is_saved(tmp_path, facts, run):
    """A NaN logprob stops the batch with the ImpossibleResult naming its trace and step,
    unwrapped; the possible traces of the engine call that returned it are in a part."""
    batch = _batch(tmp_path, facts, run)
    actor = _actor(tmp_path, facts)
    actor.engine = NaNAt(actor.engine, "code")
    error = _error(actor.score(batch))
    assert isinstance(error, ImpossibleResult)
    assert (error.trace_id, error.step, error.field) == ("code", 1, "logprob")
    written = pd.concat(pd.read_parquet(p) for p in tmp_path.glob("part-*.parquet"))
    assert written["trace_id"].unique().tolist() == ["paris"]  # its batch-mate; the third
    # trace was not reached, as a single-process run stops at the first impossible score


def test_rows_the_part_writer_refuses_stop_the_batch_and_the_rest_is_saved_once(
    tmp_path, facts, run, monkeypatch
):
    """A part write that refuses one trace's rows (a NaN that reached the writer; the
    engine-result check passed) writes its batch-mates and stops the batch with an error
    naming that trace; the batch-mates are in one part, not written again on the way out."""
    from trace_replay.runs import cluster_actor

    real = cluster_actor.write_checked

    def nan_for_code(folder, frame, *args, **kwargs):
        frame = frame.copy()
        frame.loc[frame["trace_id"] == "code", "logprob"] = np.nan
        return real(folder, frame, *args, **kwargs)

    monkeypatch.setattr(cluster_actor, "write_checked", nan_for_code)
    batch = _batch(tmp_path, facts, run)
    actor = ReplayActor(OPTIONS, str(tmp_path), facts.keyed, labelled=False, every_s=0.0)
    with pytest.warns(RuntimeWarning, match="finished traces not saved.*trace 'code'"):
        error = _error(actor.score(batch))  # the save on the way out refuses 'code' again
    assert isinstance(error, ImpossibleResult) and "trace 'code'" in str(error)
    written = pd.concat(pd.read_parquet(p) for p in tmp_path.glob("part-*.parquet"))
    assert written["trace_id"].unique().tolist() == ["paris"]
    assert not written.duplicated(["trace_id", "step"]).any()


def test_a_folder_the_node_cannot_see_is_named(tmp_path, facts):
    """An actor whose node does not find the driver's settings.json (no shared storage) says
    so at its first batch, and builds no engine."""
    rows = _actor(tmp_path / "elsewhere", facts).score(pack([]))
    error = _error(rows)
    assert isinstance(error, FileNotFoundError) and "not visible on node" in str(error)


def test_an_engine_with_other_settings_than_the_runs_is_refused(tmp_path, facts, run):
    """An actor whose engine's settings differ from the run's (a node of another kind)
    refuses its batches, naming the settings that differ."""
    _batch(tmp_path, facts, run)  # the driver's settings.json
    other = {**facts.keyed, "top_k": 4}
    rows = ReplayActor(OPTIONS, str(tmp_path), other, labelled=False, every_s=10.0).score(pack([]))
    error = _error(rows)
    assert isinstance(error, ValueError) and "other settings than the run's (top_k)" in str(error)


def test_the_actor_sizes_engine_calls_as_a_single_process_run(tmp_path, run):
    """Engine calls grow from one engine batch to the work of about half the part interval,
    by the rule a single-process run uses (call_size): the same requests reach the engine
    in calls of the same sizes on both paths, not one engine batch at a time."""
    from trace_replay.engines import make_engine

    def recorded_calls(engine) -> list[int]:
        calls, run_engine = [], engine.run

        def recorded(requests, **kwargs):
            calls.append(len(requests))
            return run_engine(requests, **kwargs)

        engine.run = recorded
        return calls

    options = dict(OPTIONS, batch_size=1)
    one = engine_facts(options)
    traces, requests = run
    with Checkpoint(tmp_path / "a", one.keyed, requests, {t.id: t for t in traces}) as store:
        items = [(store.digest(r), r, t) for r, t in zip(requests, traces)]
    actor = ReplayActor(options, str(tmp_path / "a"), one.keyed, labelled=False, every_s=10.0)
    actor_calls = recorded_calls(actor.engine)
    rows = actor.score(pack(items))
    assert not any(rows["error"])

    with make_engine(**options) as engine:
        single_calls = recorded_calls(engine)
        replay(
            traces,
            engine=engine,
            checkpoint=tmp_path / "s",
            chunk_size=len(requests),
            progress=False,
        )
    assert actor_calls == single_calls == [1, len(requests) - 1]
