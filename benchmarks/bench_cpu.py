"""CPU: replay against plain greedy decoding, vLLM and the built-in engine side by side.

The bundled prompts with their traces cut to one fixed length, so every path decodes exactly
the same number of tokens per row: plain greedy decoding with logprobs (the engine's normal
work) against forced replay of the trace, in the same engine and batch. One run; medians.

Usage::

    python benchmarks/bench_cpu.py --limit 8 --length 64 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import time

import torch

from trace_replay import datasets
from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest
from trace_replay.models.load import load_tokenizer


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def vllm_greedy(engine, requests, top_k):
    """Plain vLLM greedy decoding of the same lengths, logprobs on, nothing forced."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.trace_len, ignore_eos=True,
                             logprobs=top_k, detokenize=False) for r in requests]
    return lambda: engine.llm.generate(prompts, params, use_tqdm=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8, help="traces per bundled file")
    parser.add_argument("--length", type=int, default=64, help="trace tokens per row")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="vllm,torch")
    args = parser.parse_args()
    traces = datasets.load(limit=args.limit).tokenize(load_tokenizer())
    requests = [ReplayRequest(t.id, tuple(t.prompt_token_ids),
                              tuple(t.trace_token_ids[: args.length]))
                for t in traces if len(t.trace_token_ids) >= args.length]
    tokens = sum(r.trace_len for r in requests)
    rows = []
    for name in args.engines.split(","):
        engine = make_engine(name, device="cpu", batch_size=args.batch)
        if name == "vllm":
            greedy = vllm_greedy(engine, requests, engine.top_k)
        else:
            prompts = [r.prompt_token_ids for r in requests]
            greedy = lambda e=engine, p=prompts: e.generate(p, max_tokens=args.length)  # noqa: E731
        label = engine.settings()["engine_path"]
        greedy_s = timed(greedy, args.repeats)
        replay_s = timed(lambda e=engine: e.run(requests), args.repeats)
        rows.append((label, greedy_s, replay_s))
        print(f"  {label}: greedy {greedy_s:.2f} s, replay {replay_s:.2f} s", flush=True)
        if hasattr(engine, "close"):
            engine.close()
    prefill = make_engine("prefill", device="cpu", batch_size=args.batch)
    prefill_s = timed(lambda: prefill.run(requests), args.repeats)

    print(f"\n{dt.date.today()} · {platform.machine()} CPU, {os.cpu_count()} cores · "
          f"torch {torch.__version__} · float32 · batch {args.batch} · {len(requests)} bundled "
          f"traces × {args.length} tokens = {tokens} tokens · median of {args.repeats}")
    print("\n| engine path | greedy tok/s | replay tok/s | replay / greedy |")
    print("|---|---:|---:|---:|")
    for label, greedy_s, replay_s in rows:
        print(f"| {label} | {tokens / greedy_s:,.0f} | {tokens / replay_s:,.0f} | "
              f"{greedy_s / replay_s:.2f} |")
    print(f"| teacher-forced-prefill | – | {tokens / prefill_s:,.0f} | – |")


if __name__ == "__main__":
    main()
