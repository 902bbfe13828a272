"""Tests for the bundled datasets in data/: they load, tokenize, and match data/README.md."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trace_replay.traces import load_traces

DATA = Path(__file__).resolve().parents[1] / "data"
# file -> (rows, id prefix, max trace tokens), as stated in data/README.md
FILES = {
    "humaneval_human.jsonl": (24, "he-human/", 128),
    "humaneval_model.jsonl": (24, "he-model/", 96),
    "gsm8k_cot_human.jsonl": (8, "gsm8k-human/", 128),
    "gsm8k_cot_model.jsonl": (8, "gsm8k-model/", 96),
}
MODEL_FILES = [name for name in FILES if name.endswith("_model.jsonl")]
HUMAN_FILES = [name for name in FILES if name.endswith("_human.jsonl")]
MAX_PROMPT_TOKENS = 256
MAX_TOTAL_BYTES = 1 << 20


@pytest.fixture(scope="module")
def tokenizer():
    from trace_replay.models import ModelNotFoundError, load_tokenizer

    try:
        return load_tokenizer()
    except ModelNotFoundError as error:
        pytest.skip(f"embedded tokenizer unavailable: {error}")


@pytest.fixture(scope="module")
def tokenized(tokenizer):
    return {name: load_traces(DATA / name, tokenizer=tokenizer) for name in FILES}


@pytest.mark.parametrize("name", FILES)
def test_file_loads_and_tokenizes(name, tokenized):
    """Each bundled file loads, tokenizes with the embedded tokenizer, and has its stated rows."""
    rows, _, _ = FILES[name]
    assert len(tokenized[name]) == rows
    assert all(trace.is_tokenized for trace in tokenized[name])


def test_ids_unique_across_files():
    """Ids are unique across all bundled files, and each file uses its own prefix."""
    ids = []
    for name, (_, prefix, _) in FILES.items():
        file_ids = load_traces(DATA / name).ids
        assert all(trace_id.startswith(prefix) for trace_id in file_ids)
        ids += file_ids
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_traces_carry_ref_logprobs(name):
    """Every model-written trace stores its token ids and one finite logprob ≤ 0 per token."""
    for trace in load_traces(DATA / name):
        assert trace.trace_token_ids is not None
        assert len(trace.ref_logprobs) == len(trace.trace_token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in trace.ref_logprobs)


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_traces_record_their_generator(name):
    """Model-written traces name the embedded model, the torch engine and greedy decoding."""
    from trace_replay.models import EMBEDDED_MODEL

    for trace in load_traces(DATA / name):
        assert trace.meta["source"] == "model"
        recorded = trace.meta["recorded_with"]
        assert (recorded["model"], recorded["engine"]) == (EMBEDDED_MODEL, "torch")
        assert recorded["temperature"] == 0.0


@pytest.mark.parametrize("name", HUMAN_FILES)
def test_human_traces_are_text_only(name):
    """Human-written traces are stored as text, so any model replays them with its own tokenizer."""
    for trace in load_traces(DATA / name):
        assert trace.meta["source"] == "human"
        assert trace.prompt_token_ids is None and trace.trace_token_ids is None
        assert trace.ref_logprobs is None


@pytest.mark.parametrize("name", HUMAN_FILES)
def test_human_traces_split_on_a_token_boundary(name, tokenized, tokenizer):
    """The joined text has a token boundary exactly at the prompt's end: the prompt keeps all
    its own tokens and no trace token carries prompt text, so tokenizing prompt and trace
    apart would give the same ids."""
    for trace in tokenized[name]:
        assert "prompt_tail_in_trace" not in trace.meta, trace.id
        assert list(trace.prompt_token_ids) == tokenizer.encode(trace.prompt), trace.id
        assert list(trace.trace_token_ids) == tokenizer.encode(
            trace.completion, add_special_tokens=False), trace.id


@pytest.mark.parametrize("dataset, key", [("humaneval", "task_id"), ("gsm8k_cot", "exemplar")])
def test_human_and_model_sets_share_prompts(dataset, key):
    """The human and model files of a dataset cover the same problems with the same prompts."""
    human, model = (load_traces(DATA / f"{dataset}_{source}.jsonl")
                    for source in ("human", "model"))
    assert [t.meta[key] for t in human] == [t.meta[key] for t in model]
    assert [t.prompt for t in human] == [t.prompt for t in model]


@pytest.mark.parametrize("name", FILES)
def test_token_counts_within_bounds(name, tokenized):
    """Traces have 1..max tokens and prompts at most MAX_PROMPT_TOKENS (embedded tokenizer)."""
    _, _, max_trace_tokens = FILES[name]
    for trace in tokenized[name]:
        assert 1 <= len(trace.trace_token_ids) <= max_trace_tokens, trace.id
        assert len(trace.prompt_token_ids) <= MAX_PROMPT_TOKENS, trace.id


def test_bundled_files_are_small():
    """All bundled data files together stay under 1 MiB."""
    assert sum((DATA / name).stat().st_size for name in FILES) < MAX_TOTAL_BYTES
