"""The engine interface (trace_replay.engines.base): EngineConfig's validation, and what
EngineBase gives every engine (settings, stats, close, ``with``, the lazy tokenizer)."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.base import Engine, EngineBase, EngineConfig, ReplayRequest

# --- EngineConfig: checked before any model is loaded ---------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"top_k": -1}, "top_k must be an integer >= 0, got -1"),
    ({"top_k": "5"}, "top_k must be an integer"),
    ({"top_k": 2.0}, "top_k must be an integer >= 0, got 2.0"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"batch_size": True}, "batch_size must be an integer"),
    ({"deterministic": 1}, "deterministic must be True or False, got 1"),
    ({"dtype": "float7"}, "float7"),
    ({"device": "gpu"}, "device .gpu. is not a device name"),
    ({"device": 0}, "device must be a str or torch.device, got int"),
    # no machine has 99 GPUs: either none at all, or too few
    ({"device": "cuda:99"}, "device 'cuda:99' (is not available|does not exist)"),
])  # fmt: skip
def test_config_refuses_bad_values(fields, message):
    """EngineConfig validates on construction, naming the field and the value."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_config_defaults_leave_choices_to_the_engine():
    """Unset model, dtype, device and batch size are None (each engine picks); top_k is 5 and
    deterministic off."""
    assert EngineConfig() == EngineConfig(model=None, dtype=None, device=None, batch_size=None,
                                          top_k=5, deterministic=False)


def test_config_takes_good_values():
    """Valid values are kept as given: a dtype by name or torch.dtype, a CPU device,
    top_k 0 (no alternatives)."""
    config = EngineConfig(dtype=torch.bfloat16, device=torch.device("cpu"), batch_size=3,
                          top_k=0, deterministic=True)
    assert (config.dtype, config.device, config.batch_size, config.top_k) == \
        (torch.bfloat16, torch.device("cpu"), 3, 0)
    assert EngineConfig(dtype="float16", device="cpu").dtype == "float16"


# --- EngineBase -----------------------------------------------------------------------------


class Counting(EngineBase):
    """EngineBase as a subclass fills it in (what its docstring asks), counting ``close``."""

    name = "counting"
    model_label, engine_path, dtype, device = "tiny", "count[test]", "float32", "cpu"
    batch_size, top_k = 2, 3
    closed = 0

    def run(self, requests, *, on_tokens=None):
        return []

    def close(self) -> None:
        self.closed += 1


def test_settings_are_the_common_provenance():
    """settings() names engine, path, model, dtype, device, slots, top_k and deterministic;
    selected_by only when make_engine("auto") set it."""
    engine = Counting()
    assert engine.settings() == {"engine": "counting", "engine_path": "count[test]",
                                 "model": "tiny", "dtype": "float32", "device": "cpu",
                                 "batch_size": 2, "top_k": 3, "deterministic": False}
    engine.selected_by = "auto: torch (vllm is not installed)"
    assert engine.settings()["selected_by"] == "auto: torch (vllm is not installed)"
    assert engine.stats() == {}


def test_with_block_closes_the_engine_even_on_error():
    """``with engine`` gives the engine itself and closes it once on leaving, also when the
    block raises (the error propagates)."""
    engine = Counting()
    with engine as entered:
        assert entered is engine and engine.closed == 0
    assert engine.closed == 1
    with pytest.raises(KeyError):
        with engine:
            raise KeyError("boom")
    assert engine.closed == 2


def test_a_subclass_with_run_is_an_engine(tokenizer):
    """EngineBase supplies all of the Engine protocol but ``run``."""
    base, counting = EngineBase(), Counting()
    # Python 3.11's protocol check reads every member, the lazy tokenizer too: give it one
    base.tokenizer = counting.tokenizer = tokenizer
    assert not isinstance(base, Engine)
    assert isinstance(counting, Engine)


def test_tokenizer_loads_once_from_its_source(tokenizer):
    """The tokenizer is loaded from ``tokenizer_source`` (None: the embedded model) on first
    use and kept; assigning one replaces it."""
    engine = Counting()
    text = "def add(a, b): return a + b"
    assert engine.tokenizer.encode(text) == tokenizer.encode(text)
    assert engine.tokenizer is engine.tokenizer
    engine.tokenizer = tokenizer
    assert engine.tokenizer is tokenizer


def test_request_lengths_count_its_tokens():
    """A request's prompt_len and trace_len are the lengths of its two token tuples."""
    request = ReplayRequest("a", (1, 2, 3), (4,))
    assert (request.prompt_len, request.trace_len) == (3, 1)
