"""The demo (``make demo``): the bundled traces through vLLM and prefill scoring."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from trace_replay import datasets
from trace_replay._io import write_atomic, write_target
from trace_replay.analysis.metrics import engine_table
from trace_replay.wording import plural

__all__ = ["run_demo"]


def run_demo(
    out: str | Path = "out",
    engines: str = "vllm,prefill",
    limit: int | None = None,
    verbose: bool = False,
) -> dict[str, pd.DataFrame]:
    """Replay the bundled traces with each engine; print summaries, write Parquet and a figure.

    Parameters
    ----------
    out : path
        Folder for ``results_{engine}.parquet`` and ``demo.png``; created when missing.
        Each file must be new or a regular file (a link is written through): checked
        before any replay.
    engines : str
        Comma-separated engine names, replayed in order, each engine built for its replay and
        closed after it; the first two are compared. Checked before any replay: every name
        an engine that needs no options (not ``vllm-server``), none twice.
    limit : int, optional
        Traces taken from each bundled file (:func:`trace_replay.datasets.load`).
    verbose : bool
        Show vLLM's start-up logging (by default only its errors).

    Returns
    -------
    dict of str to DataFrame
        The replay frame of each engine.

    Raises
    ------
    ValueError
        Naming an engine that is unknown, needs options, or is given twice, or a path of
        ``out`` that cannot be written; before any replay.
    """
    import matplotlib.pyplot as plt

    from trace_replay.analysis.metrics import compare, summarize
    from trace_replay.engines import make_engine
    from trace_replay.plots.frames import plot_divergence_heatmap, plot_trace
    from trace_replay.runs.replay import replay

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {out} is not a folder")
    names = _engine_names(engines)
    files = {name: out / f"results_{name}.parquet" for name in names}
    for path in [*files.values(), out / "demo.png"]:
        write_target(path)
    out.mkdir(parents=True, exist_ok=True)
    traces = datasets.load(limit=limit)
    print(f"{plural(len(traces), 'bundled trace')} from {traces.source}")
    results = {}
    for name in names:
        start = time.perf_counter()
        with make_engine(name, verbose=verbose) as engine:  # released before the next starts
            df = replay(traces, engine=engine)
        df.attrs["wall_s"] = round(time.perf_counter() - start, 1)
        write_atomic(files[name], lambda temporary, df=df: df.to_parquet(temporary, index=False))
        results[name] = df
    with pd.option_context("display.width", 120, "display.precision", 4):
        print("\nPer engine:")
        print(engine_table(results).to_string(index=False))
        names = list(results)
        if len(names) >= 2:
            cmp = compare(results[names[0]], results[names[1]], labels=tuple(names[:2]))
            summary = summarize(cmp).sort_values("max_abs_delta", ascending=False)
            print(
                f"\n{names[1]} vs {names[0]}: max |Δlogprob| {cmp['abs_delta'].max():.2e}, "
                f"top-1 agreement {cmp['top1_agree'].mean():.3f}"
            )
            print("Worst traces:")
            print(
                summary.head(5)[
                    [
                        "trace_id",
                        "n_tokens",
                        "max_abs_delta",
                        "mean_abs_delta",
                        "first_divergence_step",
                    ]
                ].to_string(index=False)
            )
            first = results[names[0]]
            worst = first.groupby("trace_id")["logprob"].mean().sort_values().index[0]
            fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 9))
            plot_trace(first, worst, other=results[names[1]], ax=top)
            plot_divergence_heatmap(cmp, ax=bottom)
        else:
            first = results[names[0]]
            worst = first.groupby("trace_id")["logprob"].mean().sort_values().index[0]
            fig, top = plt.subplots(figsize=(14, 5))
            plot_trace(first, worst, ax=top)
    fig.tight_layout()
    write_atomic(out / "demo.png", lambda temporary: fig.savefig(temporary, dpi=110, format="png"))
    plt.close(fig)
    print(f"\nresults and figure in {out}/")
    return results


def _engine_names(engines: str) -> list[str]:
    """The comma-separated names, each an engine the demo can build, none twice."""
    from trace_replay.engines.registry import ENGINES, engine_spec, engine_specs

    names = [name.strip() for name in engines.split(",") if name.strip()]
    usable = [spec.name for spec in engine_specs() if not spec.needs]
    for name in names:
        if name in ENGINES and engine_spec(name).needs:
            raise ValueError(
                f"engines: {name} needs {engine_spec(name).needs}, which the "
                f"demo does not take; replay through it with trace-replay "
                f"replay --engine {name}"
            )
        if name not in ENGINES:
            raise ValueError(f"engines: unknown engine {name!r}; choose from {', '.join(usable)}")
        if names.count(name) > 1:
            raise ValueError(f"engines: {name!r} is named twice; each engine replays once")
    if not names:
        raise ValueError(f"engines: name at least one engine ({', '.join(usable)})")
    return names
