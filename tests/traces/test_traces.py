"""Tests for trace_replay.traces.sets: loading, validation, tokenization, sharding and saving."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_replay.traces.sets import Trace, TraceError, TraceSet, load_traces

RECORDS = [
    {
        "id": "he/0",
        "prompt_token_ids": [1, 2, 3],
        "trace_token_ids": [4, 5],
        "ref_logprobs": [-0.5, -1.25],
        "meta": {"task": "HumanEval/0", "n": 1},
    },
    {"id": "he/1", "prompt": "def add(a, b):", "completion": "\n    return a + b"},
    {"id": 7, "prompt": "Hi", "prompt_token_ids": [9], "trace_token_ids": [10, 11, 12]},
]
EXPECTED = TraceSet(
    [
        Trace(
            "he/0",
            prompt_token_ids=(1, 2, 3),
            trace_token_ids=(4, 5),
            ref_logprobs=(-0.5, -1.25),
            meta={"task": "HumanEval/0", "n": 1},
        ),
        Trace("he/1", prompt="def add(a, b):", completion="\n    return a + b"),
        Trace("7", prompt="Hi", prompt_token_ids=(9,), trace_token_ids=(10, 11, 12)),
    ]
)
GOOD = {"id": "ok", "prompt_token_ids": [1], "trace_token_ids": [2]}
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


class FakeDataset:
    """Duck-types a Hugging Face ``datasets.Dataset``: only ``to_pandas`` is used."""

    def __init__(self, records):
        self._records = records

    def to_pandas(self) -> pd.DataFrame:
        return pd.DataFrame(self._records)


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_jsonl(path, records):
    return write_lines(path, [json.dumps(record) for record in records])


def write_parquet(path, records):
    # A Parquet column has one type: ids as str, meta as its JSON string.
    rows = [
        {**r, "id": str(r["id"]), "meta": json.dumps(r["meta"]) if "meta" in r else None}
        for r in records
    ]
    pd.DataFrame(rows).to_parquet(path)
    return path


SOURCES = {
    "list": lambda tmp_path: RECORDS,
    "generator": lambda tmp_path: (record for record in RECORDS),
    "jsonl": lambda tmp_path: write_jsonl(tmp_path / "t.jsonl", RECORDS),
    "jsonl-str-path": lambda tmp_path: str(write_jsonl(tmp_path / "t.jsonl", RECORDS)),
    "json-list": lambda tmp_path: write_lines(tmp_path / "t.json", [json.dumps(RECORDS)]),
    "json-object": lambda tmp_path: write_lines(
        tmp_path / "t.json", [json.dumps({"traces": RECORDS})]
    ),
    "parquet": lambda tmp_path: write_parquet(tmp_path / "t.parquet", RECORDS),
    "dataframe": lambda tmp_path: pd.DataFrame(RECORDS),
    "dataset": lambda tmp_path: FakeDataset(RECORDS),
}


@pytest.mark.parametrize("kind", SOURCES)
def test_every_source_kind_loads_the_same_traces(kind, tmp_path):
    """Each source kind yields the same traces, in order, with int ids turned into str."""
    assert load_traces(SOURCES[kind](tmp_path)) == EXPECTED


def test_trace_normalizes_sequences_to_python_tuples():
    """A Trace stores token ids as tuples of int and logprobs as tuples of float."""
    trace = Trace(
        "a",
        prompt_token_ids=np.array([1, 2]),
        trace_token_ids=[np.int32(3)],
        ref_logprobs=[np.float32(-1.0)],
    )
    assert trace.prompt_token_ids == (1, 2) and type(trace.prompt_token_ids[0]) is int
    assert trace.trace_token_ids == (3,) and type(trace.ref_logprobs[0]) is float
    assert trace.is_tokenized and not Trace("b", prompt="p", trace_token_ids=[1]).is_tokenized


def test_numpy_integer_id_becomes_str():
    """An integer id, numpy or not, is stored as its decimal string."""
    assert load_traces([{**GOOD, "id": np.int64(12)}]).ids == ["12"]


def test_load_traces_returns_a_traceset_unchanged():
    """Passing a TraceSet without a tokenizer returns that same object."""
    assert load_traces(EXPECTED) is EXPECTED


def test_jsonl_keeps_both_text_and_ids():
    """A record with both prompt text and prompt ids keeps both."""
    trace = load_traces([RECORDS[2]])[0]
    assert trace.prompt == "Hi" and trace.prompt_token_ids == (9,)


BAD_RECORDS = {
    "missing prompt": (
        {"id": "bad", "trace_token_ids": [1]},
        "missing prompt: give 'prompt' or 'prompt_token_ids'",
    ),
    "missing trace": (
        {"id": "bad", "prompt": "p"},
        "missing trace: give 'trace_token_ids' or 'completion'",
    ),
    "empty trace": (
        {"id": "bad", "prompt": "p", "trace_token_ids": []},
        "trace_token_ids is empty",
    ),
    "empty completion": ({"id": "bad", "prompt": "p", "completion": ""}, "completion is empty"),
    "empty prompt ids": (
        {"id": "bad", "prompt_token_ids": [], "completion": "c"},
        "prompt_token_ids is empty",
    ),
    "negative id": (
        {**GOOD, "id": "bad", "trace_token_ids": [1, -2]},
        "trace_token_ids[1] = -2 is negative",
    ),
    "float token": (
        {**GOOD, "id": "bad", "trace_token_ids": [3.0]},
        "trace_token_ids[0] = 3.0 is not an integer (float)",
    ),
    "fractional token": (
        {**GOOD, "id": "bad", "prompt_token_ids": [3.5]},
        "prompt_token_ids[0] = 3.5 is not an integer (float)",
    ),
    "str token": (
        {**GOOD, "id": "bad", "trace_token_ids": ["3"]},
        "trace_token_ids[0] = '3' is not an integer (str)",
    ),
    "bool token": (
        {**GOOD, "id": "bad", "trace_token_ids": [True]},
        "trace_token_ids[0] = True is not an integer (bool)",
    ),
    "ids not a list": (
        {**GOOD, "id": "bad", "trace_token_ids": "1 2"},
        "trace_token_ids must be a list of ints, got str",
    ),
    "ref_logprobs length": (
        {**GOOD, "id": "bad", "ref_logprobs": [-1.0, -2.0]},
        "ref_logprobs has 2 values for 1 trace tokens",
    ),
    "ref_logprobs null": (
        {**GOOD, "id": "bad", "ref_logprobs": [None]},
        "ref_logprobs[0] = None is not a number",
    ),
    "meta not a dict": ({**GOOD, "id": "bad", "meta": [1]}, "meta must be a dict, got list"),
    "messages and prompt": (
        {"id": "bad", "prompt": "p", "messages": CHAT},
        "give either 'messages' or 'prompt'/'completion' text, not both",
    ),
    "messages not a list": (
        {"id": "bad", "messages": {"role": "user"}},
        "messages must be a list of message objects, got dict",
    ),
    "message without role": (
        {"id": "bad", "messages": [*CHAT, {"content": "x"}]},
        "messages[2] has no 'role'",
    ),
    "unknown turns": (
        {"id": "bad", "messages": CHAT, "turns": "first"},
        "turns must be one of 'last', 'all', got 'first'",
    ),
    "turns without messages": (
        {**GOOD, "id": "bad", "turns": "all"},
        "tools and turns apply to chat traces only (give 'messages')",
    ),
    "roles length": (
        {**GOOD, "id": "bad", "trace_turns": [1, 1], "trace_roles": ["a", "a"]},
        "trace_turns has 2 values for 1 trace tokens",
    ),
    "roles alone": (
        {**GOOD, "id": "bad", "trace_roles": ["assistant"]},
        "trace_turns and trace_roles come together",
    ),
    "labels without messages": (
        {**GOOD, "id": "bad", "trace_turns": [1], "trace_roles": ["assistant"]},
        "trace_turns and trace_roles label the tokens of a chat trace: give its 'messages'",
    ),
    "turn past the messages": (
        {**GOOD, "id": "bad", "messages": CHAT, "trace_turns": [3], "trace_roles": ["assistant"]},
        "trace_turns[0] = 3 is no message: messages has 2 (0-1; 2 is the reply to them)",
    ),
    "role not the message's": (
        {**GOOD, "id": "bad", "messages": CHAT, "trace_turns": [0], "trace_roles": ["assistant"]},
        "trace_roles[0] = 'assistant', but trace_turns[0] = 0 is "
        "messages[0], role 'user': the label must be 'user'",
    ),
    "template on a user turn": (
        {**GOOD, "id": "bad", "messages": CHAT, "trace_turns": [0], "trace_roles": ["template"]},
        "trace_roles[0] = 'template', but trace_turns[0] = 0 is "
        "messages[0], role 'user': the label must be 'user'",
    ),
    "reply not the assistant's": (
        {**GOOD, "id": "bad", "messages": CHAT, "trace_turns": [2], "trace_roles": ["user"]},
        "trace_roles[0] = 'user', but trace_turns[0] = 2 is the "
        "reply, role 'assistant': the label must be 'assistant' or "
        "'template'",
    ),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_invalid_record_error_names_line_and_trace(case, tmp_path):
    """An invalid record raises TraceError reading 'path:LINE: trace ID: problem'."""
    record, problem = BAD_RECORDS[case]
    path = write_lines(tmp_path / "x.jsonl", [json.dumps(GOOD), "", json.dumps(record)])
    with pytest.raises(TraceError) as info:
        load_traces(path)
    assert str(info.value) == f"{path}:3: trace 'bad': {problem}"
    assert (info.value.location, info.value.trace_id) == (f"{path}:3", "bad")


def test_malformed_json_line_is_named(tmp_path):
    """A line that is not JSON is reported by its 1-based line number, blank lines counted."""
    path = write_lines(tmp_path / "x.jsonl", [json.dumps(GOOD), "", '{"id": "b", "prompt": '])
    with pytest.raises(TraceError, match=rf"^{path}:3: malformed JSON"):
        load_traces(path)


def test_malformed_json_file_names_its_line(tmp_path):
    """A .json file that does not parse is reported at the line where parsing failed."""
    path = write_lines(tmp_path / "x.json", ["[", json.dumps(GOOD) + ",", "{oops}", "]"])
    with pytest.raises(TraceError, match=rf"^{path}:3: malformed JSON"):
        load_traces(path)


@pytest.mark.parametrize(
    ("trace_id", "problem"),
    [
        (None, "missing 'id'"),
        (3.0, "id must be a str or int, got float 3.0"),
        (True, "id must be a str or int, got bool True"),
        ("", "id must be a non-empty str"),
        ("   ", "id must be a non-empty str, not only whitespace, got '   '"),
        ("\t\n", "id must be a non-empty str, not only whitespace"),
    ],
)
def test_bad_trace_id_is_rejected_at_its_line(trace_id, problem, tmp_path):
    """A missing, float, bool, empty or whitespace-only id is an error at the record's line."""
    record = {"prompt": "p", "completion": "c"} if trace_id is None else {**GOOD, "id": trace_id}
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD, record])
    with pytest.raises(TraceError, match=rf"^{path}:2: {problem}"):
        load_traces(path)


