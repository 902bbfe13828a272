"""Merging shard results: provenance of the whole, and parts of different runs refused."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from trace_replay.runs.merge import merge_results

SETTINGS = {
    "engine": "torch",
    "engine_path": "torch-decode[hf]",
    "model": "SmolLM2",
    "dtype": "float32",
    "device": "cpu",
    "batch_size": 8,
    "top_k": 5,
    "deterministic": False,
    "weights_digest": "d" * 32,
}


@pytest.fixture
def write_part(tmp_path, make_replay):
    """``write_part(name, trace_ids, shard, **attrs)``: a result file as replay writes it."""

    def write(name, trace_ids, shard, **changes):
        settings = {**SETTINGS, **{k: v for k, v in changes.items() if k in SETTINGS}}
        frame = make_replay(len(trace_ids), 4, seed=len(name), top_k=settings["top_k"])
        frame["trace_id"] = frame["trace_id"].map(dict(zip(frame["trace_id"].unique(), trace_ids)))
        frame.attrs = {
            **settings,
            "forwards": 4,
            "settings_keys": sorted(settings),
            "num_traces": len(trace_ids),
            "num_tokens": len(frame),
            "resumed_traces": 1,
            "truncated": [],
            "shard": list(shard),
            "source": "traces.jsonl",
            "versions": {"python": "3.11.7", "torch": "2.13.0"},
            "started_at": f"2026-11-30T10:0{shard[0]}:00+00:00",
            "finished_at": f"2026-11-30T11:0{shard[0]}:00+00:00",
            **{k: v for k, v in changes.items() if k not in SETTINGS},
        }
        path = tmp_path / name
        frame.to_parquet(path, index=False)
        return str(path)

    return write


def test_merged_attrs_describe_the_whole_run(write_part):
    """Two shards of a 3-trace run: num_traces 3, no shard left, summed counters, span."""
    parts = [write_part("s0.parquet", ["a", "b"], (0, 2)), write_part("s1.parquet", ["c"], (1, 2))]
    merged = merge_results(parts)
    assert merged.attrs["num_traces"] == 3 == merged["trace_id"].nunique()
    assert merged.attrs["shard"] is None
    assert merged.attrs["resumed_traces"] == 2 and merged.attrs["forwards"] == 8
    assert merged.attrs["started_at"].startswith("2026-11-30T10:00")
    assert merged.attrs["finished_at"].startswith("2026-11-30T11:01")
    assert merged.attrs["merged_from"] == parts
    assert merged.attrs["dtype"] == "float32" and merged.attrs["engine"] == "torch"


def test_provenance_survives_parquet(write_part, tmp_path):
    """The merged attrs are what a reader of the written file sees."""
    merged = merge_results(
        [write_part("s0.parquet", ["a"], (0, 2)), write_part("s1.parquet", ["b"], (1, 2))]
    )
    merged.to_parquet(tmp_path / "all.parquet", index=False)
    back = pd.read_parquet(tmp_path / "all.parquet")
    assert back.attrs["num_traces"] == 2 and back.attrs["shard"] is None


def test_an_incomplete_set_is_refused_naming_the_missing_shards(write_part):
    """Shards 0 and 2 of 4 are not the whole run: refused by default, naming shards 1 and 3."""
    parts = [write_part("s0.parquet", ["a"], (0, 4)), write_part("s2.parquet", ["c"], (2, 4))]
    with pytest.raises(ValueError, match="incomplete set: shard 1/4, 3/4 missing"):
        merge_results(parts)


def test_an_incomplete_set_merged_on_request_is_marked(write_part):
    """allow_incomplete: a warning, and attrs that say so (complete False, which shards are
    missing, which merged)."""
    parts = [write_part("s0.parquet", ["a"], (0, 4)), write_part("s2.parquet", ["c"], (2, 4))]
    with pytest.warns(UserWarning, match="marked incomplete"):
        merged = merge_results(parts, allow_incomplete=True)
    assert merged.attrs["complete"] is False
    assert merged.attrs["missing_shards"] == [[1, 4], [3, 4]]
    assert merged.attrs["shard"] == [[0, 4], [2, 4]]


def test_shards_of_different_trace_sets_are_refused(write_part):
    """Shards 0/2 and 1/2 of two different trace sets: refused, naming both files."""
    a = write_part("s0.parquet", ["a"], (0, 2), traces_digest="1" * 32)
    b = write_part("s1.parquet", ["b"], (1, 2), traces_digest="2" * 32)
    with pytest.raises(ValueError, match="different trace sets: traces_digest differs") as error:
        merge_results([a, b])
    assert a in str(error.value) and b in str(error.value)
    c = write_part("s2.parquet", ["c"], (1, 2), source="other.jsonl")  # records no digest
    with pytest.raises(ValueError, match="different trace sets: source differs"):
        merge_results([write_part("s3.parquet", ["a"], (0, 2)), c])


def test_a_shard_given_twice_is_refused(write_part):
    """The same shard twice: refused as such, naming the files."""
    with pytest.raises(ValueError, match="shard 1/3 is given twice"):
        merge_results(
            [
                write_part("s0.parquet", ["a"], (0, 3)),
                write_part("s1.parquet", ["b"], (1, 3)),
                write_part("s1b.parquet", ["b"], (1, 3)),
                write_part("s2.parquet", ["c"], (2, 3)),
            ]
        )


@pytest.mark.slow
def test_replayed_shards_of_two_datasets_are_refused(lm, tmp_path):
    """Real results: shard 0/2 of one trace set and 1/2 of another are refused; the two
    shards of one set merge complete."""
    from trace_replay.engines import make_engine
    from trace_replay.runs.replay import replay

    engine = make_engine("prefill", lm, top_k=2)
    sets = {
        name: [{"id": f"t{i}", "prompt": "Hi", "completion": f" {name} {i}"} for i in (0, 1, 4, 5)]
        for name in ("red", "blue")
    }  # shards 0, 0, 1, 1
    paths = {}
    for name, traces in sets.items():
        for index in (0, 1):
            paths[name, index] = tmp_path / f"{name}{index}.parquet"
            replay(traces, engine=engine, shard=(index, 2), progress=False).to_parquet(
                paths[name, index]
            )
    with pytest.raises(ValueError, match="different trace sets"):
        merge_results([paths["red", 0], paths["blue", 1]])
    merged = merge_results([paths["red", 0], paths["red", 1]])
    assert merged.attrs["complete"] and merged.attrs["num_traces"] == 4


@pytest.mark.parametrize(
    "setting, value",
    [("dtype", "bfloat16"), ("engine", "vllm"), ("top_k", 20), ("model", "other-model")],
)
def test_parts_with_other_settings_are_refused(write_part, setting, value):
    """A part from another configuration is refused, naming the setting and both files."""
    a = write_part("s0.parquet", ["a"], (0, 2))
    b = write_part("s1.parquet", ["b"], (1, 2), **{setting: value})
    with pytest.raises(ValueError, match=f"{setting} differs") as error:
        merge_results([a, b])
    assert a in str(error.value) and b in str(error.value) and repr(value) in str(error.value)


def test_parts_with_other_package_versions_are_refused(write_part):
    """A part replayed under another torch is refused: the numbers may differ."""
    a = write_part("s0.parquet", ["a"], (0, 2))
    b = write_part("s1.parquet", ["b"], (1, 2), versions={"python": "3.11.7", "torch": "2.4.0"})
    with pytest.raises(ValueError, match="torch version differs"):
        merge_results([a, b])


def test_a_trace_in_two_parts_is_refused(write_part):
    """The same trace in two parts names the trace and both files."""
    a = write_part("s0.parquet", ["a", "b"], (0, 2))
    b = write_part("s1.parquet", ["b"], (1, 2))
    with pytest.raises(ValueError, match="trace 'b'") as error:
        merge_results([a, b])
    assert a in str(error.value) and b in str(error.value)


def test_shards_of_different_splits_are_refused(write_part):
    """Shard 0/2 and shard 1/3 slice the traces differently: refused."""
    with pytest.raises(ValueError, match="different splits"):
        merge_results(
            [write_part("s0.parquet", ["a"], (0, 2)), write_part("s1.parquet", ["b"], (1, 3))]
        )


def test_missing_part_names_the_file(tmp_path):
    """A part that does not exist is a FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="missing.parquet does not exist"):
        merge_results([tmp_path / "missing.parquet"])


