"""Per-step cost of the tail mass on the CPU: score_tokens with its tail fused into the
entropy pass, against the same scoring with the tail as its own three passes (the
normaliser recomputed: ``tail_logmass`` on the log-softmax, as the scorer did before).

Both are timed interleaved (one call of each per round, the order alternating), on random
float32 logits of the embedded model's decode shapes (vocabulary 49,152); the table gives
the median ms per call of each and their ratio, and the largest |Δ tail| between them.

    python benchmarks/bench_tail.py --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trace_replay.engines.builtin.scoring import TokenScores, score_tokens, tail_logmass


def separate_tail(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
    """score_tokens' numbers with the tail in passes of its own (the rule before fusing)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprob = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rank = (logprobs > logprob[:, None]).sum(dim=1) + 1
    entropy = -(logprobs.exp() * logprobs).nan_to_num(nan=0.0).sum(dim=1)
    top_ids = logits.topk(top_k, dim=-1).indices
    return TokenScores(
        logprob,
        rank,
        top_ids,
        logprobs.gather(1, top_ids),
        entropy,
        tail_logmass(logprobs, top_ids),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}, top_k {args.top_k}, median of {args.rounds} rounds")
    print(
        f"{'rows':>5} {'fused ms':>9} {'separate ms':>12} {'fused/separate':>15} {'max|dtail|':>11}"
    )
    for rows in (1, 8, 64):
        logits = torch.randn(rows, 49152, generator=gen) * 3
        tokens = torch.randint(0, 49152, (rows,), generator=gen)
        fused, separate = (
            score_tokens(logits, tokens, args.top_k),
            separate_tail(logits, tokens, args.top_k),
        )
        for name in ("logprob", "rank", "entropy", "top_logprobs"):
            assert torch.equal(getattr(fused, name), getattr(separate, name)), name
        gap = (fused.tail_logmass - separate.tail_logmass).abs().max().item()
        times: dict[str, list[float]] = {"fused": [], "separate": []}
        pair = [("fused", score_tokens), ("separate", separate_tail)]
        for r in range(args.rounds):
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                start = time.perf_counter()
                fn(logits, tokens, args.top_k)
                times[name].append(time.perf_counter() - start)
        a, b = (statistics.median(times[k]) * 1e3 for k in ("fused", "separate"))
        print(f"{rows:>5} {a:>9.3f} {b:>12.3f} {a / b:>15.2f} {gap:>11.1e}")


if __name__ == "__main__":
    main()