BAD_SOURCES = {
    "json": (
        lambda tmp_path, rows: write_lines(tmp_path / "x.json", [json.dumps(rows)]),
        "{path}[1]",
    ),
    "parquet": (lambda tmp_path, rows: write_parquet(tmp_path / "x.parquet", rows), "{path} row 1"),
    "dataframe": (lambda tmp_path, rows: pd.DataFrame(rows), "<DataFrame> row 1"),
    "list": (lambda tmp_path, rows: rows, "<list> row 1"),
    "dataset": (lambda tmp_path, rows: FakeDataset(rows), "<FakeDataset> row 1"),
}


@pytest.mark.parametrize("kind", BAD_SOURCES)
def test_error_location_names_the_row_of_each_source_kind(kind, tmp_path):
    """JSON errors name path[INDEX]; Parquet, DataFrame, Dataset and list errors name the row."""
    make, location = BAD_SOURCES[kind]
    source = make(tmp_path, [GOOD, {**GOOD, "id": "bad", "trace_token_ids": [1, -2]}])
    location = location.format(path=source)
    with pytest.raises(TraceError) as info:
        load_traces(source)
    assert str(info.value) == f"{location}: trace 'bad': trace_token_ids[1] = -2 is negative"


def test_out_of_vocab_id_names_line_and_trace(tmp_path):
    """With vocab_size, an id >= vocab_size is an error at the record's line."""
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD, {**GOOD, "id": "big", "trace_token_ids": [99]}])
    with pytest.raises(TraceError) as info:
        load_traces(path, vocab_size=50)
    assert str(info.value) == (
        f"{path}:2: trace 'big': trace_token_ids[0] = 99 is out of vocab (vocab_size=50)"
    )


