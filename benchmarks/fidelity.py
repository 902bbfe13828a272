"""Fidelity of every engine and dtype against a float64 teacher-forced computation.

For each (engine, dtype) the bundled traces are replayed and every token's logprob is
compared with the float64 log-softmax of the same model (transformers forward over
prompt + trace, no engine code involved). Ranks are compared up to near-ties (1e-4).

Usage::

    python benchmarks/fidelity.py --limit 6 --engines torch,prefill,vllm --dtypes float32,bfloat16
    python benchmarks/fidelity.py --limit 4 --engines torch,torch:hf --dtypes float32  # backends
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import platform

import numpy as np
import torch

from trace_replay import datasets
from trace_replay.engines import make_engine
from trace_replay.models.load import load_model, load_tokenizer
from trace_replay.runs.replay import replay


def reference64(traces):
    lm = copy.deepcopy(load_model(device="cpu")).double()
    out = {}
    with torch.inference_mode():
        for t in traces:
            ids = list(t.prompt_token_ids) + list(t.trace_token_ids)
            logits = lm(input_ids=torch.tensor([ids])).logits[0]
            start = len(t.prompt_token_ids) - 1
            out[t.id] = torch.log_softmax(
                logits[start : start + len(t.trace_token_ids)], -1
            ).numpy()
    return out


def score(df, ref, tie=1e-4):
    deltas, rank_ok = [], []
    for trace_id, group in df.groupby("trace_id", sort=False):
        for row, lp64 in zip(group.itertuples(), ref[trace_id]):
            target = lp64[row.token_id]
            deltas.append(abs(row.logprob - target))
            lo = 1 + int((lp64 > target + tie).sum())
            hi = 1 + int((lp64 > target - tie).sum())
            rank_ok.append(lo <= row.rank <= hi)
    deltas = np.asarray(deltas)
    return {
        "tokens": len(deltas),
        "max_abs": deltas.max(),
        "median_abs": np.median(deltas),
        "p99_abs": np.quantile(deltas, 0.99),
        "rank_match": np.mean(rank_ok),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=6, help="traces per bundled file")
    parser.add_argument(
        "--engines", default="torch,prefill,vllm", help="names, or torch:<backend> (torch:hf)"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    traces = datasets.load(limit=args.limit).tokenize(load_tokenizer())
    ref = reference64(traces)
    rows = []
    for engine_name in args.engines.split(","):
        for dtype in args.dtypes.split(","):
            kind, _, backend = engine_name.partition(":")  # torch:hf, a built-in backend
            options = {"backend": backend} if backend else {}
            engine = make_engine(kind, dtype=dtype, device="cpu", **options)
            df = replay(traces, engine=engine, progress=False)
            rows.append(
                {
                    "engine": engine_name,
                    "path": df.attrs["engine_path"],
                    "dtype": dtype,
                    **score(df, ref),
                }
            )
            if hasattr(engine, "close"):
                engine.close()
            del engine
    print(
        f"\n{dt.date.today()} · {platform.machine()} CPU · torch {torch.__version__} · "
        f"{len(traces)} bundled traces ({args.limit} per file)"
    )
    print(
        "\n| engine | path | dtype | tokens | max abs Δ | median abs Δ | p99 abs Δ | "
        "rank = float64 (up to ties) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['path']} | {r['dtype']} | {r['tokens']} | "
            f"{r['max_abs']:.2e} | {r['median_abs']:.2e} | {r['p99_abs']:.2e} | "
            f"{r['rank_match']:.3f} |"
        )


if __name__ == "__main__":
    main()
