"""Join the result files of one sharded run into one result with provenance that fits it.

Each part is read with :func:`~trace_replay.runs.result_file.read_result`, the checks a
``report`` runs on a file too: a part with an impossible score, a step missing, or other
counts than its ``attrs`` record is refused naming the file, the trace, the step and the
field.

Parts are refused unless they come from the same configuration: every engine setting that
changes the numbers (engine, path, model, dtype, device, batch size, top-k… as ``replay``
records them in ``attrs["settings_keys"]``; batch size not, where every part is
batch-invariant: :func:`~trace_replay.runs.checkpoint.number_settings`), the digest of the
weights scored with (``weights_digest``: the same model name with other weights) and the
versions of the numerical packages must agree, so two runs never mix silently. A part
written before results recorded the weights' digest is refused unless asked for
(``allow_unknown_weights``): its weights cannot be checked. Parts must also be shards of one
trace set (``traces_digest``, or ``source`` for results that do not record it) and of one
split, each shard once; a set missing a shard is refused unless asked for, and then marked
incomplete. The merged ``attrs`` describe the whole: its trace and token counts, the
shards it covers, whether it is complete, its start and end, and the files it came from.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import pandas as pd

from trace_replay.runs.checkpoint import BATCH_SETTINGS, deterministic_run
from trace_replay.runs.result_file import read_result

__all__ = ["merge_results"]

# what a part says about its own run rather than about the configuration
_RUN_KEYS = {
    "num_traces",
    "num_tokens",
    "resumed_traces",
    "truncated",
    "shard",
    "source",
    "versions",
    "started_at",
    "finished_at",
    "merged_from",
    "settings_keys",
    "wall_s",
    "forwards",
    "acceptance_rate",
    "threads",
    "traces_digest",
    "complete",
    "missing_shards",
}
_SUMMED = ("num_traces", "resumed_traces", "forwards")
# versions that do not change the numbers
_IGNORED_VERSIONS = {"python", "trace-replay"}


def _settings_keys(attrs: dict) -> set[str]:
    keys = attrs.get("settings_keys")
    return set(keys) if keys is not None else set(attrs) - _RUN_KEYS


def _check_weights_known(
    frames: Sequence[pd.DataFrame], names: Sequence[str], allow_unknown: bool
) -> None:
    """Refuse parts that record no weights digest (older results) beside other parts, unless
    ``allow_unknown``: then warn naming them. A part alone mixes nothing."""
    unknown = [name for name, f in zip(names, frames) if "weights_digest" not in f.attrs]
    if not unknown or len(frames) == 1:
        return
    what = (
        f"{', '.join(unknown)} record{'s' if len(unknown) == 1 else ''} no weights_digest "
        "(written before results recorded it)"
    )
    if not allow_unknown:
        raise ValueError(
            f"cannot merge: {what}, so the weights behind its numbers cannot "
            "be checked against the other parts'; replay it again, or pass "
            "allow_unknown_weights=True (CLI --allow-unknown-weights) if you "
            "know every part scored the same weights"
        )
    warnings.warn(
        f"merge: {what}; merged on trust that every part scored the same weights", stacklevel=3
    )


def _check_same_run(frames: Sequence[pd.DataFrame], names: Sequence[str]) -> None:
    """Raise naming the first setting (or package version) in which the parts differ; the
    weights' digest is compared between the parts that record one."""
    keys = set().union(*(_settings_keys(f.attrs) for f in frames))
    if all(deterministic_run(f.attrs) for f in frames):  # same numbers whatever the batch size
        keys -= set(BATCH_SETTINGS)
    versions = [
        {k: v for k, v in (f.attrs.get("versions") or {}).items() if k not in _IGNORED_VERSIONS}
        for f in frames
    ]
    checks = [
        (
            key,
            [
                (f.attrs.get(key), name)
                for f, name in zip(frames, names)
                if key != "weights_digest" or key in f.attrs
            ],
        )
        for key in sorted(keys)
    ]
    checks += [
        (f"{package} version", [(v.get(package), name) for v, name in zip(versions, names)])
        for package in sorted(set().union(*versions))
    ]
    for what, seen in checks:
        if any(value != seen[0][0] for value, _ in seen):
            listed = "; ".join(f"{value!r} in {name}" for value, name in seen)
            hint = (
                ": the same model name scored with other weights (a model edited or "
                "retrained in place?)"
                if what == "weights_digest"
                else ""
            )
            raise ValueError(
                f"cannot merge results of different runs: {what} differs ({listed}){hint}"
            )


