"""CPU: replay against plain greedy decoding, vLLM and the built-in engine side by side.

The bundled prompts with their traces cut to one fixed length, so every path decodes exactly
the same number of tokens per row: plain greedy decoding with logprobs (the engine's normal
work) against forced replay of the trace, in the same engine, batch and thread count (each
engine's own, :func:`~trace_replay.engines.threads.engine_threads`: greedy is timed under it
too, so a ratio compares forcing with decoding, never one thread count with another). Also:
deterministic mode against the default (its cost), and teacher-forced prefill's achieved
FLOP/s against a large float32 matmul timed at the same threads. Every configuration is
timed once per round, rounds interleaved; medians. A short warm-up pass first.

Usage::

    python benchmarks/bench_cpu.py --limit 8 --length 64 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from trace_replay import datasets
from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.threads import intra_op_threads
from trace_replay.models.load import load_tokenizer


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def vllm_greedy(engine, requests: list[ReplayRequest], batch: int) -> Callable[[], None]:
    """Plain vLLM greedy decoding of the same lengths, logprobs on, nothing forced, at the
    engine's threads, ``batch`` requests per call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run() -> None:
        with intra_op_threads(engine.threads):
            for part in chunks(requests, batch):
                prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in part]
                params = [
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=r.trace_len,
                        ignore_eos=True,
                        logprobs=engine.top_k,
                        detokenize=False,
                    )
                    for r in part
                ]
                engine.llm.generate(prompts, params, use_tqdm=False)

    return run


def replay(engine, requests: list[ReplayRequest], batch: int) -> Callable[[], None]:
    return lambda: [engine.run(part) for part in chunks(requests, batch)]


def torch_greedy(engine, requests: list[ReplayRequest], batch: int) -> Callable[[], None]:
    length = max(r.trace_len for r in requests)
    return lambda: [
        engine.generate([r.prompt_token_ids for r in part], max_tokens=length)
        for part in chunks(requests, batch)
    ]


def matmul(threads: int, size: int) -> Callable[[], None]:
    """A plain ``size``³ float32 matmul at ``threads``: the CPU's compute for this dtype."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)

    def run() -> None:
        with intra_op_threads(threads):
            for _ in range(4):
                torch.mm(a, b, out=out)

    return run


def prefill_flops(config, requests: list[ReplayRequest]) -> float:
    """FLOPs the prefill engine's forward must do for ``requests``: every linear over each
    fed token (prompt and trace but its last), causal attention over them, and the lm_head
    at the scored positions only (what it computes; padding is not counted). The products
    agree with torch's ``FlopCounterMode`` over a packed prefill run (662.7 GFLOP of
    ``aten.mm`` on the default 16 traces × 64 tokens, this function's linear and lm_head
    terms exactly); attention (causal half, 18.5 GFLOP there) is by formula, as the counter
    does not count SDPA's CPU kernel. Norms, rotary, activations and softmax: not counted."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_token = (
        2
        * layers
        * (
            d * heads * head_dim
            + 2 * d * kv * head_dim
            + heads * head_dim * d
            + 3 * d * config.intermediate_size
        )
    )
    total = 0.0
    for r in requests:
        n = r.prompt_len + r.trace_len - 1
        total += n * per_token + layers * 4 * heads * head_dim * n * (n + 1) / 2
        total += r.trace_len * 2 * d * config.vocab_size
    return total