def test_duplicate_ids_name_both_lines(tmp_path):
    """A repeated id (after int ids become str) names the repeat's line and the first one's."""
    path = write_jsonl(tmp_path / "x.jsonl", [{**GOOD, "id": 3}, GOOD, {**GOOD, "id": "3"}])
    with pytest.raises(TraceError) as info:
        load_traces(path)
    assert str(info.value) == f"{path}:3: trace '3': duplicate id (first at {path}:1)"


def test_traceset_rejects_duplicate_ids():
    """A TraceSet built in memory also refuses duplicate ids, naming both rows."""
    trace = Trace("a", prompt="p", completion="c")
    with pytest.raises(TraceError, match=r"<memory> row 1: trace 'a': duplicate id .*row 0"):
        TraceSet([trace, trace])


def test_invalid_last_record_fails_the_whole_load(tmp_path):
    """Nothing half-loaded: one bad record anywhere, even last, means no TraceSet at all."""
    records = [{**GOOD, "id": f"t{i}"} for i in range(50)] + [{"id": "last", "prompt": "p"}]
    with pytest.raises(TraceError, match=r"x.jsonl:51: trace 'last'"):
        load_traces(write_jsonl(tmp_path / "x.jsonl", records))


def test_unknown_turns_argument_is_refused():
    """load_traces(turns=...) accepts only 'last' and 'all'."""
    with pytest.raises(ValueError, match="turns must be one of 'last', 'all', got 'every'"):
        load_traces([GOOD], turns="every")