def test_an_incomplete_merge_is_completed_by_its_missing_shards(write_part, tmp_path):
    """An incomplete merge, merged with the shards it missed, is the complete run."""
    with pytest.warns(UserWarning, match="marked incomplete"):
        first = merge_results([write_part("s0.parquet", ["a"], (0, 3))], allow_incomplete=True)
    first.to_parquet(tmp_path / "first.parquet", index=False)
    merged = merge_results(
        [
            tmp_path / "first.parquet",
            write_part("s1.parquet", ["b"], (1, 3)),
            write_part("s2.parquet", ["c"], (2, 3)),
        ]
    )
    assert merged.attrs["complete"] and merged.attrs["shard"] is None
    assert merged.attrs["missing_shards"] == [] and merged.attrs["num_traces"] == 3


def test_cli_refuses_an_incomplete_set_unless_allowed(write_part, tmp_path, capsys):
    """``trace-replay merge``: exit 2 naming the missing shard; ``--allow-incomplete`` writes
    the result marked incomplete."""
    from trace_replay.cli import main

    parts = [write_part("s0.parquet", ["a"], (0, 3)), write_part("s2.parquet", ["c"], (2, 3))]
    out = tmp_path / "all.parquet"
    assert main(["merge", *parts, "--out", str(out)]) == 2
    assert "shard 1/3 missing" in capsys.readouterr().err and not out.exists()
    assert main(["merge", *parts, "--out", str(out), "--allow-incomplete"]) == 0
    assert pd.read_parquet(out).attrs["complete"] is False


