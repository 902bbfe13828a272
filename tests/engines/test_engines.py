"""Tests for trace_replay.engines: make_engine and every engine (vLLM included)
keeping the Engine protocol on the embedded model."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from trace_replay.engines import ENGINES, Engine, make_engine
from trace_replay.engines.base import EngineClosed, ReplayRequest, check_engine

COMMON_SETTINGS = {"engine", "engine_path", "model", "dtype", "device", "batch_size", "top_k"}
TOP_K = 3
NAMES = [
    pytest.param("torch", marks=pytest.mark.slow),
    pytest.param("prefill", marks=pytest.mark.slow),
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.slow,
            pytest.mark.vllm,
            pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None,
                reason="vllm is not installed (pip install 'trace-replay[cpu]')",
            ),
        ],
    ),
]


# --- make_engine: checked before any model is loaded ---------------------------------------


def test_make_engine_refuses_an_unknown_engine():
    """An unknown name is a ValueError listing the engines."""
    choices = ", ".join(ENGINES)
    with pytest.raises(ValueError, match=f"unknown engine 'hf'; choose one of {choices}"):
        make_engine("hf")


def test_make_engine_refuses_options_the_engine_does_not_take():
    """An option of another engine is refused, naming what this one takes; None is no option."""
    with pytest.raises(
        ValueError,
        match=r"engine 'prefill' does not take speculative \(it takes "
        r"deterministic_attention\)",
    ):
        make_engine("prefill", speculative={"method": "trace"})
    with pytest.raises(
        ValueError,
        match=r"'torch' does not take engine_args \(it takes "
        r"speculative, backend, float32_matmul, batch1_fusions, "
        r"deterministic_attention\)",
    ):
        make_engine("torch", engine_args={})


def test_bad_settings_fail_before_the_model_loads(tmp_path):
    """A bad setting is reported even when the model does not exist: nothing was loaded yet."""
    with pytest.raises(ValueError, match="top_k"):
        make_engine("torch", tmp_path / "no-such-model", top_k=-1)


@pytest.mark.parametrize("name", ["torch", "prefill"])
def test_a_bad_deterministic_attention_fails_before_the_model_loads(tmp_path, name):
    """deterministic_attention is checked, naming its choices, before any model is read."""
    with pytest.raises(
        ValueError, match="deterministic_attention='cols'; choose one of tiles, rows"
    ):
        make_engine(name, tmp_path / "no-such-model", deterministic_attention="cols")


@pytest.mark.slow
def test_auto_with_speculative_picks_torch_and_says_why(lm):
    """auto with speculative settings chooses the torch engine and records why."""
    engine = make_engine("auto", lm, speculative={"method": "trace", "num_tokens": 2})
    assert engine.name == "torch"
    assert (
        engine.settings()["selected_by"]
        == "auto: torch (speculative verify runs in the torch engine)"
    )


# --- every engine keeps the protocol -------------------------------------------------------


@pytest.fixture(scope="module", params=NAMES)
def engine(request, lm):
    """Each engine on the embedded model, float32, 2 slots, used as a context manager."""
    options = {"engine_args": {"max_model_len": 512, "max_num_batched_tokens": 512}}
    model = None if request.param == "vllm" else lm  # vLLM loads the weights itself
    with make_engine(
        request.param,
        model,
        batch_size=2,
        top_k=TOP_K,
        **(options if request.param == "vllm" else {}),
    ) as engine:
        yield engine
    # leaving the with-block closed it: the model (and vLLM's engine core) is released
    assert getattr(engine, "lm", None) is None and getattr(engine, "llm", None) is None


@pytest.fixture(scope="module")
def requests(real_traces):
    return [ReplayRequest(t.id, t.prompt_token_ids, t.trace_token_ids) for t in real_traces]


def test_is_an_engine(engine, tokenizer, lm):
    """Every engine satisfies the Engine protocol, the decode engines can also generate, and
    the tokenizer and vocabulary are the model's."""
    assert isinstance(engine, Engine)
    check_engine(engine)
    assert engine.can_generate == (engine.name != "prefill")
    text = "def add(a, b): return a + b"
    assert engine.tokenizer.encode(text) == tokenizer.encode(text)
    assert engine.vocab_size == lm.get_output_embeddings().weight.shape[0]