def test_unknown_file_type_is_an_error(tmp_path):
    """A path that is not .jsonl, .json or .parquet is refused by name."""
    with pytest.raises(TraceError, match="unknown trace file type"):
        load_traces(tmp_path / "traces.csv")


def test_trace_error_survives_pickling():
    """TraceError keeps its message and fields across processes."""
    error = pickle.loads(pickle.dumps(TraceError("bad", trace_id="a", location="f.jsonl:3")))
    assert str(error) == "f.jsonl:3: trace 'a': bad" and error.trace_id == "a"


trace_ids = st.lists(st.integers(0, 2**31), min_size=1, max_size=6).map(tuple)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
json_values = (
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | texts
    | st.floats(allow_nan=False, allow_infinity=False)
)


@st.composite
def chat_traces(draw, trace_id: str) -> Trace:
    roles = st.sampled_from(["system", "user", "assistant", "tool"])
    messages = draw(st.lists(st.fixed_dictionaries({"role": roles, "content": texts}), max_size=3))
    messages.append({"role": "assistant", "content": draw(texts)})
    token_ids = draw(st.none() | trace_ids)
    labelled = token_ids is not None and draw(st.booleans())
    return Trace(
        trace_id,
        messages=messages,
        trace_token_ids=token_ids,
        prompt_token_ids=None if token_ids is None else draw(st.none() | trace_ids),
        tools=draw(st.none() | st.just([{"type": "function", "function": {"name": "f"}}])),
        turns=draw(st.sampled_from([None, "last", "all"])),
        trace_turns=(len(messages),) * len(token_ids) if labelled else None,
        trace_roles=("assistant",) * len(token_ids) if labelled else None,
    )


@st.composite
def trace_sets(draw) -> TraceSet:
    traces = []
    for trace_id in draw(st.lists(texts.filter(str.strip), unique=True, max_size=5)):
        if draw(st.integers(0, 3)) == 0:
            traces.append(draw(chat_traces(trace_id)))
            continue
        prompt_ids = draw(st.none() | trace_ids)
        token_ids = draw(st.none() | trace_ids)
        traces.append(
            Trace(
                trace_id,
                prompt=draw(texts if prompt_ids is None else st.none() | texts),
                prompt_token_ids=prompt_ids,
                completion=draw(texts.filter(bool) if token_ids is None else st.none() | texts),
                trace_token_ids=token_ids,
                ref_logprobs=None
                if token_ids is None
                else draw(
                    st.none()
                    | st.lists(
                        st.floats(
                            min_value=-9999.0, max_value=0.0, exclude_min=True
                        ),  # -9999: -inf
                        min_size=len(token_ids),
                        max_size=len(token_ids),
                    )
                ),
                meta=draw(st.dictionaries(texts, json_values, max_size=3)),
            )
        )
    return TraceSet(traces)


