"""Join the result files of one sharded run into one result with provenance that fits it.

Parts are refused unless they come from the same configuration: every engine setting
(engine, path, model, dtype, device, batch size, top-k… as ``replay`` records them in
``attrs["settings_keys"]``) and the versions of the numerical packages must agree, so two
runs never mix silently. They must also be shards of one trace set (``traces_digest``, or
``source`` for results that do not record it) and of one split, each shard once; a set
missing a shard is refused unless asked for, and then marked incomplete. The merged
``attrs`` describe the whole: its trace count, the shards it covers, whether it is complete,
its start and end, and the files it came from.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from trace_replay._text import plural
from trace_replay.analysis.metrics import _check_frame

__all__ = ["merge_results"]

# what a part says about its own run rather than about the configuration
_RUN_KEYS = {"num_traces", "resumed_traces", "truncated", "shard", "source", "versions",
             "started_at", "finished_at", "merged_from", "settings_keys", "wall_s",
             "forwards", "acceptance_rate", "threads", "traces_digest", "complete",
             "missing_shards"}
_SUMMED = ("num_traces", "resumed_traces", "forwards")
# versions that do not change the numbers
_IGNORED_VERSIONS = {"python", "trace-replay"}


def _read(part: str | os.PathLike) -> pd.DataFrame:
    """A result file whose rows hold the traces its ``num_traces`` records, each once."""
    path = Path(part)
    if path.exists() and not path.is_file():
        raise ValueError(f"merge: result file {path} is not a regular file")
    if not path.is_file():
        raise FileNotFoundError(f"merge: result file {path} does not exist")
    frame = pd.read_parquet(path)
    _check_frame(frame, f"merge: result file {path}")
    recorded, held = frame.attrs.get("num_traces"), frame["trace_id"].nunique()
    if isinstance(recorded, int) and held != recorded:  # rows lost or added since replay
        raise ValueError(f"merge: result file {path} records {plural(recorded, 'trace')} "
                         f"but holds rows of {held}: it is damaged or was edited; replay "
                         "it again")
    return frame


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


def _check_same_traces(frames: Sequence[pd.DataFrame], names: Sequence[str]) -> None:
    """Raise naming the files unless every part replayed (a shard of) one trace set."""
    recorded = all(f.attrs.get("traces_digest") for f in frames)
    what = "traces_digest" if recorded else "source"  # older results record no digest
    values = [f.attrs.get(what) for f in frames]
    if any(value != values[0] for value in values):
        seen = "; ".join(f"{value!r} in {name}" for value, name in zip(values, names))
        raise ValueError(f"cannot merge results of different trace sets: {what} differs "
                         f"({seen})")


def _shards(attrs: dict) -> list[tuple[int, int]]:
    """The shards ``(index, count)`` a result holds: one, several (an incomplete merge), or
    none (a whole run)."""
    shard = attrs.get("shard")
    if not shard:
        return []
    return [tuple(s) for s in shard] if isinstance(shard[0], (list, tuple)) else [tuple(shard)]


def _missing_shards(frames: Sequence[pd.DataFrame], names: Sequence[str]) -> list[int]:
    """The shard indices of the split that no part holds; raise on a mixed or repeated set."""
    shards = [_shards(f.attrs) for f in frames]
    if not all(shards):
        if len(frames) > 1:  # a whole run beside anything else repeats or mixes traces
            whole = [name for name, held in zip(names, shards) if not held]
            raise ValueError(f"cannot merge: {', '.join(whole)} is a whole run (no shard), "
                             f"not a shard of one: {', '.join(names)}")
        return []
    counts = sorted({count for held in shards for _, count in held})
    if len(counts) > 1:
        raise ValueError(f"cannot merge shards of different splits (counts {counts}): "
                         + ", ".join(names))
    for shard in {shard for held in shards for shard in held}:
        files = [name for name, held in zip(names, shards) for other in held if other == shard]
        if len(files) > 1:
            raise ValueError(f"cannot merge: shard {shard[0]}/{shard[1]} is given twice "
                             f"({', '.join(files)})")
    return sorted(set(range(counts[0])) - {index for held in shards for index, _ in held})


def _merged_attrs(frames: Sequence[pd.DataFrame], names: Sequence[str], merged: pd.DataFrame,
                  missing: list[int]) -> dict[str, Any]:
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
    shards = sorted({shard for f in frames for shard in _shards(f.attrs)})
    attrs["complete"] = not missing
    attrs["missing_shards"] = [[index, shards[0][1]] for index in missing]
    attrs["shard"] = None if not missing else [list(s) for s in shards]
    for key, pick in (("started_at", min), ("finished_at", max)):
        stamps = [f.attrs[key] for f in frames if f.attrs.get(key)]
        if stamps:
            attrs[key] = pick(stamps)
    attrs["merged_from"] = list(names)
    return attrs


def merge_results(parts: Sequence[str | os.PathLike], *,
                  allow_incomplete: bool = False) -> pd.DataFrame:
    """Concatenate the shard results of one run.

    Parameters
    ----------
    parts
        Parquet files written by :func:`trace_replay.runs.replay` (``trace-replay replay``):
        shards ``(i, n)`` of one trace set and split, or a single whole run.
    allow_incomplete
        Merge shards although some of the split are missing (with a warning); the result
        is marked incomplete.

    Returns
    -------
    pandas.DataFrame
        The rows of every part in the order given; ``attrs`` hold the common settings,
        ``num_traces`` of the merged rows, ``complete`` (every shard present),
        ``missing_shards`` (``[index, n]`` each), ``shard`` ``None`` when complete (else
        the list merged), summed counters, the earliest start, the latest finish and
        ``merged_from``.

    Raises
    ------
    ValueError
        When the parts differ in a setting or a package version, replayed different trace
        sets (naming it and the files), come from different shard splits, repeat a shard,
        miss one (unless ``allow_incomplete``), or hold the same trace twice; when a part is
        not a result file (naming the columns it lacks) or holds rows of other than the
        ``num_traces`` it records (rows deleted or added).
    FileNotFoundError
        When a part does not exist.

    Examples
    --------
    >>> import tempfile
    >>> import trace_replay as tr
    >>> traces = [{"id": "a", "prompt": "The capital of France is", "completion": " Paris."},
    ...           {"id": "d", "prompt": "Hi", "completion": " there"}]
    >>> folder = Path(tempfile.mkdtemp())
    >>> for i in range(2):  # as two jobs would, each writing its shard
    ...     part = tr.replay(traces, engine="prefill", shard=(i, 2), progress=False)
    ...     part.to_parquet(folder / f"s{i}.parquet")
    >>> merged = merge_results([folder / "s0.parquet", folder / "s1.parquet"])
    >>> merged["trace_id"].unique().tolist(), merged.attrs["shard"]
    (['a', 'd'], None)
    """
    if not parts:
        raise ValueError("merge: no result files given")
    names = [str(p) for p in parts]
    frames = [_read(p) for p in parts]
    _check_same_run(frames, names)
    _check_same_traces(frames, names)
    missing = _missing_shards(frames, names)
    if missing:
        count = _shards(frames[0].attrs)[0][1]
        gap = (f"shard {', '.join(f'{i}/{count}' for i in missing)} missing (merging "
               f"{count - len(missing)} of {count} shards)")
        if not allow_incomplete:
            raise ValueError(f"cannot merge an incomplete set: {gap}; add the missing shard "
                             "or pass allow_incomplete=True (CLI --allow-incomplete) to mark "
                             "the result incomplete")
        warnings.warn(f"merge: {gap}; the result is marked incomplete (attrs['complete'] "
                      "is False)", stacklevel=2)
    merged = pd.concat(frames, ignore_index=True)
    owner = pd.Series([name for name, f in zip(names, frames) for _ in range(len(f))])
    dup = merged.duplicated(subset=["trace_id", "step"], keep=False)
    if dup.any():
        trace_id = merged.loc[dup, "trace_id"].iloc[0]
        files = sorted(set(owner[dup & (merged["trace_id"] == trace_id)]))
        raise ValueError(f"cannot merge: trace {trace_id!r} is in more than one part "
                         f"({', '.join(files)})")
    merged.attrs = _merged_attrs(frames, names, merged, missing)
    return merged
