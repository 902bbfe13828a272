"""Merging shard results: provenance of the whole, and parts of different runs refused."""

from __future__ import annotations

import pandas as pd
import pytest

from trace_replay.merge import merge_results

SETTINGS = {"engine": "torch", "engine_path": "torch-decode[hf]", "model": "SmolLM2",
            "dtype": "float32", "device": "cpu", "batch_size": 8, "top_k": 5}


@pytest.fixture
def write_part(tmp_path, make_replay):
    """``write_part(name, trace_ids, shard, **attrs)``: a result file as replay writes it."""

    def write(name, trace_ids, shard, **changes):
        frame = make_replay(len(trace_ids), 4, seed=len(name))
        frame["trace_id"] = frame["trace_id"].map(dict(zip(frame["trace_id"].unique(),
                                                            trace_ids)))
        settings = {**SETTINGS, **{k: v for k, v in changes.items() if k in SETTINGS}}
        frame.attrs = {**settings, "forwards": 4, "settings_keys": sorted(settings),
                       "num_traces": len(trace_ids), "resumed_traces": 1, "truncated": [],
                       "shard": list(shard), "source": "traces.jsonl",
                       "versions": {"python": "3.11.7", "torch": "2.13.0"},
                       "started_at": f"2026-11-30T10:0{shard[0]}:00+00:00",
                       "finished_at": f"2026-11-30T11:0{shard[0]}:00+00:00",
                       **{k: v for k, v in changes.items() if k not in SETTINGS}}
        path = tmp_path / name
        frame.to_parquet(path, index=False)
        return str(path)

    return write


def test_merged_attrs_describe_the_whole_run(write_part):
    """Two shards of a 3-trace run: num_traces 3, no shard left, summed counters, span."""
    parts = [write_part("s0.parquet", ["a", "b"], (0, 2)),
             write_part("s1.parquet", ["c"], (1, 2))]
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
    merged = merge_results([write_part("s0.parquet", ["a"], (0, 2)),
                            write_part("s1.parquet", ["b"], (1, 2))])
    merged.to_parquet(tmp_path / "all.parquet", index=False)
    back = pd.read_parquet(tmp_path / "all.parquet")
    assert back.attrs["num_traces"] == 2 and back.attrs["shard"] is None


def test_partial_shards_are_listed(write_part):
    """Shards 0 and 2 of 4 are not the whole run: attrs list which shards were merged."""
    merged = merge_results([write_part("s0.parquet", ["a"], (0, 4)),
                            write_part("s2.parquet", ["c"], (2, 4))])
    assert merged.attrs["shard"] == [[0, 4], [2, 4]]


@pytest.mark.parametrize("setting, value", [("dtype", "bfloat16"), ("engine", "vllm"),
                                            ("top_k", 20), ("model", "other-model")])
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
        merge_results([write_part("s0.parquet", ["a"], (0, 2)),
                       write_part("s1.parquet", ["b"], (1, 3))])


def test_missing_part_names_the_file(tmp_path):
    """A part that does not exist is a FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="missing.parquet does not exist"):
        merge_results([tmp_path / "missing.parquet"])