round_trip = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@round_trip
@given(traces=trace_sets())
def test_jsonl_round_trip(traces, tmp_path):
    """to_jsonl then load_traces gives back an equal TraceSet."""
    traces.to_jsonl(tmp_path / "t.jsonl")
    assert load_traces(tmp_path / "t.jsonl") == traces


@round_trip
@given(traces=trace_sets())
def test_parquet_round_trip(traces, tmp_path):
    """to_parquet then load_traces gives back an equal TraceSet."""
    traces.to_parquet(tmp_path / "t.parquet")
    assert load_traces(tmp_path / "t.parquet") == traces


@round_trip
@given(traces=trace_sets())
def test_dataframe_round_trip(traces):
    """to_pandas then load_traces gives back an equal TraceSet."""
    assert load_traces(traces.to_pandas()) == traces


def test_gzipped_jsonl_round_trip(tmp_path):
    """A .jsonl.gz path is written and read compressed."""
    EXPECTED.to_jsonl(tmp_path / "t.jsonl.gz")
    assert (tmp_path / "t.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
    assert load_traces(tmp_path / "t.jsonl.gz") == EXPECTED


def test_to_pandas_has_one_row_per_trace_with_token_counts():
    """to_pandas has the record fields, token counts where known (<NA> otherwise) and the source."""
    frame = load_traces(RECORDS).to_pandas()
    assert list(frame["id"]) == ["he/0", "he/1", "7"]
    assert frame["n_trace_tokens"].tolist() == [2, pd.NA, 3]
    assert frame["meta"][0] == {"task": "HumanEval/0", "n": 1}
    assert frame.attrs["source"] == "<list>"


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """Writes are atomic: a write that fails midway leaves the previous file intact."""
    path = tmp_path / "t.jsonl"
    EXPECTED.to_jsonl(path)
    before = path.read_bytes()
    calls = iter(range(100))

    def failing_dumps(*args, **kwargs):
        if next(calls) == 1:
            raise OSError("disk full")
        return "{}"

    monkeypatch.setattr(json, "dumps", failing_dumps)
    with pytest.raises(OSError, match="disk full"):
        EXPECTED.to_jsonl(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]


def many_traces(n: int = 200) -> TraceSet:
    return TraceSet(Trace(f"t{i}", prompt="p", completion="c") for i in range(n))


def test_shards_partition_the_set_in_order():
    """The shards are disjoint, cover every trace, and keep the set's order."""
    traces = many_traces()
    shards = [traces.shard(i, 4) for i in range(4)]
    assert sorted(sum((shard.ids for shard in shards), [])) == sorted(traces.ids)
    assert sum(len(shard) for shard in shards) == len(traces)
    for shard in shards:
        assert shard.ids == [i for i in traces.ids if i in set(shard.ids)]


def test_shard_depends_only_on_the_trace_id():
    """A trace's shard does not move when other traces are added, removed or reordered."""
    traces = many_traces()
    reordered = TraceSet([*reversed(traces[50:]), Trace("new", prompt="p", completion="c")])
    for i in range(3):
        assert set(traces.shard(i, 3).ids) & set(reordered.ids) <= set(reordered.shard(i, 3).ids)


def test_shard_assignment_is_stable_across_processes():
    """Shards come from a fixed hash (not the per-process salted hash()), pinned here."""
    assert many_traces(10).shard(0, 3).ids == ["t0", "t4", "t5", "t7", "t8"]


@pytest.mark.parametrize(("index", "count"), [(-1, 2), (2, 2), (0, 0)])
def test_shard_rejects_an_index_outside_the_count(index, count):
    """shard needs 0 <= index < count."""
    with pytest.raises(ValueError, match="0 <= index < count"):
        many_traces(3).shard(index, count)


def test_select_keeps_set_order_and_rejects_unknown_ids():
    """select returns the named traces in the set's order; an unknown id is a KeyError."""
    traces = many_traces(5)
    assert traces.select(["t3", "t1"]).ids == ["t1", "t3"]
    assert traces.select("t2").ids == ["t2"]
    with pytest.raises(KeyError, match="nope"):
        traces.select(["t1", "nope"])


def test_exclude_is_the_complement_of_select():
    """exclude drops the named traces, ignoring ids that are absent."""
    assert many_traces(5).exclude(["t3", "t1", "nope"]).ids == ["t0", "t2", "t4"]


def test_indexing_gives_traces_and_slicing_gives_tracesets():
    """An int index gives a Trace; a slice gives a TraceSet with the same source."""
    traces = load_traces(RECORDS)
    assert traces[-1].id == "7"
    assert isinstance(traces[1:], TraceSet) and traces[1:].ids == ["he/1", "7"]
    assert repr(traces[:1]) == "TraceSet(1 trace, tokenized, source='<list>')"


def test_derived_sets_keep_the_original_error_locations(tmp_path):
    """After select, errors found later still name the trace's line in the file."""
    big = {**GOOD, "id": "big", "prompt_token_ids": [99]}
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD, big])
    with pytest.raises(TraceError, match=rf"^{path}:2: trace 'big': prompt_token_ids\[0\] = 99"):
        load_traces(path).select("big").validate_vocab(50)


