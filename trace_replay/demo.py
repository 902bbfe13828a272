"""The demo (``make demo``): the bundled dataset through vLLM and prefill scoring."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from trace_replay.traces import TraceSet, load_traces

__all__ = ["bundled_traces", "run_demo", "engine_table"]

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def bundled_traces(limit: int | None = None, data_dir: Path = DATA_DIR) -> TraceSet:
    """All bundled trace files (``data/*.jsonl``) in one set, ``limit`` traces per file."""
    files = sorted(data_dir.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no bundled traces in {data_dir} (run from a source checkout)")
    traces = []
    for path in files:
        traces.extend(list(load_traces(path))[:limit])
    return TraceSet(traces, source=str(data_dir))


def engine_table(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per engine: traces, tokens, mean logprob, top-1 fraction, perplexity."""
    rows = []
    for name, df in results.items():
        rows.append({"engine": name, "path": df.attrs.get("engine_path"),
                     "traces": df["trace_id"].nunique(), "tokens": len(df),
                     "mean_logprob": df["logprob"].mean(),
                     "frac_top1": (df["rank"] == 1).mean(),
                     "ppl": float(np.exp(-df["logprob"].mean())),
                     "wall_s": df.attrs.get("wall_s")})
    return pd.DataFrame(rows)


def run_demo(out: str | Path = "out", engines: str = "vllm,prefill",
             limit: int | None = None, verbose: bool = False) -> dict[str, pd.DataFrame]:
    """Replay the bundled traces with each engine; print summaries, write Parquet and a figure.

    ``verbose`` shows vLLM's start-up logging (by default only its errors).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trace_replay.analysis import compare, summarize
    from trace_replay.plots import plot_divergence_heatmap, plot_trace
    from trace_replay.replay import replay

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    traces = bundled_traces(limit)
    print(f"{len(traces)} bundled traces from {traces.source}")
    results = {}
    for name in [e.strip() for e in engines.split(",") if e.strip()]:
        start = time.perf_counter()
        df = replay(traces, engine=name, verbose=verbose)
        df.attrs["wall_s"] = round(time.perf_counter() - start, 1)
        df.to_parquet(out / f"results_{name}.parquet", index=False)
        results[name] = df
    with pd.option_context("display.width", 120, "display.precision", 4):
        print("\nPer engine:")
        print(engine_table(results).to_string(index=False))
        names = list(results)
        if len(names) >= 2:
            cmp = compare(results[names[0]], results[names[1]], labels=tuple(names[:2]))
            summary = summarize(cmp).sort_values("max_abs_delta", ascending=False)
            print(f"\n{names[1]} vs {names[0]}: max |Δlogprob| {cmp['abs_delta'].max():.2e}, "
                  f"top-1 agreement {cmp['top1_agree'].mean():.3f}")
            print("Worst traces:")
            print(summary.head(5)[["trace_id", "n_tokens", "max_abs_delta", "mean_abs_delta",
                                   "first_divergence_step"]].to_string(index=False))
            first = results[names[0]]
            worst = (first.groupby("trace_id")["logprob"].mean().sort_values().index[0])
            fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 9))
            plot_trace(first, worst, other=results[names[1]], ax=top)
            plot_divergence_heatmap(cmp, ax=bottom)
        else:
            first = results[names[0]]
            worst = first.groupby("trace_id")["logprob"].mean().sort_values().index[0]
            fig, top = plt.subplots(figsize=(14, 5))
            plot_trace(first, worst, ax=top)
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=110)
    plt.close(fig)
    print(f"\nresults and figure in {out}/")
    return results
