"""Prefill peak memory (RSS) against the number of traces, chunked scoring vs full logits.

Each measurement runs in a fresh process (peak RSS only grows), replaying ``n`` traces of
``--length`` random tokens after a 16-token prompt with the prefill engine (batch 8, top-5,
float32, CPU). "chunked" is the engine as shipped (lm_head + log-softmax over chunks of
scored positions); "full" sets the chunk budget so high that one chunk holds every scored
position of a batch, which is what the engine did before (full-vocabulary logits for
every position). Prints peak RSS, the model's resident size after loading, and the ratio.

Usage::

    python benchmarks/bench_prefill_memory.py --counts 1,8,64 --full-counts 1 --length 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(count: int, length: int, mode: str, batch_size: int) -> dict:
    """One measurement, in this process: peak RSS of replaying ``count`` traces."""
    import torch

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest

    engine = make_engine("prefill", device="cpu", batch_size=batch_size, top_k=5)
    if mode == "full":
        engine.score_chunk_bytes = 2**62
    gen = torch.Generator().manual_seed(count * 7919 + length)
    requests = [ReplayRequest(str(i), tuple(torch.randint(3, 49152, (16,), generator=gen).tolist()),
                              tuple(torch.randint(3, 49152, (length,), generator=gen).tolist()))
                for i in range(count)]
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    resident = _rss_mib()
    start = time.perf_counter()
    results = engine.run(requests)
    seconds = time.perf_counter() - start
    assert sum(len(r.logprob) for r in results) == count * length
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"count": count, "length": length, "mode": mode, "peak_mib": peak,
            "after_load_mib": resident, "load_peak_mib": loaded, "seconds": seconds,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,8,64")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--full-counts", default="1",
                        help="counts measured with full logits too (8 x 2048 needs ~13 GB)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # COUNT:MODE, internal
    args = parser.parse_args()
    if args.one:
        count, mode = args.one.split(":")
        print(json.dumps(measure(int(count), args.length, mode, args.batch_size)))
        return
    rows = []
    runs = [("chunked", int(c)) for c in args.counts.split(",")]
    runs += [("full", int(c)) for c in args.full_counts.split(",") if c]
    for mode, count in runs:
        out = subprocess.run([sys.executable, __file__, "--one", f"{count}:{mode}",
                              "--length", str(args.length), "--batch-size",
                              str(args.batch_size)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if out.returncode != 0:
            print(f"{count} traces, {mode}: failed ({out.stderr.strip().splitlines()[-1]})")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{mode:8s} {count:3d} traces x {r['length']} tokens: peak RSS "
              f"{r['peak_mib']:8,.0f} MiB (after load {r['after_load_mib']:,.0f} MiB), "
              f"{r['seconds']:.1f} s", flush=True)
    full = {r["count"]: r["peak_mib"] for r in rows if r["mode"] == "full"}
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch threads {rows[0]['threads'] if rows else '?'}, batch {args.batch_size}")
    print("| traces × tokens | chunked peak RSS MiB | full-logits peak RSS MiB | full / chunked |")
    print("|---|---:|---:|---:|")
    for r in (r for r in rows if r["mode"] == "chunked"):
        other = full.get(r["count"])
        ratio = f"{other / r['peak_mib']:.1f}" if other else "—"
        print(f"| {r['count']} × {r['length']} | {r['peak_mib']:,.0f} | "
              f"{f'{other:,.0f}' if other else '—'} | {ratio} |")


if __name__ == "__main__":
    main()