def test_import_does_not_load_pandas_or_transformers():
    """Importing the module (and loading plain records) pulls in neither pandas nor transformers."""
    code = (
        "import sys, trace_replay.traces.sets as t; t.load_traces([{'id': 1, 'prompt': 'p', "
        "'completion': 'c'}]); print('pandas' in sys.modules, 'transformers' in sys.modules)"
    )
    assert subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split() == ["False", "False"]


def test_tokenize_splits_the_joined_text_at_the_prompt_end(tokenizer):
    """Prompt and completion text are tokenized together: prompt + trace ids are the joined
    text's ids, and the trace decodes back to the exact completion."""
    trace = load_traces(RECORDS).tokenize(tokenizer)[1]
    assert [*trace.prompt_token_ids, *trace.trace_token_ids] == tokenizer.encode(
        "def add(a, b):\n    return a + b", add_special_tokens=True
    )
    assert not set(trace.trace_token_ids) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(trace.trace_token_ids) == "\n    return a + b"


def test_tokenize_encodes_a_lone_completion_without_special_tokens(tokenizer):
    """Beside given prompt ids, a completion is encoded alone, without special tokens."""
    trace = load_traces(
        [{"id": "c", "prompt_token_ids": [1], "completion": " Paris."}], tokenizer=tokenizer
    )[0]
    assert list(trace.trace_token_ids) == tokenizer.encode(" Paris.", add_special_tokens=False)


def test_tokenize_encodes_prompt_and_keeps_text(tokenizer):
    """A prompt gets the tokenizer's ids (with its special tokens); the text fields stay."""
    trace = load_traces(RECORDS).tokenize(tokenizer)[1]
    assert trace.prompt_token_ids == tuple(
        tokenizer.encode("def add(a, b):", add_special_tokens=True)
    )
    assert (trace.prompt, trace.completion) == ("def add(a, b):", "\n    return a + b")
    assert trace.is_tokenized


def test_tokenize_keeps_existing_ids(tokenizer):
    """Ids given in the record win over its text: tokenize does not re-encode them."""
    assert load_traces(RECORDS).tokenize(tokenizer)[2].prompt_token_ids == (9,)


def test_load_with_tokenizer_equals_tokenize(tokenizer):
    """load_traces(source, tokenizer=t) is load_traces(source).tokenize(t)."""
    assert load_traces(RECORDS, tokenizer=tokenizer) == load_traces(RECORDS).tokenize(tokenizer)


def test_ref_logprobs_length_is_checked_after_tokenization(tokenizer, tmp_path):
    """ref_logprobs of a text completion is checked once its token count is known."""
    record = {"id": "c", "prompt": "Hi", "completion": " Paris.", "ref_logprobs": [-0.1]}
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD, record])
    traces = load_traces(path)
    n_tokens = len(tokenizer.encode(" Paris.", add_special_tokens=False))
    with pytest.raises(TraceError) as info:
        traces.tokenize(tokenizer)
    assert str(info.value) == (
        f"{path}:2: trace 'c': ref_logprobs has 1 values for {n_tokens} trace tokens"
    )


