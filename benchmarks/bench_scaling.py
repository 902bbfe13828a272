"""Scaling of the built-in engine: tokens/s and peak memory against batch and trace length.

Traces are random token ids (the model's numbers do not matter for speed) after a fixed
16-token prompt; every row replays exactly ``length`` tokens. Also reports the trace
storage's bytes per held token against upstream's ``max_num_reqs × max_model_len`` layout.

Usage::

    python benchmarks/bench_scaling.py --device cuda --batches 1,4,16,64,256 \
        --lengths 32,128,512,2048 --backend auto
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines import make_engine
from trace_replay.models.load import load_model


def run(lm, batch, length, backend, repeats, device):
    gen = torch.Generator().manual_seed(batch * 100_003 + length)
    vocab = lm.config.vocab_size
    requests = [ReplayRequest(str(i), tuple(torch.randint(3, vocab, (16,), generator=gen).tolist()),
                              tuple(torch.randint(3, vocab, (length,), generator=gen).tolist()))
                for i in range(batch)]
    engine = make_engine("torch", lm, batch_size=batch, backend=backend)
    engine.run(requests)  # warm-up (graph capture)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.run(requests)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    state = engine.trace_state
    return {"batch": batch, "length": length, "seconds": statistics.median(times),
            "tok_s": batch * length / statistics.median(times), "peak_mib": peak,
            "backend": engine.backend.name,
            "state_bytes_per_token": state.storage_bytes / (batch * length)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--lengths", default="32,128,512,2048")
    parser.add_argument("--fixed-length", type=int, default=128, help="length for the batch sweep")
    parser.add_argument("--fixed-batch", type=int, default=16, help="batch for the length sweep")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    lm = load_model(device=device)
    points = [(int(b), args.fixed_length) for b in args.batches.split(",")]
    points += [(args.fixed_batch, int(n)) for n in args.lengths.split(",")
               if (args.fixed_batch, int(n)) not in points]
    rows = []
    for batch, length in points:
        rows.append(run(lm, batch, length, args.backend, args.repeats, device))
        r = rows[-1]
        print(f"  batch {batch:4d} length {length:5d}: {r['tok_s']:10,.0f} tok/s "
              f"peak {r['peak_mib']:8.0f} MiB", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{dt.date.today()} · {name} · torch {torch.__version__} · float32 · "
          f"backend {rows[0]['backend']} · median of {args.repeats}")
    print("\n| batch | trace length | tokens/s | peak GPU MiB | trace state B/token |"
          " upstream B/token (max_model_len 8192) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        upstream = r["batch"] * 8192 * 4 / (r["batch"] * r["length"])
        print(f"| {r['batch']} | {r['length']} | {r['tok_s']:,.0f} | {r['peak_mib']:,.0f} | "
              f"{r['state_bytes_per_token']:.1f} | {upstream:.0f} |")


if __name__ == "__main__":
    main()
