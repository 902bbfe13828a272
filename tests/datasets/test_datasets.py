"""Tests for trace_replay.datasets: the bundled traces load by name, match data/README.md,
and are what the README says they are."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from trace_replay import datasets
from trace_replay.traces.sets import load_traces

README = Path(__file__).resolve().parents[2] / "data" / "README.md"
# (dataset, source) -> (rows, id prefix, max trace tokens), as stated in data/README.md
FILES = {
    ("humaneval", "human"): (24, "he-human/", 128),
    ("humaneval", "model"): (24, "he-model/", 256),
    ("gsm8k_cot", "human"): (8, "gsm8k-human/", 128),
    ("gsm8k_cot", "model"): (8, "gsm8k-model/", 256),
}
MODEL_SETS = [key for key in FILES if key[1] == "model"]
HUMAN_SETS = [key for key in FILES if key[1] == "human"]
MAX_PROMPT_TOKENS = 256
MAX_TOTAL_BYTES = 1 << 20


def _id(key: tuple[str, str]) -> str:
    return "-".join(key)


@pytest.fixture(scope="module")
def tokenized(tokenizer):
    return {key: datasets.load(key[0], source=key[1]).tokenize(tokenizer) for key in FILES}


# --- the API ---------------------------------------------------------------------------------


def test_load_takes_the_first_traces_of_each_file():
    """load(name, source, limit) gives the file's first ``limit`` traces, in file order."""
    full = datasets.load("humaneval", source="human")
    first = datasets.load("humaneval", source="human", limit=8)
    assert first.ids == full.ids[:8] == [f"he-human/{i}" for i in range(8)]
    assert list(first) == list(full)[:8]


def test_load_without_name_or_source_is_everything():
    """load() holds every bundled trace once: datasets in name order, human before model."""
    everything = datasets.load()
    parts = [
        datasets.load(name, source=source)
        for name in ("gsm8k_cot", "humaneval")
        for source in datasets.SOURCES
    ]
    assert everything.ids == [i for part in parts for i in part.ids]
    assert len(everything) == sum(rows for rows, _, _ in FILES.values())
    assert datasets.load(limit=2).ids == [i for part in parts for i in part.ids[:2]]


def test_unknown_names_are_refused_with_the_choices():
    """An unknown dataset or source, or a negative limit, is a ValueError naming what exists."""
    with pytest.raises(ValueError, match="no bundled dataset 'mmlu'.*gsm8k_cot.*humaneval"):
        datasets.load("mmlu")
    with pytest.raises(ValueError, match="source must be one of human, model, got 'people'"):
        datasets.load("humaneval", source="people")
    with pytest.raises(ValueError, match="limit must be >= 0"):
        datasets.load(limit=-1)


def test_available_counts_every_file():
    """available() has one row per file, and its counts are what load() returns."""
    table = datasets.available()
    assert set(zip(table["dataset"], table["source"])) == set(FILES)
    for row in table.itertuples():
        assert row.traces == len(datasets.load(row.dataset, source=row.source))
        assert row.traces == FILES[row.dataset, row.source][0]


def test_readme_states_each_file_and_its_licence():
    """data/README.md lists every bundled file with its row count, and states each dataset's
    licence as available() reports it (the licences must stay written down with the data)."""
    readme = README.read_text()
    for row in datasets.available().itertuples():
        assert re.search(rf"\| `{row.file}` \| {row.traces} \|", readme), row.file
        section = readme[readme.index(f"`{row.dataset}_human.jsonl`, ") :]
        assert f"Licence: {row.licence}" in section.split("\n## ")[0], row.dataset
    assert "Apache-2.0" in readme  # the embedded model that wrote the model traces


@pytest.mark.parametrize("key", FILES, ids=_id)
def test_readme_table_states_the_token_counts(key, tokenized, tokenizer):
    """data/README.md's table gives each file's prompt and trace token totals (min–max) and how
    many model traces end at EOS, as the embedded tokenizer counts them."""

    def counts(lengths):
        return f"{sum(lengths)} ({min(lengths)}–{max(lengths)})"

    traces = tokenized[key]
    prompt = counts([len(t.prompt_token_ids) for t in traces])
    trace = counts([len(t.trace_token_ids) for t in traces])
    eos = (
        str(sum(t.trace_token_ids[-1] == tokenizer.eos_token_id for t in traces))
        if key[1] == "model"
        else "—"
    )
    row = f"| `{key[0]}_{key[1]}.jsonl` | {FILES[key][0]} | {prompt} | {trace} | {eos} |"
    assert row in README.read_text(), row


