"""``sweep``: every combination of a grid of settings replayed and compared with a base run."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from trace_replay.analysis.metrics import compare, dataset_summary
from trace_replay.engines.cache import ModelCache, check_settings
from trace_replay.runs.replay import TraceInput, replay
from trace_replay.traces.sets import load_traces

__all__ = ["sweep", "grid_settings"]


def grid_settings(
    base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]
) -> list[dict[str, Any]]:
    """``base`` updated with each combination of ``grid``, in ``itertools.product`` order."""
    empty = [key for key, values in grid.items() if isinstance(values, str) or not len(values)]
    if empty:
        raise ValueError(f"grid values must be non-empty lists; check {', '.join(empty)}")
    keys = list(grid)
    return [
        {**base, **dict(zip(keys, combo))} for combo in itertools.product(*(grid[k] for k in keys))
    ]


def sweep(
    traces: TraceInput,
    base: Mapping[str, Any],
    grid: Mapping[str, Sequence[Any]],
    *,
    progress: bool = True,
    models: ModelCache | None = None,
) -> pd.DataFrame:
    """Replay ``traces`` under every combination of ``grid`` and compare each with ``base``.

    Parameters
    ----------
    traces
        Anything :func:`~trace_replay.load_traces` reads.
    base
        ``replay`` settings of the reference run, plus ``engine`` and ``model`` (see
        :meth:`~trace_replay.engines.cache.ModelCache.engine`); e.g.
        ``{"engine": "torch", "dtype": "float32", "batch_size": 1}``.
    grid
        Setting name -> values, e.g. ``{"dtype": ["float32", "bfloat16"],
        "batch_size": [1, 8, 64], "deterministic": [False, True]}``. A configuration equal
        to ``base`` is run again: it measures run-to-run reproducibility.
    progress
        Show a tqdm bar over configurations.
    models
        Where loaded models are kept (one per model, dtype and device, reused by every
        configuration); default a fresh :class:`~trace_replay.engines.cache.ModelCache`.

    Returns
    -------
    DataFrame
        One row per configuration, in grid order: the grid keys, every metric of
        :func:`~trace_replay.dataset_summary` for ``compare(base run, configuration run)``
        (same names), and ``wall_s`` (the configuration's replay time, model loading
        excluded). ``attrs``: ``grid`` (its keys), ``base`` (the base engine's settings),
        ``metrics`` (the metric columns), ``configurations`` (each run's engine settings).

    Examples
    --------
    >>> import trace_replay as tr
    >>> traces = [{"id": "t", "prompt": "The capital of France is", "completion": " Paris."}]
    >>> table = tr.sweep(traces, {"engine": "prefill"}, {"dtype": ["float32", "bfloat16"]},
    ...                  progress=False)
    >>> table[["dtype", "n_tokens"]]
          dtype  n_tokens
    0   float32       2.0
    1  bfloat16       2.0
    >>> bool(table.loc[1, "max_abs_delta"] > 0)  # bfloat16 moves the logprobs
    True
    >>> ax = tr.plot_sweep(table, metric="max_abs_delta", x="dtype")
    """
    configurations = grid_settings(base, grid)
    check_settings(base, "sweep base")
    for config in configurations:  # a typo in the grid fails before the base run, too
        check_settings(config, "sweep grid")
    traceset = load_traces(traces)
    models = ModelCache() if models is None else models
    base_run, _ = _run(traceset, base, models)
    rows, settings = [], []
    for config in tqdm(configurations, disable=not progress, unit="config", desc="sweep"):
        try:
            run, wall_s = _run(traceset, config, models)
            summary = dataset_summary(compare(base_run, run))
        except Exception as exc:
            exc.add_note(f"in sweep configuration { ({k: config[k] for k in grid}) }")
            raise
        metrics = dict(zip(summary["metric"], summary["value"]))
        rows.append({**{k: config[k] for k in grid}, **metrics, "wall_s": wall_s})
        settings.append(_provenance(run.attrs))
    table = pd.DataFrame(rows)
    table.attrs = {
        "grid": list(grid),
        "base": _provenance(base_run.attrs),
        "metrics": [c for c in table.columns if c not in grid and c != "wall_s"],
        "configurations": settings,
    }
    return table


def _run(traceset, settings: Mapping[str, Any], models: ModelCache) -> tuple[pd.DataFrame, float]:
    with models.engine(settings) as engine:
        start = time.perf_counter()
        frame = replay(traceset, engine=engine, progress=False)
        return frame, round(time.perf_counter() - start, 3)


def _provenance(attrs: Mapping[str, Any]) -> dict[str, Any]:
    keep = (
        "engine",
        "engine_path",
        "model",
        "dtype",
        "device",
        "batch_size",
        "top_k",
        "deterministic",
    )
    return {k: attrs[k] for k in keep if k in attrs}