def load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(__file__),
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8, help="traces per bundled file")
    parser.add_argument("--length", type=int, default=64, help="trace tokens per row")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--batch1-traces",
        type=int,
        default=2,
        help="traces replayed one at a time for the batch-1 rows",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--engines",
        default="vllm,torch,torch:hf",
        help="vllm, torch (its CPU default backend), torch:<backend>",
    )
    parser.add_argument("--matmul-size", type=int, default=2048)
    args = parser.parse_args()
    traces = datasets.load(limit=args.limit).tokenize(load_tokenizer())
    requests = [
        ReplayRequest(t.id, tuple(t.prompt_token_ids), tuple(t.trace_token_ids[: args.length]))
        for t in traces
        if len(t.trace_token_ids) >= args.length
    ]
    single = requests[: args.batch1_traces]
    sizes = {args.batch: requests, 1: single}
    # name -> (tokens, fn); pairs -> ratio rows
    timed: dict[str, tuple[int, Callable[[], None]]] = {}
    engines = {}
    labels = {}
    for name in args.engines.split(","):
        kind, _, backend = name.partition(":")  # torch:static, the built-in engine's backend
        engine = make_engine(
            kind, device="cpu", batch_size=args.batch, **({"backend": backend} if backend else {})
        )
        engines[name] = engine
        labels[name] = engine.settings()["engine_path"] + ("" if backend else " (CPU default)")
        greedy = vllm_greedy if name == "vllm" else torch_greedy
        for batch, reqs in sizes.items():
            tokens = sum(r.trace_len for r in reqs)
            timed[f"{name} greedy b{batch}"] = (tokens, greedy(engine, reqs, batch))
            timed[f"{name} replay b{batch}"] = (tokens, replay(engine, reqs, batch))
    tokens = sum(r.trace_len for r in requests)
    deterministic = make_engine("torch", device="cpu", batch_size=args.batch, deterministic=True)
    labels["torch-det"] = deterministic.settings()["engine_path"] + " vs the CPU default"
    timed[f"torch-det replay b{args.batch}"] = (tokens, replay(deterministic, requests, args.batch))
    prefill = make_engine("prefill", device="cpu", batch_size=args.batch)
    labels["prefill"] = prefill.settings()["engine_path"]
    # the prefill engine batches itself (shortest first), as tr.replay hands it every trace
    timed["prefill"] = (tokens, lambda: prefill.run(requests))
    prefill_det = make_engine("prefill", device="cpu", batch_size=args.batch, deterministic=True)
    labels["prefill-det"] = prefill_det.settings()["engine_path"]
    timed["prefill-det"] = (tokens, lambda: prefill_det.run(requests))
    threads = prefill.threads
    mm_flops = 4 * 2 * args.matmul_size**3
    timed["matmul"] = (0, matmul(threads, args.matmul_size))

    warm = requests[:2]
    for engine in [*engines.values(), deterministic, prefill, prefill_det]:
        engine.run(warm)
    for name, engine in engines.items():
        if name != "vllm":
            torch_greedy(engine, warm, args.batch)()
    if "vllm" in engines:
        vllm_greedy(engines["vllm"], warm, args.batch)()
    timed["matmul"][1]()

    times: dict[str, list[float]] = {key: [] for key in timed}
    loads = [load()]
    for _ in range(args.rounds):
        for key, (_, fn) in timed.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
        loads.append(load())
        print(f"  round done, load {loads[-1]}", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    rate = {key: timed[key][0] / median[key] for key in timed if timed[key][0]}

    print(
        f"\n{dt.date.today()} · commit {commit()} · {cpu_model()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs) · load average {' → '.join(loads)} · torch "
        f"{torch.__version__} · float32 · engine threads {threads} · {len(requests)} bundled "
        f"traces × {args.length} tokens ({tokens} tokens) at batch {args.batch}, "
        f"{len(single)} × {args.length} at batch 1 · median of {args.rounds} interleaved rounds"
    )
    print("\n| engine path | batch | greedy tok/s | replay tok/s | replay / greedy |")
    print("|---|---:|---:|---:|---:|")
    for name in engines:
        for batch in sizes:
            g, r = f"{name} greedy b{batch}", f"{name} replay b{batch}"
            print(
                f"| {labels[name]} | {batch} | {rate[g]:,.0f} | {rate[r]:,.0f} | "
                f"{median[g] / median[r]:.2f} |"
            )
    b = args.batch
    for name in engines:
        if name != "vllm" and "vllm" in engines:
            print(
                f"\n{labels[name]} replay / vLLM greedy: batch {b} "
                f"{rate[f'{name} replay b{b}'] / rate[f'vllm greedy b{b}']:.2f}, batch 1 "
                f"{rate[f'{name} replay b1'] / rate['vllm greedy b1']:.2f}",
                end="",
            )
    print()
    print(
        "\n| deterministic mode | replay tok/s | default tok/s | cost (deterministic / default time) |"
    )
    print("|---|---:|---:|---:|")
    if "torch" in engines:
        print(
            f"| {labels['torch-det']} | {rate[f'torch-det replay b{b}']:,.0f} | "
            f"{rate[f'torch replay b{b}']:,.0f} | "
            f"{median[f'torch-det replay b{b}'] / median[f'torch replay b{b}']:.2f}× |"
        )
    print(
        f"| {labels['prefill-det']} | {rate['prefill-det']:,.0f} | {rate['prefill']:,.0f} | "
        f"{median['prefill-det'] / median['prefill']:.2f}× |"
    )
    if "vllm" in engines:
        print(f"| {labels['vllm']} | – | – | no batch-invariant mode in vLLM's CPU build |")
    flops = prefill_flops(prefill.lm.config, requests)
    achieved, peak = flops / median["prefill"], mm_flops / median["matmul"]
    print(
        f"\nprefill: {rate['prefill']:,.0f} trace tok/s, {flops / 1e9:.1f} GFLOP per pass "
        f"(prompt and trace tokens, lm_head at scored positions) → {achieved / 1e9:.1f} "
        f"GFLOP/s; float32 matmul {args.matmul_size}³ at {threads} thread(s): "
        f"{peak / 1e9:.1f} GFLOP/s; prefill at {achieved / peak:.0%} of it"
    )


if __name__ == "__main__":
    main()