def _check_same_traces(frames: Sequence[pd.DataFrame], names: Sequence[str]) -> None:
    """Raise naming the files unless every part replayed (a shard of) one trace set."""
    recorded = all(f.attrs.get("traces_digest") for f in frames)
    what = "traces_digest" if recorded else "source"  # older results record no digest
    values = [f.attrs.get(what) for f in frames]
    if any(value != values[0] for value in values):
        seen = "; ".join(f"{value!r} in {name}" for value, name in zip(values, names))
        raise ValueError(f"cannot merge results of different trace sets: {what} differs ({seen})")


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
            raise ValueError(
                f"cannot merge: {', '.join(whole)} is a whole run (no shard), "
                f"not a shard of one: {', '.join(names)}"
            )
        return []
    counts = sorted({count for held in shards for _, count in held})
    if len(counts) > 1:
        raise ValueError(
            f"cannot merge shards of different splits (counts {counts}): " + ", ".join(names)
        )
    for shard in {shard for held in shards for shard in held}:
        files = [name for name, held in zip(names, shards) for other in held if other == shard]
        if len(files) > 1:
            raise ValueError(
                f"cannot merge: shard {shard[0]}/{shard[1]} is given twice ({', '.join(files)})"
            )
    return sorted(set(range(counts[0])) - {index for held in shards for index, _ in held})


def _merged_attrs(
    frames: Sequence[pd.DataFrame], names: Sequence[str], merged: pd.DataFrame, missing: list[int]
) -> dict[str, Any]:
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
    attrs["num_tokens"] = len(merged)
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


def merge_results(
    parts: Sequence[str | os.PathLike],
    *,
    allow_incomplete: bool = False,
    allow_unknown_weights: bool = False,
) -> pd.DataFrame:
    """Concatenate the shard results of one run.

    Parameters
    ----------
    parts
        Parquet files written by :func:`trace_replay.runs.replay` (``trace-replay replay``):
        shards ``(i, n)`` of one trace set and split, or a single whole run.
    allow_incomplete
        Merge shards although some of the split are missing (with a warning); the result
        is marked incomplete.
    allow_unknown_weights
        Merge parts that record no ``weights_digest`` (written by an older version), with a
        warning naming them; parts that record one must still agree.

    Returns
    -------
    pandas.DataFrame
        The rows of every part in the order given; ``attrs`` hold the common settings,
        ``num_traces`` and ``num_tokens`` of the merged rows, ``complete`` (every shard present),
        ``missing_shards`` (``[index, n]`` each), ``shard`` ``None`` when complete (else
        the list merged), summed counters, the earliest start, the latest finish and
        ``merged_from``.

    Raises
    ------
    ValueError
        When the parts differ in a setting that changes the numbers, the weights' digest or
        a package version, replayed different trace sets (naming it and the files), come
        from different shard splits, repeat a shard, miss one (unless
        ``allow_incomplete``), record no weights digest (unless ``allow_unknown_weights``),
        or hold the same trace twice; when a part fails a check of
        :func:`~trace_replay.runs.result_file.read_result` (not a result file, an
        impossible score, a step missing, rows of other than the traces and tokens it
        records), naming the file, trace, step and field.
    FileNotFoundError
        When a part does not exist.

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
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
    frames = [read_result(p, "merge: result file") for p in parts]
    _check_weights_known(frames, names, allow_unknown_weights)
    _check_same_run(frames, names)
    _check_same_traces(frames, names)
    missing = _missing_shards(frames, names)
    if missing:
        count = _shards(frames[0].attrs)[0][1]
        gap = (
            f"shard {', '.join(f'{i}/{count}' for i in missing)} missing (merging "
            f"{count - len(missing)} of {count} shards)"
        )
        if not allow_incomplete:
            raise ValueError(
                f"cannot merge an incomplete set: {gap}; add the missing shard "
                "or pass allow_incomplete=True (CLI --allow-incomplete) to mark "
                "the result incomplete"
            )
        warnings.warn(
            f"merge: {gap}; the result is marked incomplete (attrs['complete'] is False)",
            stacklevel=2,
        )
    merged = pd.concat(frames, ignore_index=True)
    owner = pd.Series([name for name, f in zip(names, frames) for _ in range(len(f))])
    dup = merged.duplicated(subset=["trace_id", "step"], keep=False)
    if dup.any():
        trace_id = merged.loc[dup, "trace_id"].iloc[0]
        files = sorted(set(owner[dup & (merged["trace_id"] == trace_id)]))
        raise ValueError(
            f"cannot merge: trace {trace_id!r} is in more than one part ({', '.join(files)})"
        )
    merged.attrs = _merged_attrs(frames, names, merged, missing)
    return merged
