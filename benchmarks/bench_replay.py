"""Replay throughput: the built-in engine against plain decoding and HF ``generate``.

All rows come from one run on one machine, so the ratios compare like with like:
same model (the embedded SmolLM2-135M-Instruct), dtype, batch, prompt and trace lengths.

* ``hf-generate+forcing`` — transformers ``generate`` (greedy, KV cache) with a logits
  processor that forces the trace, scores returned: the usual way to replay with HF.
* ``torch greedy``  — the built-in loop decoding freely (no trace), logprobs kept.
* ``torch replay``  — the built-in loop replaying the trace step by step.
* ``torch verify(trace, k)`` — the verify path, drafts taken from the trace.
* ``prefill``       — teacher-forced scoring of the same traces.

Usage::

    python benchmarks/bench_replay.py --device cpu --batch 8 --new-tokens 64
    python benchmarks/bench_replay.py --device cuda --batch 64 --new-tokens 128
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.prefill import PrefillEngine
from trace_replay.engines.torch_engine import TorchEngine
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=8, help="drafts per verify step")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    lm = load_model(dtype=args.dtype, device=device)
    tok = load_tokenizer()
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]

    greedy = TorchEngine(lm, batch_size=args.batch)
    generated = greedy.generate(prompts, max_tokens=args.new_tokens)  # no EOS stop: fixed length
    traces = [ids for ids, _ in generated]
    requests = [ReplayRequest(str(i), tuple(p), tuple(t))
                for i, (p, t) in enumerate(zip(prompts, traces))]
    tokens = sum(len(t) for t in traces)

    rows = []

    def add(name, fn):
        seconds = timed(fn, device, args.repeats)
        rows.append((name, seconds, tokens / seconds))
        print(f"  {name}: {seconds:.3f} s", flush=True)

    if not args.skip_hf:
        add("hf-generate+forcing", hf_generate_forcing(lm, prompts, traces, greedy.pad_id))
    add("torch greedy (no trace)", lambda: greedy.generate(prompts, max_tokens=args.new_tokens))
    add("torch replay", lambda: greedy.run(requests))
    verify = TorchEngine(lm, batch_size=args.batch,
                         speculative={"method": "trace", "num_tokens": args.k})
    add(f"torch verify(trace, k={args.k})", lambda: verify.run(requests))
    prefill = PrefillEngine(lm, batch_size=args.batch)
    add("prefill (teacher-forced)", lambda: prefill.run(requests))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"\n{dt.date.today()} · {name or platform.machine()} · torch {torch.__version__} · "
          f"{args.dtype} · batch {args.batch} · {args.new_tokens} trace tokens/row · "
          f"median of {args.repeats}")
    base = dict((r[0], r[2]) for r in rows)
    print("\n| path | median s | tokens/s | × hf-generate+forcing | × torch greedy |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds, tps in rows:
        hf = f"{tps / base['hf-generate+forcing']:.2f}" if "hf-generate+forcing" in base else "–"
        print(f"| {name} | {seconds:.3f} | {tps:,.0f} | {hf} | "
              f"{tps / base['torch greedy (no trace)']:.2f} |")


if __name__ == "__main__":
    main()
