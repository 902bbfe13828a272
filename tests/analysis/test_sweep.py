"""sweep: one row per grid configuration, compared with the base run, models loaded once."""

from __future__ import annotations

import pytest

from trace_replay.analysis.metrics import compare, dataset_summary
from trace_replay.analysis.sweep import grid_settings, sweep
from trace_replay.engines.cache import ModelCache


def test_grid_settings_is_the_product_over_base():
    """Every combination, in product order, on top of the base settings."""
    combos = grid_settings(
        {"engine": "torch", "dtype": "float32"},
        {"dtype": ["float32", "bfloat16"], "batch_size": [1, 8]},
    )
    assert [(c["dtype"], c["batch_size"]) for c in combos] == [
        ("float32", 1),
        ("float32", 8),
        ("bfloat16", 1),
        ("bfloat16", 8),
    ]
    assert all(c["engine"] == "torch" for c in combos)


def test_grid_values_must_be_lists():
    """A string or an empty list as grid values is an error naming the key."""
    with pytest.raises(ValueError, match="dtype"):
        grid_settings({}, {"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="batch_size"):
        grid_settings({}, {"batch_size": []})


def test_setting_typos_name_the_key_and_the_valid_settings():
    """A misspelt setting in base or grid is refused before any run, naming where it is, the
    key, the closest valid name and every setting the engine takes."""
    traces = [{"id": "t", "prompt": "Hi", "completion": " there"}]
    with pytest.raises(
        ValueError,
        match=r"^sweep base: unknown setting 'dtyp' \(did you mean "
        r"'dtype'\?\); engine 'prefill' takes engine, model, dtype,",
    ):
        sweep(traces, {"engine": "prefill", "dtyp": "float32"}, {"top_k": [1]}, progress=False)
    with pytest.raises(
        ValueError,
        match=r"^sweep grid: unknown setting 'batch_sise' \(did you "
        r"mean 'batch_size'\?\); engine 'prefill' takes .*batch_size",
    ):
        sweep(traces, {"engine": "prefill"}, {"batch_sise": [1, 2]}, progress=False)


@pytest.mark.slow
def test_sweep_rows_hold_dataset_summary_metrics(lm, real_traces, replay_df):
    """One row per configuration with the grid keys and every dataset_summary metric; the
    configuration equal to the base reproduces it exactly (same process, same shapes)."""
    traces = real_traces.select(["paris", "short-prompt"])
    models = ModelCache()
    base = {"model": lm, "engine": "torch", "batch_size": 2}
    table = sweep(
        traces,
        base,
        {"engine": ["torch", "prefill"], "dtype": ["float32", "bfloat16"]},
        progress=False,
        models=models,
    )
    assert table[["engine", "dtype"]].values.tolist() == [
        ["torch", "float32"],
        ["torch", "bfloat16"],
        ["prefill", "float32"],
        ["prefill", "bfloat16"],
    ]
    own = dataset_summary(compare(replay_df, replay_df))["metric"]
    assert table.attrs["metrics"] == own.tolist()
    assert set(own) <= set(table.columns) and "wall_s" in table.columns
    assert table.loc[0, "max_abs_delta"] == 0
    assert table.loc[1, "max_abs_delta"] > table.loc[2, "max_abs_delta"] > 0
    assert len(models) == 1  # the bfloat16 cast, made once for two configurations
    assert table.attrs["base"]["engine"] == "torch"
