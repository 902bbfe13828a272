"""Replay throughput: the built-in engine against plain decoding and HF ``generate``.

All rows come from one run on one machine, so the ratios compare like with like:
same model (the embedded SmolLM2-135M-Instruct), dtype, batch, prompt and trace lengths.

* ``hf-generate+forcing`` — transformers ``generate`` (greedy, KV cache) with a logits
  processor that forces the trace, scores returned: the usual way to replay with HF.
* ``torch[B] greedy``  — the built-in loop on backend B decoding freely (no trace),
  logprobs kept.
* ``torch[B] replay``  — the built-in loop replaying the trace step by step.
* ``torch[B] verify(trace, k)`` — the verify path, drafts taken from the trace.
* ``prefill``       — teacher-forced scoring of the same traces.

Backends (``--backends``): ``hf`` (transformers forward, growing cache) and ``static``
(static KV cache, CUDA graphs on GPU). "× greedy" divides by greedy on the same backend.
On CUDA the host synchronizations of one full replay are counted; ``--profile N`` adds, per
backend, torch.profiler tables of a replay of N decode steps.

Usage::

    python benchmarks/bench_replay.py --device cpu --batch 8 --new-tokens 64
    python benchmarks/bench_replay.py --device cuda --batch 64 --new-tokens 128 --backends hf,static
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time
import warnings

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines import make_engine
from trace_replay.models import load_model, load_tokenizer

PROMPTS = [
    "def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.",
    "Q: What is 17 * 23?\nA:", "import numpy as np\n\n", "Once upon a time,",
    "The three laws of motion are", "SELECT name FROM users WHERE",
]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_generate_forcing(lm, prompts, traces, pad_id):
    """transformers generate, greedy, with a processor forcing each row's trace."""
    from transformers import LogitsProcessor, LogitsProcessorList

    width = max(len(p) for p in prompts)
    device = lm.device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    forced = torch.tensor(traces, device=device)

    class Force(LogitsProcessor):
        def __call__(self, ids, scores):
            step = ids.shape[1] - width
            keep = forced[:, step]
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, keep[:, None], 0.0)

    def run():
        out = lm.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                          max_new_tokens=forced.shape[1], min_new_tokens=forced.shape[1],
                          do_sample=False, logits_processor=LogitsProcessorList([Force()]),
                          output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id)
        # logprob and rank of the forced token from the raw logits, as replay reports them
        logits = torch.stack(out.logits, 1).float()
        logprobs = torch.log_softmax(logits, -1)
        lp = logprobs.gather(2, forced[:, :, None])
        return (logprobs > lp).sum(-1)

    return run


def profile_replay(engine, requests, device, steps):
    """Top ops of a replay of ``steps`` decode steps (after a warm-up), as text tables."""
    from torch.profiler import ProfilerActivity, profile

    short = [ReplayRequest(r.trace_id, r.prompt_token_ids, r.trace_token_ids[: steps + 1])
             for r in requests]
    engine.run(short)  # warm-up: graph capture happens here
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.run(short)
        _sync(device)
    ms = (time.perf_counter() - start) * 1e3
    tables = [f"{engine.settings()['engine_path']}: {steps} decode steps (+ prefill) in {ms:.1f} ms "
              "under the profiler"]
    keys = (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
    for key in keys:
        tables.append(prof.key_averages().table(sort_by=key, row_limit=12,
                                                max_name_column_width=48))
    return "\n".join(tables)


def count_syncs(engine, requests, device):
    """Host synchronizations in one full replay (CUDA sync debug mode warnings)."""
    if device.type != "cuda":
        return None
    engine.run(requests)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.run(requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=8, help="drafts per verify step")
    parser.add_argument("--skip-hf", action="store_true", help="skip hf-generate+forcing")
    parser.add_argument("--backends", default="hf,static", help="torch engine backends")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N decode steps of replay per backend")
    args = parser.parse_args()
    device = torch.device(args.device)
    lm = load_model(dtype=args.dtype, device=device)
    tok = load_tokenizer()
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]

    backends = args.backends.split(",")
    greedy = make_engine("torch", lm, batch_size=args.batch, backend=backends[0])
    generated = greedy.generate(prompts, max_tokens=args.new_tokens)  # no EOS stop: fixed length
    traces = [ids for ids, _ in generated]
    requests = [ReplayRequest(str(i), tuple(p), tuple(t))
                for i, (p, t) in enumerate(zip(prompts, traces))]
    tokens = sum(len(t) for t in traces)

    rows = []

    def add(name, fn, backend="–"):
        seconds = timed(fn, device, args.repeats)
        rows.append((name, backend, seconds, tokens / seconds))
        print(f"  {name}: {seconds:.3f} s", flush=True)

    if not args.skip_hf:
        add("hf-generate+forcing", hf_generate_forcing(lm, prompts, traces, greedy.pad_id))
    profiles, syncs = [], {}
    for backend in backends:
        engine = make_engine("torch", lm, batch_size=args.batch, backend=backend)
        label = f"torch[{engine.backend.name}]"
        add(f"{label} greedy (no trace)", lambda e=engine: e.generate(
            prompts, max_tokens=args.new_tokens), backend)
        add(f"{label} replay", lambda e=engine: e.run(requests), backend)
        verify = make_engine("torch", lm, batch_size=args.batch, backend=backend,
                             speculative={"method": "trace", "num_tokens": args.k})
        add(f"{label} verify(trace, k={args.k})", lambda e=verify: e.run(requests), backend)
        syncs[label] = count_syncs(engine, requests, device)
        if args.profile:
            profiles.append(profile_replay(engine, requests, device, args.profile))
    prefill = make_engine("prefill", lm, batch_size=args.batch)
    add("prefill (teacher-forced)", lambda: prefill.run(requests))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"\n{dt.date.today()} · {name or platform.machine()} · torch {torch.__version__} · "
          f"{args.dtype} · batch {args.batch} · {args.new_tokens} trace tokens/row · "
          f"median of {args.repeats}")
    greedy_tps = {b: tps for name, b, _, tps in rows if "greedy" in name}
    hf_tps = next((tps for name, _, _, tps in rows if name == "hf-generate+forcing"), None)
    print("\n| path | median s | tokens/s | × hf-generate+forcing | × greedy (same backend) |")
    print("|---|---:|---:|---:|---:|")
    for name, backend, seconds, tps in rows:
        vs_hf = f"{tps / hf_tps:.2f}" if hf_tps else "–"
        vs_greedy = f"{tps / greedy_tps[backend]:.2f}" if backend in greedy_tps else "–"
        print(f"| {name} | {seconds:.3f} | {tps:,.0f} | {vs_hf} | {vs_greedy} |")
    if device.type == "cuda":
        print("\nHost synchronizations in one full replay (CUDA sync debug mode): " +
              ", ".join(f"{label} {n}" for label, n in syncs.items()))
    for table in profiles:
        print("\n" + table)

if __name__ == "__main__":
    main()
