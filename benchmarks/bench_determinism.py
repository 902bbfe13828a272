"""Deterministic mode: what it costs and what it guarantees, measured in one run.

Cost (same model, dtype, traces and batch; median of repeats after a warm-up run):

* ``torch replay`` — the built-in engine, step by step: default backend (``auto``: static +
  CUDA graphs on GPU, hf on CPU) against ``deterministic=True``.
* ``prefill`` — teacher-forced scoring, default against deterministic.

Checks (every trace token, every column: logprob, rank, top-k ids and logprobs, entropy):

* batch invariance — the run at ``--batch`` against one at batch 7 with the traces in
  reverse order: tokens bitwise equal, and the worst |Δ logprob|;
* decode vs prefill — step-by-step replay against teacher-forced prefill of the same traces.

Both checks also run in default mode, for contrast. With ``--model random`` the model is a
randomly initialised Llama of SmolLM2-135M's shape (for machines without the embedded
model; bitwise properties do not need trained weights).

Usage::

    python benchmarks/bench_determinism.py --device cpu --batch 64 --new-tokens 32
    python benchmarks/bench_determinism.py --device cuda --batch 64 --new-tokens 128 --model random
    python benchmarks/bench_determinism.py --device cuda ... --attention rows   # the per-row kernel
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time

import numpy as np
import torch

from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest

COLUMNS = ("logprob", "rank", "top_token_ids", "top_logprobs", "entropy")


def random_llama(device: str, dtype: torch.dtype):
    """A seeded random Llama with SmolLM2-135M-Instruct's shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def make_requests(count: int, new_tokens: int, vocab: int, seed: int = 0) -> list[ReplayRequest]:
    """Prompts of 8-40 tokens and traces of ``new_tokens - (i % 8)`` tokens, seeded."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        prompt = rng.integers(1, vocab, int(rng.integers(8, 41))).tolist()
        trace = rng.integers(1, vocab, max(1, new_tokens - i % 8)).tolist()
        requests.append(ReplayRequest(f"t{i}", tuple(prompt), tuple(trace)))
    return requests


def timed(engine, requests, device, repeats: int) -> tuple[float, list]:
    results = engine.run(requests)  # warm-up: compiles kernels, captures graphs
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        results = engine.run(requests)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), results


def profile(engine, requests, label: str, rows: int = 12) -> None:
    """Kernel launches and the top kernels by device time of one ``engine.run``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.run(requests)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in kernels)
    device_us = sum(e.self_device_time_total for e in kernels)
    print(
        f"\nprofile of {label}: {launches} kernel launches, {device_us / 1e3:.1f} ms on the device"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def _bits(values: np.ndarray) -> np.ndarray:
    """Per-step rows of raw bits (a float compares by its bit pattern: -0.0 != 0.0)."""
    values = np.ascontiguousarray(values)
    return values.view(np.int64).reshape(len(values), -1)


def agreement(a: list, b: list) -> tuple[int, int, float]:
    """(tokens bitwise equal in every column, tokens, max |Δ logprob|) of two result lists."""
    by_id = {r.trace_id: r for r in b}
    equal = total = 0
    worst = 0.0
    for ra in a:
        rb = by_id[ra.trace_id]
        same = np.ones(len(ra.logprob), dtype=bool)
        for column in COLUMNS:
            same &= (_bits(getattr(ra, column)) == _bits(getattr(rb, column))).all(axis=1)
        equal += int(same.sum())
        total += len(same)
        worst = max(worst, float(np.abs(ra.logprob - rb.logprob).max()))
    return equal, total, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="embedded", choices=["embedded", "random"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--traces", type=int, default=None, help="default: --batch")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-cost", action="store_true", help="checks only")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--attention",
        choices=["rows", "tiles"],
        default=None,
        help="deterministic mode's Triton attention (default: the engines', "
        "deterministic_attention='tiles')",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="a torch.profiler table of one run of each engine (CUDA)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.model == "random":
        lm = random_llama(args.device, dtype)
    else:
        from trace_replay.models.load import load_model

        lm = load_model(device=args.device, dtype=args.dtype)
    requests = make_requests(args.traces or args.batch, args.new_tokens, lm.config.vocab_size)
    tokens = sum(r.trace_len for r in requests)
    print(
        f"{dt.date.today()} {platform.node()} {platform.processor() or platform.machine()} "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else ''} torch "
        f"{torch.__version__} threads {torch.get_num_threads()}; {args.model} model, "
        f"{args.dtype}, {len(requests)} traces, {tokens} tokens, batch {args.batch}"
    )

    results, rows = {}, []
    # decode and prefill share the attention: their bits agree only then
    attention = {"deterministic_attention": args.attention} if args.attention else {}
    for name in ("torch", "prefill"):
        for deterministic in (False, True):
            engine = make_engine(
                name, lm, batch_size=args.batch, deterministic=deterministic, **attention
            )
            path = engine.settings()["engine_path"]
            if deterministic and name == "torch":
                print("deterministic arithmetic:", engine.settings()["arithmetic"])
            if args.skip_cost:
                seconds, out = float("nan"), engine.run(requests)
            else:
                seconds, out = timed(engine, requests, device, args.repeats)
            results[name, deterministic] = out
            if args.profile and device.type == "cuda":
                profile(engine, requests, f"{path} (deterministic={deterministic})")
            rows.append((name, path, deterministic, seconds))
            if name == "torch":  # batch invariance: batch 7, traces reversed
                small = make_engine(
                    name, lm, batch_size=7, deterministic=deterministic, **attention
                )
                results["small", deterministic] = small.run(requests[::-1])
            engine.close()

    if not args.skip_cost:
        print("\n| engine path | deterministic | median s | tokens/s | × default |")
        print("|---|---|---:|---:|---:|")
        for name, path, deterministic, seconds in rows:
            base = next(s for n, _, d, s in rows if n == name and not d)
            print(
                f"| {path} | {deterministic} | {seconds:.3f} | {tokens / seconds:,.0f} | "
                f"{seconds / base:.2f} |"
            )
    if device.type == "cuda":  # what deterministic mode would do without Triton
        from trace_replay.engines.builtin.backends.deterministic_ops import probe_linear

        linears = [m.weight for m in lm.modules() if isinstance(m, torch.nn.Linear)]
        try:
            sizes = probe_linear(linears, (16, 32, 64, 128, 256))
        except RuntimeError as exc:
            sizes = str(exc)
        print(f"\ncuBLAS GEMM row counts giving a row equal bits (probe): {sizes}")
    print("\n| check | mode | tokens bitwise equal | max abs Δ logprob |")
    print("|---|---|---:|---:|")
    for deterministic in (False, True):
        mode = "deterministic" if deterministic else "default"
        for label, a, b in (
            (
                f"batch {args.batch} vs batch 7 reversed",
                ("torch", deterministic),
                ("small", deterministic),
            ),
            (
                "decode replay vs teacher-forced prefill",
                ("torch", deterministic),
                ("prefill", deterministic),
            ),
        ):
            equal, total, worst = agreement(results[a], results[b])
            print(f"| {label} | {mode} | {equal}/{total} | {worst:.3g} |")
    # how far deterministic arithmetic moves a token from the default path's
    _, total, worst = agreement(results["torch", True], results["torch", False])
    print(
        f"\ndeterministic vs default decode replay: max |Δ logprob| {worst:.3g} over {total} tokens"
    )


if __name__ == "__main__":
    main()
