"""replay's options as one record (trace_replay.runs.stages): checked when made, frozen,
and the one source of what starts an engine by name."""

from __future__ import annotations

import dataclasses

import pytest

from trace_replay.engines import make_engine
from trace_replay.runs.stages import ReplayOptions


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"shard": (2, 2)},
            r"shard must be \(index, count\) with 0 <= index < count, got \(2, 2\)",
        ),
        ({"chunk_size": 0}, "chunk_size must be an integer >= 1, got 0"),
        ({"checkpoint_every": -1}, "checkpoint_every must be seconds >= 0, got -1"),
        ({"truncate": "yes"}, "truncate must be True or False, got 'yes'"),
        ({"checkpoint": 3}, "checkpoint must be a folder path, got int"),
    ],
)
def test_bad_options_are_refused_when_made(fields, message):
    """Each bad value is refused naming the option and the value, before anything loads."""
    with pytest.raises(ValueError, match=message):
        ReplayOptions(**fields)


def test_options_are_frozen_and_name_what_builds_an_engine():
    """An options record cannot change after it is checked; its engine settings are
    exactly make_engine's keywords beyond the name and model."""
    options = ReplayOptions(engine="prefill", top_k=3, batch_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.top_k = 4  # type: ignore[misc]
    with make_engine(options.engine, **options.engine_settings()) as engine:
        assert (engine.settings()["top_k"], engine.batch_size) == (3, 2)


def test_the_settings_given_for_an_engine_are_those_off_their_defaults():
    """What an engine object passed in would ignore: every engine option set, by name."""
    assert ReplayOptions().engine_settings_given() == []
    assert ReplayOptions(
        dtype="bfloat16", top_k=3, verbose=True, progress=False
    ).engine_settings_given() == ["dtype", "top_k", "verbose"]