# --- what the bundled traces are ----------------------------------------------------------


@pytest.mark.parametrize("key", FILES, ids=_id)
def test_file_loads_and_tokenizes(key, tokenized):
    """Each bundled file tokenizes with the embedded tokenizer and has its stated rows."""
    assert len(tokenized[key]) == FILES[key][0]
    assert all(trace.is_tokenized for trace in tokenized[key])


def test_ids_unique_across_files():
    """Ids are unique across all bundled files, and each file uses its own prefix."""
    for (name, source), (_, prefix, _) in FILES.items():
        assert all(i.startswith(prefix) for i in datasets.load(name, source=source).ids)
    ids = datasets.load().ids
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("key", MODEL_SETS, ids=_id)
def test_model_traces_carry_ref_logprobs(key):
    """Every model-written trace stores its token ids and one finite logprob ≤ 0 per token."""
    for trace in datasets.load(key[0], source=key[1]):
        assert trace.trace_token_ids is not None
        assert len(trace.ref_logprobs) == len(trace.trace_token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in trace.ref_logprobs)


@pytest.mark.parametrize("key", MODEL_SETS, ids=_id)
def test_model_traces_record_their_generator(key):
    """Model-written traces name the embedded model, the torch engine in deterministic mode,
    greedy decoding and the token cap they stay within."""
    from trace_replay.models.load import EMBEDDED_MODEL

    for trace in datasets.load(key[0], source=key[1]):
        assert trace.meta["source"] == "model"
        recorded = trace.meta["recorded_with"]
        assert (recorded["model"], recorded["engine"]) == (EMBEDDED_MODEL, "torch")
        assert recorded["deterministic"] is True
        assert recorded["temperature"] == 0.0
        assert len(trace.trace_token_ids) <= recorded["max_tokens"] == FILES[key][2]


@pytest.mark.parametrize("key", MODEL_SETS, ids=_id)
def test_model_traces_are_chat_replies(key, tokenizer):
    """A model trace is a user turn and the assistant's reply: every trace token is the reply's
    (message 1), its text is the decoded ids, and they end with the end-of-turn token unless
    the reply ran into max_tokens."""
    for trace in datasets.load(key[0], source=key[1]):
        assert [m["role"] for m in trace.messages] == ["user", "assistant"], trace.id
        assert set(trace.trace_roles) == {"assistant"} and set(trace.trace_turns) == {1}
        ids = list(trace.trace_token_ids)
        ended = ids[-1] == tokenizer.eos_token_id
        assert ended or len(ids) == trace.meta["recorded_with"]["max_tokens"], trace.id
        assert trace.messages[1]["content"] == tokenizer.decode(ids[:-1] if ended else ids)


@pytest.mark.parametrize("key", MODEL_SETS, ids=_id)
def test_model_traces_render_from_their_messages(key, tokenizer):
    """The chat template renders a model trace's messages to its prompt ids, and to its trace
    ids exactly where ``meta["retokenizes"]`` says so (a cut reply: up to the end-of-turn token
    the template adds); the rows where the model wrote non-canonical tokens are few."""
    from trace_replay.traces.chat import tokenize_chat

    traces = datasets.load(key[0], source=key[1])
    for trace in traces:
        chat = tokenize_chat(tokenizer, trace.messages)
        assert chat.prompt_token_ids == list(trace.prompt_token_ids), trace.id
        ids = list(trace.trace_token_ids)
        ended = ids[-1] == tokenizer.eos_token_id
        rendered = chat.trace_token_ids if ended else chat.trace_token_ids[:-1]
        assert (rendered == ids) is trace.meta["retokenizes"], trace.id
    assert sum(not t.meta["retokenizes"] for t in traces) <= len(traces) // 4