def test_tokenize_rejects_ids_beyond_a_small_vocab(tokenizer, tmp_path):
    """A completion whose tokens reach past vocab_size is rejected, naming the trace and line."""
    record = {"id": "v", "prompt_token_ids": [1], "completion": " antidisestablishmentarianism"}
    path = write_jsonl(tmp_path / "x.jsonl", [record])
    with pytest.raises(
        TraceError,
        match=rf"^{path}:1: trace 'v': trace_token_ids\[0\] = \d+ is "
        r"out of vocab \(vocab_size=100\)",
    ):
        load_traces(path, tokenizer=tokenizer, vocab_size=100)


def test_completion_that_tokenizes_to_nothing_is_an_error():
    """A completion with no tokens cannot be replayed; the error names the trace."""

    class EmptyTokenizer:
        def encode(self, text, add_special_tokens):
            return [1] if add_special_tokens else []

        def __len__(self):
            return 10

    with pytest.raises(TraceError, match=r"^<list> row 0: trace 'e': completion tokenizes to no"):
        load_traces([{"id": "e", "prompt": "p", "completion": "c"}], tokenizer=EmptyTokenizer())


def test_tokenize_keeps_a_tokenized_record_and_labels_a_tokenized_chat():
    """A record with both id lists comes back as the same record (the tokenizer only bounds
    its ids); a chat record with both still gets its turn and role labels."""

    class LengthOnly:  # no encode: nothing may be tokenized
        def __len__(self):
            return 100

    ids = {"prompt_token_ids": [1, 2], "trace_token_ids": [7, 8]}
    chat = {"id": "c", "messages": [{"role": "user", "content": "hi"}], **ids}
    traces = load_traces([{"id": "t", **ids}, chat])
    tokenized = traces.tokenize(LengthOnly())
    assert tokenized[0] is traces[0]
    assert tokenized[1].trace_roles == ("assistant",) * 2 and tokenized[1].trace_turns == (1, 1)
    with pytest.raises(TraceError, match=r"^<list> row 0: trace 't': trace_token_ids\[1\] = 8 "):
        traces.tokenize(LengthOnly(), vocab_size=8)


# --- truncate ----------------------------------------------------------------------------


def test_truncate_cuts_ids_and_ref_logprobs_together():
    """A longer trace keeps its first max_tokens ids and as many ref_logprobs; shorter ones and
    the prompts are unchanged; order and ids are kept."""
    cut = EXPECTED.exclude("he/1").truncate(2)
    assert cut.ids == ["he/0", "7"]
    assert cut[0] == EXPECTED[0]  # exactly 2 tokens: untouched
    assert cut[1].trace_token_ids == (10, 11) and cut[1].prompt_token_ids == (9,)
    many = load_traces([{**GOOD, "trace_token_ids": [5, 6, 7], "ref_logprobs": [-1, -2, -3]}])
    assert many.truncate(1)[0].ref_logprobs == (-1.0,)


def test_truncate_drops_the_completion_text_it_no_longer_matches(tokenizer):
    """A cut trace loses its completion text (the ids win); an uncut one keeps it."""
    traces = load_traces(
        [{"id": "t", "prompt": "Hi", "completion": " one two three four"}], tokenizer=tokenizer
    )
    n_tokens = len(traces[0].trace_token_ids)
    assert traces.truncate(n_tokens)[0].completion == " one two three four"
    assert traces.truncate(n_tokens - 1)[0].completion is None


def test_truncate_text_only_trace_says_to_tokenize_first(tmp_path):
    """Text has no token count until a model tokenizes it: the error names the trace, its
    line, and the fix."""
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD, RECORDS[1]])
    with pytest.raises(
        TraceError,
        match=r"^.*x\.jsonl:2: trace 'he/1': has no trace_token_ids "
        r"to truncate.*tokenize\(tokenizer\)\.truncate",
    ):
        load_traces(path).truncate(4)


def test_truncate_cuts_a_chat_trace_with_its_turn_labels(tokenizer):
    """A tokenized chat trace keeps the turn and role labels of exactly the tokens it keeps."""
    chat = {
        "id": "c",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there, how are"},
        ],
    }
    whole = load_traces([chat], tokenizer=tokenizer)[0]
    cut = load_traces([chat], tokenizer=tokenizer).truncate(2)[0]
    assert cut.trace_token_ids == whole.trace_token_ids[:2]
    assert (cut.trace_turns, cut.trace_roles) == (whole.trace_turns[:2], whole.trace_roles[:2])
    assert cut.messages == whole.messages  # the ids win over them, as they always do