def test_activations_are_the_forwards_run_here(engine, lm):
    """torch (hf backend) and prefill forwards call the modules of the model given, in this
    process; vLLM's run in its engine core and the static backend's in compiled graphs, so
    they have none to give and say so."""
    if engine.name == "vllm":
        with pytest.raises(NotImplementedError, match="engine 'vllm' runs its model outside"):
            engine.activations()
    elif "[static" in engine.settings()["engine_path"]:
        with pytest.raises(NotImplementedError, match="backend='hf'"):
            engine.activations()
    else:
        source = engine.activations()
        assert source.model is lm and source.rows is None


def test_run_returns_one_result_per_request_in_order(engine, requests):
    """run keeps the requests' order (several waves of 2 slots); each result has one entry per
    trace token, the trace's own tokens, and scores in range."""
    results = engine.run(requests)
    assert [r.trace_id for r in results] == [r.trace_id for r in requests]
    for result, request in zip(results, requests):
        assert result.prompt_len == request.prompt_len
        assert result.token_ids.tolist() == list(request.trace_token_ids)
        assert result.top_token_ids.shape == result.top_logprobs.shape == (request.trace_len, TOP_K)
        assert (result.logprob <= 0).all() and (result.rank >= 1).all()


def test_settings_are_fixed_provenance(engine, requests):
    """settings() names engine, path, model, dtype, device, batch size and top_k; it is
    JSON-ready (it goes into df.attrs and Parquet) and a run does not change it."""
    before = engine.settings()
    assert COMMON_SETTINGS <= set(before)
    assert (before["engine"], before["dtype"], before["batch_size"], before["top_k"]) == (
        engine.name,
        "float32",
        2,
        TOP_K,
    )
    json.dumps(before)
    engine.run(requests[:1])
    assert engine.settings() == before


def test_stats_are_apart_from_settings(engine, requests):
    """stats() is a dict of run statistics, none of them a setting; counts only grow."""
    first = engine.stats()
    assert isinstance(first, dict) and not set(first) & COMMON_SETTINGS
    engine.run(requests[:2])
    second = engine.stats()
    for key, value in first.items():
        if isinstance(value, (int, np.integer)):
            assert second[key] >= value, key


# --- last: a closed engine (this closes the module's engine; its teardown closes it again) ---


def test_a_closed_engine_says_it_is_closed(engine, requests, real_traces, tmp_path):
    """After close(), run, generate, weights_digest, activations and replay, with or without
    a checkpoint, raise EngineClosed naming the engine and what was asked, not an
    AttributeError from the model it released; settings still answer. (Last in this module:
    it closes the engine the tests above share.)"""
    from trace_replay.runs.replay import replay

    engine.close()
    closed = rf"engine '{engine.name}' is closed: "
    with pytest.raises(EngineClosed, match=closed + r"run\(\) needs what close\(\)"):
        engine.run(requests[:1])
    for method in ("weights_digest", "activations"):
        with pytest.raises(EngineClosed, match=closed + method):
            getattr(engine, method)()
    if engine.can_generate:
        with pytest.raises(EngineClosed, match=closed + "generate"):
            engine.generate([[1, 2]], max_tokens=2)
    # every replay reads the weights' digest for its attrs first
    for checkpoint in (None, tmp_path / "run"):
        with pytest.raises(EngineClosed, match=closed + "weights_digest"):
            replay(real_traces, engine=engine, progress=False, checkpoint=checkpoint)
    assert not list(tmp_path.glob("run/*"))  # refused before the folder took its settings
    assert engine.settings()["engine"] == engine.name
