"""Paired replay (issue 54): its cost against the two engines' separate replays, and its peak
host memory as traces grow.

    .venv/bin/python benchmarks/bench_paired.py [--traces 4] [--length 64] [--rounds 7]

Part 1 times, in one process, ``replay_pair(traces, a, b)`` against ``replay(traces, a)`` +
``replay(traces, b)`` (a: the built-in decode engine, b: the prefill engine, float32, the
embedded model) in interleaved rounds (each round runs both, the order alternating) and
prints the median of each, and the median over rounds of the round's ratio (target <= 1.1). Part 2 runs a paired replay of 1x, 4x and 16x the tokens, each in a fresh process,
and prints its peak resident memory beside what ``[tokens, vocab]`` float32 logits would
take: a paired replay that never holds them stays flat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def traces(n: int, length: int) -> list[dict]:
    """``n`` traces of ``length`` tokens from the bundled GSM8K model answers (repeated)."""
    import trace_replay as tr

    loaded = tr.datasets.load("gsm8k_cot", source="model")
    out = []
    for i in range(n):
        trace = loaded[i % len(loaded)]
        out.append(
            {
                "id": f"t{i}",
                "prompt_token_ids": list(trace.prompt_token_ids),
                "trace_token_ids": list(trace.trace_token_ids)[:length],
            }
        )
    return out


def timing(args) -> None:
    import torch

    import trace_replay as tr

    torch.set_num_threads(args.threads)
    data = traces(args.traces, args.length)
    a = tr.make_engine("torch", dtype="float32", batch_size=args.traces)
    b = tr.make_engine("prefill", dtype="float32", batch_size=args.traces)
    tr.replay_pair(data[:1], a, b)  # warm both paths
    tr.replay(data[:1], engine=a, progress=False)
    tr.replay(data[:1], engine=b, progress=False)
    runs = {
        "paired": lambda: tr.replay_pair(data, a, b),
        "separate": lambda: (
            tr.replay(data, engine=a, progress=False),
            tr.replay(data, engine=b, progress=False),
        ),
    }
    times: dict[str, list[float]] = {"paired": [], "separate": []}
    for round_ in range(args.rounds):
        # interleaved, the order alternating, so slow drift in the load hits both alike
        for name in ("paired", "separate") if round_ % 2 == 0 else ("separate", "paired"):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    ratios = [p / s for p, s in zip(times["paired"], times["separate"])]
    p, s = statistics.median(times["paired"]), statistics.median(times["separate"])
    tokens = sum(len(t["trace_token_ids"]) for t in data)
    print(
        f"{args.traces} traces x {args.length} tokens ({tokens} tokens), torch float32 + "
        f"prefill float32, {args.threads} threads, {args.rounds} interleaved rounds"
    )
    print(f"{'paired replay_pair':<28}{p:8.2f} s  (median)")
    print(f"{'replay(a) + replay(b)':<28}{s:8.2f} s  (median)")
    print(f"{'ratio paired / separate':<28}{statistics.median(ratios):8.3f}  (median of rounds)")
    print(f"{'  per round':<28}" + " ".join(f"{r:.3f}" for r in ratios))


def memory_child(n: int, length: int) -> None:
    import resource

    import torch

    import trace_replay as tr

    torch.set_num_threads(1)
    a = tr.make_engine("torch", dtype="float32", batch_size=4)
    b = tr.make_engine("prefill", dtype="float32", batch_size=4)
    data = traces(n, length)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    df = tr.replay_pair(data, a, b)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "tokens": len(df),
                "vocab": a.vocab_size,
                "rss_before_mib": before / 1024,
                "rss_peak_mib": after / 1024,
            }
        )
    )


def memory(args) -> None:
    print(f"\n{'tokens':>8}{'peak RSS MiB':>14}{'growth MiB':>12}{'[tokens, V] f32 MiB':>21}")
    for scale in (1, 4, 16):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", str(4 * scale), str(args.length)],
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        full = got["tokens"] * got["vocab"] * 4 / 2**20
        print(
            f"{got['tokens']:>8}{got['rss_peak_mib']:>14.0f}"
            f"{got['rss_peak_mib'] - got['rss_before_mib']:>12.0f}{full:>21.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-child", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    timing(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
