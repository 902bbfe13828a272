"""Engines replay builds by name: started once per process, reused, closed at exit."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import trace_replay.engines
from trace_replay.runs import kept_engines
from trace_replay.runs.kept_engines import KeptEngineWarning, close_engines
from trace_replay.runs.replay import replay

TRACES = [{"id": "paris", "prompt": "The capital of France is", "completion": " Paris."}]
OUT_OF_VOCAB = [{"id": "e", "prompt_token_ids": [1], "trace_token_ids": [10**6]}]
# said once per process: whichever test keeps an engine first gets it
pytestmark = pytest.mark.filterwarnings("ignore::trace_replay.runs.kept_engines.KeptEngineWarning")


@pytest.fixture
def builds(monkeypatch):
    """The engines make_engine built during the test, by name (the real make_engine runs);
    no engine is kept before or after the test."""
    close_engines()
    made = []
    real = trace_replay.engines.make_engine

    def counting(name, *args, **kwargs):
        made.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(trace_replay.engines, "make_engine", counting)
    yield made
    close_engines()


@pytest.mark.slow
def test_a_name_starts_its_engine_once_and_says_so_once(builds, monkeypatch):
    """Two replays by name with the same settings (verbose aside: it only shows start-up
    logging) start one torch engine; the first says, once, that it is kept; close_engines
    releases it, and the next call starts another."""
    monkeypatch.setattr(kept_engines, "_said", False)
    with pytest.warns(KeptEngineWarning, match="close_engines"):
        first = replay(TRACES, engine="torch", top_k=2, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeptEngineWarning)
        again = replay(TRACES, engine="torch", top_k=2, progress=False, verbose=True)
    assert builds == ["torch"]
    assert again[["token_id", "rank"]].equals(first[["token_id", "rank"]])
    assert close_engines() == 1
    replay(TRACES, engine="torch", top_k=2, progress=False)
    assert builds == ["torch", "torch"]


@pytest.mark.slow
def test_an_engine_that_failed_is_started_again(builds):
    """An engine that fails under a replay (here closed behind the cache, as a dead engine
    process would be) is closed and forgotten: the next call starts a new one and replays;
    bad traces (a ValueError) leave the kept engine in place."""
    replay(TRACES, engine="prefill", top_k=2, progress=False)
    with pytest.raises(ValueError, match="out of vocab"):  # found once the engine runs
        replay(OUT_OF_VOCAB, engine="prefill", top_k=2, progress=False)
    assert builds == ["prefill"]
    (kept,) = [entry.engine for entry in kept_engines._kept.values()]
    kept.close()
    with pytest.raises(Exception):  # noqa: B017 - whatever a closed engine raises
        replay(TRACES, engine="prefill", top_k=2, progress=False)
    assert replay(TRACES, engine="prefill", top_k=2, progress=False)["rank"].tolist() == [1, 1]
    assert builds == ["prefill", "prefill"]


def test_the_key_holds_every_setting_that_configures_an_engine(tmp_path):
    """Another setting or engine_args value is another engine; a model folder's weights
    rewritten in place change the weights part of the key; servers and models in memory are
    not kept."""
    import torch

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"0" * 8)
    config = {
        "dtype": "float32",
        "device": "cpu",
        "batch_size": 2,
        "top_k": 3,
        "speculative": None,
        "engine_args": None,
        "deterministic": False,
    }

    def key(name="torch", model=folder, **changes):
        return kept_engines._key(name, model, {**config, **changes})

    identity, weights = key()
    assert key(dtype=torch.float32) == (identity, weights)  # one dtype, however spelled
    for change in (
        {"top_k": 4},
        {"batch_size": 3},
        {"dtype": "bfloat16"},
        {"deterministic": True},
        {"engine_args": {"max_model_len": 512}},
    ):
        assert key(**change)[0] != identity, change
    assert key(name="prefill")[0] != identity
    (folder / "model.safetensors").write_bytes(b"1" * 9)  # retrained in place
    assert key() != (identity, weights) and key()[0] == identity
    assert key(name="vllm-server") is None
    assert key(model=torch.nn.Linear(1, 1)) is None
    assert key(model=tmp_path / "missing") is None  # make_engine says what is wrong


@pytest.mark.slow
def test_an_engine_object_passed_is_never_closed(lm, builds):
    """An engine object passed to replay is the caller's: neither a finished replay nor a
    failed one closes it, and nothing is kept."""
    engine = trace_replay.engines.make_engine("prefill", lm, top_k=2)
    replay(TRACES, engine=engine, progress=False)
    with pytest.raises(ValueError, match="out of vocab"):
        replay(OUT_OF_VOCAB, engine=engine, progress=False)
    assert engine.lm is not None and builds == ["prefill"] and not kept_engines._kept
    assert replay(TRACES, engine=engine, progress=False)["rank"].tolist() == [1, 1]


@pytest.mark.slow
def test_kept_engines_are_closed_at_exit(tmp_path):
    """A process that replayed by name closes the kept engine when it exits."""
    script = f"""
import trace_replay as tr
from trace_replay.runs import kept_engines
tr.replay({TRACES!r}, engine="prefill", top_k=1, progress=False)
(entry,) = kept_engines._kept.values()
close = entry.engine.close
def closing():
    print("closed at exit", flush=True)
    close()
entry.engine.close = closing
print("replayed", flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["replayed", "closed", "at", "exit"]
    assert "KeptEngineWarning" in done.stderr
