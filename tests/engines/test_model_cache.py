"""ModelCache: one load or cast per (model, dtype, device); engines from settings dicts."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.cache import ModelCache, split_settings


def test_split_settings_defaults_to_torch():
    """The engine defaults to torch and the model to None; the rest passes through."""
    assert split_settings({"dtype": "bf16", "deterministic": True}) == (
        "torch",
        None,
        {"dtype": "bf16", "deterministic": True},
    )


@pytest.mark.slow
def test_module_used_as_is_or_cast_once(lm):
    """A matching in-memory model is used itself; another dtype is one cached cast copy."""
    cache = ModelCache()
    assert cache.get(lm) is lm
    assert cache.get(lm, dtype="float32", device="cpu") is lm
    half = cache.get(lm, dtype="bfloat16")
    assert half is not lm and next(half.parameters()).dtype == torch.bfloat16
    assert cache.get(lm, dtype="bf16") is half
    assert next(lm.parameters()).dtype == torch.float32
    assert len(cache) == 1


@pytest.mark.slow
def test_engine_passes_options_through(lm):
    """Engine options reach make_engine unchanged (an unknown one is make_engine's error)."""
    cache = ModelCache()
    with cache.engine({"model": lm, "engine": "prefill", "batch_size": 3}) as engine:
        assert (engine.name, engine.batch_size) == ("prefill", 3)
    with pytest.raises(ValueError, match="does not take"):
        cache.engine({"model": lm, "engine": "prefill", "no_such_option": 1})