@pytest.mark.parametrize("max_tokens", [0, -1, 1.5, True])
def test_truncate_rejects_a_bad_length(max_tokens):
    """max_tokens is an integer >= 1 (0 would leave an empty, unreplayable trace)."""
    with pytest.raises(ValueError, match="max_tokens"):
        EXPECTED.truncate(max_tokens)


def test_chat_reply_keeps_its_text_beside_its_ids():
    """A chat request with its reply as trace_token_ids may carry the reply's text as
    completion (what record writes); the ids are the trace."""
    record = {
        "id": "r",
        "messages": [{"role": "user", "content": "Hi"}],
        "trace_token_ids": [19556, 2],
        "completion": "Hello<|im_end|>",
    }
    trace = load_traces([record])[0]
    assert trace.is_chat and trace.completion == "Hello<|im_end|>"
    assert trace.trace_token_ids == (19556, 2)


TYPO_SOURCES = {
    "jsonl": (lambda tmp_path, rows: write_jsonl(tmp_path / "x.jsonl", rows), "{path}:1"),
    **{kind: (make, location.replace("1", "0")) for kind, (make, location) in BAD_SOURCES.items()},
}


@pytest.mark.parametrize("kind", TYPO_SOURCES)
def test_unknown_field_warns_once_naming_field_location_and_closest_name(kind, tmp_path):
    """A key that is no trace field (a typo) is ignored with one UnknownFieldWarning per source
    naming it, where it first appears (file line, JSON index or row), and the field it is
    closest to; every source kind goes through the same check."""
    from trace_replay.traces.sources import UnknownFieldWarning

    make, location = TYPO_SOURCES[kind]
    rows = [
        {**GOOD, "id": "typo", "trace_tokens_ids": [5]},
        {**GOOD, "id": "again", "trace_tokens_ids": [6]},
    ]
    source = make(tmp_path, rows)
    with pytest.warns(UnknownFieldWarning) as caught:
        traces = load_traces(source)
    assert len(caught) == 1 and traces.ids == ["typo", "again"]
    assert str(caught[0].message).startswith(
        f"{location.format(path=source)}: trace 'typo': unknown field 'trace_tokens_ids' is "
        "ignored (did you mean 'trace_token_ids'?)"
    )


def test_unknown_field_warning_names_the_jsonl_line_before_the_error_it_causes(tmp_path):
    """A misspelt trace field leaves the record without a trace: the warning naming the typo's
    line comes before the TraceError, so the cause is shown with the error."""
    from trace_replay.traces.sources import UnknownFieldWarning

    path = write_jsonl(
        tmp_path / "t.jsonl", [GOOD, {"id": "x", "prompt_token_ids": [1], "trace_tokens_ids": [2]}]
    )
    with pytest.warns(
        UnknownFieldWarning,
        match=rf"{path}:2: trace 'x': unknown field "
        r"'trace_tokens_ids' .*'trace_token_ids'",
    ):
        with pytest.raises(TraceError, match=rf"{path}:2: trace 'x': missing trace"):
            load_traces(path)


def test_known_fields_never_warn(tmp_path):
    """Every trace field (meta, messages, tools, turns, ref_logprobs, trace_turns, trace_roles,
    text and ids), and the token counts to_pandas adds, loads without an UnknownFieldWarning
    from every source kind and through the writers' round trips."""
    import warnings

    from trace_replay.traces.sources import UnknownFieldWarning

    records = [
        *RECORDS,
        {"id": "c", "messages": CHAT, "tools": [{"type": "function"}], "turns": "all"},
        {
            "id": "r",
            "messages": CHAT[:1],
            "prompt_token_ids": [1],
            "trace_token_ids": [2, 3],
            "completion": "Hello!",
            "trace_turns": [1, 1],
            "trace_roles": ["assistant"] * 2,
        },
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownFieldWarning)
        traces = load_traces(records)
        for make in SOURCES.values():
            load_traces(make(tmp_path))
        traces.to_parquet(tmp_path / "all.parquet")
        traces.to_jsonl(tmp_path / "all.jsonl")
        for source in (traces.to_pandas(), tmp_path / "all.parquet", tmp_path / "all.jsonl"):
            assert load_traces(source) == traces