def test_a_part_missing_rows_of_a_trace_it_records_is_refused(write_part):
    """A shard whose rows hold fewer traces than its num_traces (a trace's rows deleted) is
    refused naming the file and both counts, never merged as a complete set; so is a file
    that is not a replay result."""
    parts = [
        write_part("s0.parquet", ["a", "b"], (0, 2)),
        write_part("s1.parquet", ["c"], (1, 2), num_traces=2),
    ]
    with pytest.raises(
        ValueError,
        match=r"s1\.parquet records 2 traces \(num_traces\) but "
        "holds 1 trace",
    ):
        merge_results(parts)
    other = pd.read_parquet(parts[0]).drop(columns="logprob")
    other.to_parquet(parts[0])
    with pytest.raises(
        ValueError,
        match=r"s0\.parquet is not a replay result file: it lacks "
        r"replay columns \['logprob'\]",
    ):
        merge_results(parts)


def test_parts_of_other_weights_are_refused(write_part):
    """Two shards of one model name scored with different weights (a model retrained in place)
    are refused, naming weights_digest and both files."""
    a = write_part("s0.parquet", ["a"], (0, 2))
    b = write_part("s1.parquet", ["b"], (1, 2), weights_digest="e" * 32)
    with pytest.raises(ValueError, match="weights_digest differs .*other weights") as error:
        merge_results([a, b])
    assert a in str(error.value) and b in str(error.value)


def test_parts_recording_no_weights_digest_merge_only_when_allowed(write_part, tmp_path):
    """A part written before results recorded the weights' digest is refused, naming it and
    the way on; allow_unknown_weights merges it with a warning, and parts that do record a
    digest must still agree."""
    a = write_part("s0.parquet", ["a"], (0, 2))
    old = pd.read_parquet(write_part("s1.parquet", ["b"], (1, 2)))
    old.attrs = {k: v for k, v in old.attrs.items() if k != "weights_digest"}
    old.attrs["settings_keys"].remove("weights_digest")
    old.to_parquet(tmp_path / "s1.parquet", index=False)
    b = str(tmp_path / "s1.parquet")
    with pytest.raises(
        ValueError,
        match=rf"{b} records no weights_digest .*"
        "allow_unknown_weights=True",
    ):
        merge_results([a, b])
    with pytest.warns(UserWarning, match="merged on trust"):
        merged = merge_results([a, b], allow_unknown_weights=True)
    assert merged.attrs["num_traces"] == 2
    c = write_part("s2.parquet", ["c"], (0, 2), weights_digest="e" * 32)
    with pytest.raises(ValueError, match="weights_digest differs"), pytest.warns(UserWarning):
        merge_results([a, c, b], allow_unknown_weights=True)


def test_batch_size_counts_only_where_it_changes_the_numbers(write_part):
    """Shards replayed at other batch sizes are refused unless every part is batch-invariant
    (deterministic mode), whose numbers do not depend on it; the merged attrs then keep each
    part's batch size."""
    parts = [
        write_part("s0.parquet", ["a"], (0, 2)),
        write_part("s1.parquet", ["b"], (1, 2), batch_size=64),
    ]
    with pytest.raises(ValueError, match="batch_size differs"):
        merge_results(parts)
    parts = [
        write_part("d0.parquet", ["a"], (0, 2), deterministic=True),
        write_part("d1.parquet", ["b"], (1, 2), deterministic=True, batch_size=64),
    ]
    assert merge_results(parts).attrs["batch_size"] == [8, 64]


@pytest.mark.slow
def test_replayed_shards_of_other_weights_are_refused(lm, tmp_path):
    """Real results: each records the digest of the weights it scored with; shard 1/2 replayed
    after a weight of the same model changed in place is refused beside shard 0/2."""
    from trace_replay.engines import make_engine
    from trace_replay.runs.replay import replay

    traces = [{"id": f"t{i}", "prompt": "Hi", "completion": f" red {i}"} for i in (0, 1, 4, 5)]
    engine = make_engine("prefill", lm, top_k=2)
    first = replay(traces, engine=engine, shard=(0, 2), progress=False)
    assert first.attrs["weights_digest"] == engine.weights_digest()
    first.to_parquet(tmp_path / "s0.parquet")
    weight = lm.model.norm.weight
    kept = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.01)
        replay(traces, engine=engine, shard=(1, 2), progress=False).to_parquet(
            tmp_path / "s1.parquet"
        )
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    with pytest.raises(ValueError, match="weights_digest differs"):
        merge_results([tmp_path / "s0.parquet", tmp_path / "s1.parquet"])
