"""Join the result files of one sharded run into one result with provenance that fits it.

Parts are refused unless they come from the same configuration: every engine setting
(engine, path, model, dtype, device, batch size, top-k… as ``replay`` records them in
``attrs["settings_keys"]``) and the versions of the numerical packages must agree, so two
runs never mix silently. The merged ``attrs`` describe the whole: its trace count, the
shards it covers, its start and end, and the files it came from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["merge_results"]

# what a part says about its own run rather than about the configuration
_RUN_KEYS = {"num_traces", "resumed_traces", "truncated", "shard", "source", "versions",
             "started_at", "finished_at", "merged_from", "settings_keys", "wall_s",
             "forwards", "acceptance_rate", "threads"}
_SUMMED = ("num_traces", "resumed_traces", "forwards")
# versions that do not change the numbers
_IGNORED_VERSIONS = {"python", "trace-replay"}


def _read(part: str | os.PathLike) -> pd.DataFrame:
    path = Path(part)
    if not path.is_file():
        raise FileNotFoundError(f"merge: result file {path} does not exist")
    return pd.read_parquet(path)


def _settings_keys(attrs: dict) -> set[str]:
    keys = attrs.get("settings_keys")
    return set(keys) if keys is not None else set(attrs) - _RUN_KEYS


def _check_same_run(frames: Sequence[pd.DataFrame], names: Sequence[str]) -> None:
    """Raise naming the first setting (or package version) in which the parts differ."""
    keys = sorted(set().union(*(_settings_keys(f.attrs) for f in frames)))
    versions = [{k: v for k, v in (f.attrs.get("versions") or {}).items()
                 if k not in _IGNORED_VERSIONS} for f in frames]
    checks = [(key, [f.attrs.get(key) for f in frames]) for key in keys]
    checks += [(f"{package} version", [v.get(package) for v in versions])
               for package in sorted(set().union(*versions))]
    for what, values in checks:
        if any(value != values[0] for value in values):
            seen = "; ".join(f"{value!r} in {name}" for value, name in zip(values, names))
            raise ValueError(f"cannot merge results of different runs: {what} differs ({seen})")
    counts = {f.attrs["shard"][1] for f in frames if f.attrs.get("shard")}
    if len(counts) > 1:
        raise ValueError(f"cannot merge shards of different splits (counts {sorted(counts)}): "
                         + ", ".join(names))


def _merged_attrs(frames: Sequence[pd.DataFrame], names: Sequence[str],
                  merged: pd.DataFrame) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for key in dict.fromkeys(k for f in frames for k in f.attrs):
        values = [f.attrs.get(key) for f in frames]
        # one value when the parts agree, else one per part (in merged_from order)
        attrs[key] = values[0] if all(v == values[0] for v in values) else values
    for key in _SUMMED:
        values = [f.attrs.get(key) for f in frames]
        if all(isinstance(v, int) for v in values):
            attrs[key] = sum(values)
    attrs["num_traces"] = int(merged["trace_id"].nunique())
    attrs["truncated"] = [note for f in frames for note in (f.attrs.get("truncated") or [])]
    shards = sorted({tuple(f.attrs["shard"]) for f in frames if f.attrs.get("shard")})
    count = shards[0][1] if shards else None
    complete = len(shards) == len(frames) and [i for i, _ in shards] == list(range(count or 0))
    attrs["shard"] = None if complete or not shards else [list(s) for s in shards]
    for key, pick in (("started_at", min), ("finished_at", max)):
        stamps = [f.attrs[key] for f in frames if f.attrs.get(key)]
        if stamps:
            attrs[key] = pick(stamps)
    attrs["merged_from"] = list(names)
    return attrs


def merge_results(parts: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Concatenate the results of shards (or any parts) of one run.

    Parameters
    ----------
    parts
        Parquet files written by :func:`trace_replay.replay` (``trace-replay replay``).

    Returns
    -------
    pandas.DataFrame
        The rows of every part in the order given; ``attrs`` hold the common settings,
        ``num_traces`` of the whole, ``shard`` ``None`` when the parts are all ``n``
        shards of one split (else the list merged), summed counters, the earliest start,
        the latest finish and ``merged_from``.

    Raises
    ------
    ValueError
        When the parts differ in a setting or a package version (naming it and the files),
        come from different shard splits, or hold the same trace twice.
    FileNotFoundError
        When a part does not exist.

    Examples
    --------
    >>> merged = merge_results(["out/s0.parquet", "out/s1.parquet"])  # doctest: +SKIP
    """
    if not parts:
        raise ValueError("merge: no result files given")
    names = [str(p) for p in parts]
    frames = [_read(p) for p in parts]
    _check_same_run(frames, names)
    merged = pd.concat(frames, ignore_index=True)
    owner = pd.Series([name for name, f in zip(names, frames) for _ in range(len(f))])
    dup = merged.duplicated(subset=["trace_id", "step"], keep=False)
    if dup.any():
        trace_id = merged.loc[dup, "trace_id"].iloc[0]
        files = sorted(set(owner[dup & (merged["trace_id"] == trace_id)]))
        raise ValueError(f"cannot merge: trace {trace_id!r} is in more than one part "
                         f"({', '.join(files)})")
    merged.attrs = _merged_attrs(frames, names, merged)
    return merged
