"""Per-step scoring cost: what a replay step pays beyond greedy decoding, and ways to cut it.

Every decode step of a replay scores its rows' forced tokens on the full distribution
(logprob, rank, top-k, entropy: ``trace_replay.engines.builtin.scoring.score_tokens``); greedy
decoding with logprobs pays the same minus the top-k. This script times, on random logits
of the decode shapes the performance issue names, per call (CUDA events, median of
``--repeats`` bursts of ``--calls`` calls):

* ``argmax``                  — what greedy decoding alone needs;
* ``eager k=0`` / ``eager k=K`` — ``score_tokens`` run op by op (greedy's / replay's scoring);
* ``fast k=0`` / ``fast k=K`` — ``scorer_for(device)``: on CUDA the top-k kernel
  (``trace_replay.kernels.top_k``) plus the rest compiled by ``torch.compile``;
* top-k alone, four ways: ``torch.topk`` on float32 logprobs (the scorer before), on the
  model-dtype logits, in two torch stages (top-k of each 1,024-wide chunk, then of the
  candidates), and the Triton kernel;
* on CUDA, the Triton kernel's device time per call inside a CUDA graph (no launch cost)
  for each first-pass chunk × group × warps, the best one named.

It also checks that the fast scorer agrees with the eager one (max |Δ logprob|; ranks and
top-k logprobs equal — ids may differ among tied logits) and that every top-k variant
returns the same values.

    python benchmarks/bench_scoring.py                # CUDA
    python benchmarks/bench_scoring.py --device cpu --repeats 3 --calls 3
"""

from __future__ import annotations

import argparse

import torch
from bench_kernels import time_eager_us, time_graph_us  # µs per call: eager, in a CUDA graph

from trace_replay.engines.builtin.scoring import score_tokens, scorer_for
from trace_replay.kernels.top_k import CHUNK, GROUP, NUM_WARPS, top_k_indices

CHUNKS = (128, 256, 512, 1024)
GROUPS = (1, 4, 16)
WARPS = (1, 4, 8)
CONFIGS = [(c, g, w) for c in CHUNKS for g in GROUPS for w in WARPS]
SHAPES = [  # (rows, vocabulary, dtype): the 135M and 8B decode steps
    (64, 49152, torch.float32),
    (256, 49152, torch.bfloat16),
    (1, 128256, torch.bfloat16),
    (64, 128256, torch.bfloat16),
]


def two_stage_topk(logits: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """Indices of the top ``k`` of each row: top-k per chunk, then over the candidates."""
    rows, vocab = logits.shape
    pad = -vocab % chunk
    padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    local = padded.view(rows, -1, chunk).topk(k, dim=-1)
    flat = local.values.reshape(rows, -1).topk(k, dim=-1)
    base = torch.arange(0, vocab + pad, chunk, device=logits.device)[:, None]
    candidates = (local.indices + base).reshape(rows, -1)
    return candidates.gather(1, flat.indices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    device, k = torch.device(args.device), args.top_k
    compiled = scorer_for(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, top_k={k}, median of {args.repeats} bursts "
        f"of {args.calls} calls, µs per call\n"
    )
    print(
        "| rows × vocab | dtype | argmax | eager k=0 | eager k=K | fast k=0 | fast k=K | "
        "topk fp32 logprobs | topk logits | topk two-stage | topk kernel | "
        "fast vs eager max Δ | ranks, top-k equal |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator(device=device).manual_seed(0)
    sweep = {}
    for rows, vocab, dtype in SHAPES:
        logits = (torch.randn(rows, vocab, generator=gen, device=device) * 3).to(dtype)
        tokens = torch.randint(0, vocab, (rows,), generator=gen, device=device)
        logprobs = torch.log_softmax(logits.float(), -1)
        t = {
            "argmax": lambda: logits.argmax(-1),
            "eager0": lambda: score_tokens(logits, tokens, 0),
            "eagerk": lambda: score_tokens(logits, tokens, k),
            "comp0": lambda: compiled(logits, tokens, 0),
            "compk": lambda: compiled(logits, tokens, k),
            "top32": lambda: logprobs.topk(k, -1),
            "toplog": lambda: logits.topk(k, -1),
            "top2": lambda: two_stage_topk(logits, k),
            "kernel": lambda: top_k_indices(logits, k),
        }
        us = {key: time_eager_us(fn, args.repeats, args.calls, device) for key, fn in t.items()}
        eager, fast = score_tokens(logits, tokens, k), compiled(logits, tokens, k)
        delta = float((eager.logprob - fast.logprob).abs().max())
        same = bool(
            torch.equal(eager.rank, fast.rank)
            and float((eager.top_logprobs - fast.top_logprobs).abs().max()) <= 1e-5
        )
        want = logprobs.topk(k, -1).values
        for ids in (
            logits.topk(k, -1).indices,
            two_stage_topk(logits, k),
            top_k_indices(logits, k),
        ):
            assert torch.equal(logprobs.gather(1, ids), want), "top-k variants disagree"
        cells = " | ".join(f"{us[key]:.1f}" for key in t)
        print(f"| {rows} × {vocab} | {str(dtype)[6:]} | {cells} | {delta:.1e} | {same} |")
        if device.type == "cuda":
            sweep[f"{rows} × {vocab}"] = {
                config: time_graph_us(
                    lambda c=config: top_k_indices(
                        logits, k, chunk=c[0], group=c[1], num_warps=c[2]
                    ),
                    args.repeats,
                    20,
                )
                for config in CONFIGS
            }
    if not sweep:
        return
    print(
        f"\nThe top-k kernel by first-pass chunk × group × warps: device µs per call inside "
        f"a CUDA graph (default {CHUNK}×{GROUP}×{NUM_WARPS}):\n"
    )
    print("| chunk×group×warps | " + " | ".join(sweep) + " |")
    print("|---|" + "---:|" * len(sweep))
    for config in CONFIGS:
        print(
            f"| {'×'.join(map(str, config))} | "
            + " | ".join(f"{times[config]:.1f}" for times in sweep.values())
            + " |"
        )
    print(
        "| best | "
        + " | ".join("×".join(map(str, min(times, key=times.get))) for times in sweep.values())
        + " |"
    )


if __name__ == "__main__":
    main()