@pytest.mark.parametrize("key", HUMAN_SETS, ids=_id)
def test_human_traces_are_text_only(key):
    """Human-written traces are stored as text, so any model replays them with its own tokenizer."""
    for trace in datasets.load(key[0], source=key[1]):
        assert trace.meta["source"] == "human"
        assert trace.prompt_token_ids is None and trace.trace_token_ids is None
        assert trace.ref_logprobs is None


@pytest.mark.parametrize("key", HUMAN_SETS, ids=_id)
def test_human_traces_split_on_a_token_boundary(key, tokenized, tokenizer):
    """The joined text has a token boundary exactly at the prompt's end: the prompt keeps all
    its own tokens and no trace token carries prompt text, so tokenizing prompt and trace
    apart would give the same ids."""
    for trace in tokenized[key]:
        assert "prompt_tail_in_trace" not in trace.meta, trace.id
        assert list(trace.prompt_token_ids) == tokenizer.encode(trace.prompt), trace.id
        assert list(trace.trace_token_ids) == tokenizer.encode(
            trace.completion, add_special_tokens=False
        ), trace.id


@pytest.mark.parametrize("name, key", [("humaneval", "task_id"), ("gsm8k_cot", "exemplar")])
def test_human_and_model_sets_share_problems(name, key):
    """The human and model files of a dataset cover the same problems in the same order (by
    ``meta``), and each model request holds its problem's text: the GSM8K question, the
    HumanEval prompt (human prompts are raw text, model requests chat turns)."""
    human, model = (datasets.load(name, source=source) for source in datasets.SOURCES)
    assert [t.meta[key] for t in human] == [t.meta[key] for t in model]
    for person, machine in zip(human, model):
        problem = person.prompt.removeprefix("Q: ").removesuffix("\nA:")
        assert problem in machine.messages[0]["content"], machine.id


@pytest.mark.parametrize("key", FILES, ids=_id)
def test_token_counts_within_bounds(key, tokenized):
    """Traces have 1..max tokens and prompts at most MAX_PROMPT_TOKENS (embedded tokenizer)."""
    max_trace_tokens = FILES[key][2]
    for trace in tokenized[key]:
        assert 1 <= len(trace.trace_token_ids) <= max_trace_tokens, trace.id
        assert len(trace.prompt_token_ids) <= MAX_PROMPT_TOKENS, trace.id


def test_bundled_files_are_small():
    """All bundled data files together stay under 1 MiB (they ship in the wheel)."""
    folder = Path(datasets.__file__).parent
    assert sum(path.stat().st_size for path in folder.glob("*.jsonl")) < MAX_TOTAL_BYTES


def test_files_are_what_load_traces_reads():
    """The package folder holds exactly the bundled files, each a valid trace file."""
    folder = Path(datasets.__file__).parent
    names = sorted(path.name for path in folder.glob("*.jsonl"))
    assert names == sorted(f"{name}_{source}.jsonl" for name, source in FILES)
    assert sum(len(load_traces(folder / name)) for name in names) == len(datasets.load())


def test_files_are_what_load_reads():
    """files(name) lists the package files holding the dataset, one per source, whose traces
    are load(name)'s; an unknown name is refused with the choices."""
    paths = datasets.files("gsm8k_cot")
    assert [Path(p).name for p in paths] == ["gsm8k_cot_human.jsonl", "gsm8k_cot_model.jsonl"]
    read = [trace.id for path in paths for trace in load_traces(path)]
    assert read == datasets.load("gsm8k_cot").ids
    with pytest.raises(ValueError, match="no bundled dataset 'gsm8k'; choose one of"):
        datasets.files("gsm8k")


def test_the_datasets_package_imports_by_its_dotted_name():
    """``trace_replay.datasets`` (in ``tr.__all__``) is a package of its own: the dotted import
    and ``from trace_replay.datasets import ...`` work, and are what ``tr.datasets`` gives."""
    import importlib

    import trace_replay as tr

    module = importlib.import_module("trace_replay.datasets")
    assert module is tr.datasets and "humaneval" in set(module.available()["dataset"])
