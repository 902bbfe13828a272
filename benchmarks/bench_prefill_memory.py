"""Prefill peak memory (RSS) against the number of traces, chunked scoring vs full logits.

Each measurement runs in a fresh process (peak RSS only grows), replaying ``n`` traces of
``--length`` random tokens after a 16-token prompt with the prefill engine (batch 8, top-5,
float32, CPU). "chunked" is the engine as shipped (lm_head + log-softmax over chunks of
scored positions); "full" sets the chunk budget so high that one chunk holds every scored
position of a batch, which is what the engine did before (full-vocabulary logits for
every position). ``--deterministic`` measures the batch-invariant path the same way: its
"full" is one row-invariant head and scoring call over every scored position of a batch,
as it ran before it was chunked too. Prints peak RSS, the model's resident size after
loading, and the ratio. ``--device cuda`` reports the peak of torch's CUDA allocator
(``max_memory_allocated``) as the peak instead, and ``--model random`` runs a seeded random
Llama of SmolLM2-135M's shape (memory does not depend on trained weights) where the
embedded model is not at hand; on CUDA each "full" run is also compared bit for bit with
the chunked one of the same count (deterministic mode promises equality).

Usage::

    python benchmarks/bench_prefill_memory.py --counts 1,8,64 --full-counts 1 --length 2048
    python benchmarks/bench_prefill_memory.py --deterministic --counts 1,8 --full-counts 1,8
    python benchmarks/bench_prefill_memory.py --deterministic --device cuda --model random \
        --batch-size 64 --counts 1,8,64 --full-counts 1,8,64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(
    count: int,
    length: int,
    mode: str,
    batch_size: int,
    deterministic: bool,
    device: str = "cpu",
    model: str = "embedded",
) -> dict:
    """One measurement, in this process: peak RSS (CPU) or peak CUDA allocation of
    replaying ``count`` traces."""
    import torch

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest

    lm = None
    if model == "random":
        from bench_determinism import random_llama  # this folder is on sys.path

        lm = random_llama(device, torch.float32)
    engine = make_engine(
        "prefill", lm, device=device, batch_size=batch_size, top_k=5, deterministic=deterministic
    )
    if mode == "full":
        engine.score_chunk_bytes = 2**62
    gen = torch.Generator().manual_seed(count * 7919 + length)
    requests = [
        ReplayRequest(
            str(i),
            tuple(torch.randint(3, 49152, (16,), generator=gen).tolist()),
            tuple(torch.randint(3, 49152, (length,), generator=gen).tolist()),
        )
        for i in range(count)
    ]
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = loaded = torch.cuda.memory_allocated() / 2**20
    else:
        loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        resident = _rss_mib()
    start = time.perf_counter()
    results = engine.run(requests)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert sum(len(r.logprob) for r in results) == count * length
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    digest = hashlib.sha256()
    for r in results:
        for column in (r.logprob, r.rank, r.top_token_ids, r.top_logprobs, r.entropy):
            digest.update(np.ascontiguousarray(column).tobytes())
    return {
        "count": count,
        "length": length,
        "mode": mode,
        "peak_mib": peak,
        "after_load_mib": resident,
        "load_peak_mib": loaded,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "digest": digest.hexdigest()[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,8,64")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument(
        "--full-counts",
        default="1",
        help="counts measured with full logits too (8 x 2048 needs ~13 GB)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--deterministic", action="store_true", help="the batch-invariant path (deterministic=True)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="embedded", choices=["embedded", "random"])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # COUNT:MODE, internal
    args = parser.parse_args()
    if args.one:
        count, mode = args.one.split(":")
        print(
            json.dumps(
                measure(
                    int(count),
                    args.length,
                    mode,
                    args.batch_size,
                    args.deterministic,
                    args.device,
                    args.model,
                )
            )
        )
        return
    rows = []
    runs = [("chunked", int(c)) for c in args.counts.split(",")]
    runs += [("full", int(c)) for c in args.full_counts.split(",") if c]
    what = "peak CUDA allocation" if args.device.startswith("cuda") else "peak RSS"
    for mode, count in runs:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                f"{count}:{mode}",
                "--length",
                str(args.length),
                "--batch-size",
                str(args.batch_size),
                "--device",
                args.device,
                "--model",
                args.model,
            ]
            + ["--deterministic"] * args.deterministic,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        if out.returncode != 0:
            print(f"{count} traces, {mode}: failed ({out.stderr.strip().splitlines()[-1]})")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{mode:8s} {count:3d} traces x {r['length']} tokens: {what} "
            f"{r['peak_mib']:8,.0f} MiB (after load {r['after_load_mib']:,.0f} MiB), "
            f"{r['seconds']:.1f} s",
            flush=True,
        )
    full = {r["count"]: r for r in rows if r["mode"] == "full"}
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {rows[0]['torch'] if rows else '?'} with "
        f"{rows[0]['threads'] if rows else '?'} threads, device {args.device}, "
        f"{args.model} model, batch {args.batch_size}, deterministic {args.deterministic}"
    )
    print(
        f"| traces × tokens | chunked {what} MiB | full-logits {what} MiB | full / chunked "
        "| same bits |"
    )
    print("|---|---:|---:|---:|---|")
    for r in (r for r in rows if r["mode"] == "chunked"):
        other = full.get(r["count"])
        cells = (
            ("—", "—", "—")
            if other is None
            else (
                f"{other['peak_mib']:,.0f}",
                f"{other['peak_mib'] / r['peak_mib']:.1f}",
                "yes" if other["digest"] == r["digest"] else "NO",
            )
        )
        print(
            f"| {r['count']} × {r['length']:,} | {r['peak_mib']:,.0f} | " + " | ".join(cells) + " |"
        )


if __name__ == "__main__":
    main()
