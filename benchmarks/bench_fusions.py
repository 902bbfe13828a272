"""The batch-1 fusions on and off (the torch engine's ``batch1_fusions``): its static backend
at the Llama-3.1-8B shape, bfloat16, random weights, 16-token prompts, a 128-token greedy
trace per row. Two engines on one model, one built with the fusions and one without, run
interleaved; prints ms/step per round, the median and the paired ratio (off / on).

Usage (CUDA only; the fusions run at one half-precision row)::

    python benchmarks/bench_fusions.py --batch 1 --rounds 11
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics

import numpy as np
import torch
from bench_replay import paired, timed_rounds
from shapes import hbm_bound_seconds, random_model

from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda")
    lm = random_model(args.shape, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(args.batch)
    prompts = [
        torch.randint(3, lm.config.vocab_size, (16,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    engines = {
        enabled: make_engine(
            "torch", lm, batch_size=args.batch, backend="static", batch1_fusions=enabled
        )
        for enabled in (True, False)
    }
    traces = [ids for ids, _ in engines[True].generate(prompts, max_tokens=args.new_tokens)]
    requests = [
        ReplayRequest(str(i), tuple(p), tuple(t)) for i, (p, t) in enumerate(zip(prompts, traces))
    ]
    on, off = (engines[True].run(requests), engines[False].run(requests))
    delta = max(float(np.abs(a.logprob - b.logprob).max()) for a, b in zip(on, off))
    times = timed_rounds(
        [lambda: engines[True].run(requests), lambda: engines[False].run(requests)],
        device,
        args.rounds,
    )
    bound = hbm_bound_seconds(lm, args.batch, 16, args.new_tokens)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}; {args.shape} bf16 batch {args.batch}, "
        f"{args.new_tokens} steps, {args.rounds} rounds; max |logprob on - off| {delta:.3g}"
    )
    for name, seconds in (("fusions on", times[0]), ("fusions off", times[1])):
        steps = [1e3 * s / args.new_tokens for s in seconds]
        print(
            f"  {name}: median {statistics.median(steps):.3f} ms/step, HBM bound / time "
            f"{bound / statistics.median(seconds):.0%}; rounds "
            + " ".join(f"{s:.3f}" for s in steps)
        )
    median, low, high = paired(times[1], times[0])
    print(f"off / on: median {median:.3f} (range {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
