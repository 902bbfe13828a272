"""One-row linear layers at 7-8B shapes: cuBLAS against ``kernels.gemv``, on CUDA.

A batch-1 decode step is bound by reading the weights. For the linear layers of a
Llama-3.1-8B or Qwen2.5-7B shape in bfloat16 (q/k/v and gate/up as the groups a compiled
layer launches together, cuBLAS both per member and over the members' concatenated weight),
this prints device µs per call and the bandwidth it reaches (weight bytes / time), inside a
CUDA graph that cycles through enough weight copies that none is still in L2 when its turn
comes (median of ``--repeats`` graphs); and the largest difference from cuBLAS, relative to
the largest |output|. First line: what a plain read of 2 GiB reaches (``torch.sum``), the
practical ceiling. ``--sweep`` times block configurations of the kernel and prints the best
five of each layer as ``(BLOCK_N, BLOCK_K, warps) µs``.

    python benchmarks/bench_gemv.py [--sweep] [--shape llama-3.1-8b] [--rows 1]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_kernels import time_graph_us
from shapes import SHAPES

from trace_replay._triton import triton
from trace_replay.kernels.gemv import blocks, launch

L2_BYTES = 256 << 20  # cycled through per graph: well past an H200's 50 MB of L2


def layers(shape: str) -> dict[str, tuple[int, list[int]]]:
    """``{name: (K, [N per member])}`` for one decoder layer and the head of ``shape``."""
    c = SHAPES[shape][1]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {"q/k/v": (c["hidden_size"], [q, kv, kv]), "o": (q, [c["hidden_size"]]),
            "gate/up": (c["hidden_size"], [c["intermediate_size"]] * 2),
            "down": (c["intermediate_size"], [c["hidden_size"]]),
            "lm_head": (c["hidden_size"], [c["vocab_size"]])}


def time_cycle_us(fns, repeats: int) -> float:
    """Median device µs per call of a CUDA graph that calls each of ``fns`` once."""
    return time_graph_us(lambda: [fn() for fn in fns], repeats, 1) / len(fns)


def sweep_configs() -> list[tuple[int, int, int]]:
    return [(n, k, w) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (2, 4, 8)
            if n * k <= 16384]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=[s for s in SHAPES
                                                                    if s != "smollm2-135m"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    big = torch.ones(1 << 30, dtype=dtype, device="cuda")
    read_us = time_cycle_us([big.sum] * 4, args.repeats)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {args.shape} "
          f"{args.dtype} · device µs per call in a CUDA graph, median of {args.repeats}; "
          f"TB/s = weight bytes / time; torch.sum of 2 GiB: {2**31 / read_us / 1e6:.2f} TB/s\n")
    del big
    print("| rows | layer (K → N) | cuBLAS per member | cuBLAS concatenated | kernel | "
          "TB/s cuBLAS (per member) | TB/s kernel | cuBLAS / kernel | max Δ vs cuBLAS | blocks |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sweeps = {}
    for rows in args.rows:
        for name, (depth, cols) in layers(args.shape).items():
            size = sum(cols) * depth * dtype.itemsize
            copies = max(2, -(-L2_BYTES // size))
            sets = [[(torch.randn(n, depth, generator=gen, device="cuda") * depth**-0.5)
                     .to(dtype) for n in cols] for _ in range(copies)]
            joined = [torch.cat(ws) for ws in sets]
            x = torch.randn(rows, depth, generator=gen, device="cuda").to(dtype)

            def members(ws):
                return lambda: [F.linear(x, w) for w in ws]

            per_member = time_cycle_us([members(ws) for ws in sets], args.repeats)
            concatenated = time_cycle_us([lambda w=w: F.linear(x, w) for w in joined],
                                         args.repeats)
            kernel = time_cycle_us([lambda ws=ws: launch(x, ws) for ws in sets], args.repeats)
            want = F.linear(x.float(), joined[0].float())
            delta = ((launch(x, sets[0]).float() - want).abs().max() / want.abs().max()).item()
            print(f"| {rows} | {name} ({depth} → {'+'.join(map(str, cols))}) | "
                  f"{per_member:.1f} | {concatenated:.1f} | {kernel:.1f} | "
                  f"{size / per_member / 1e6:.2f} | {size / kernel / 1e6:.2f} | "
                  f"{per_member / kernel:.2f} | {delta:.1e} | {blocks(sum(cols), depth)} |",
                  flush=True)
            if args.sweep:
                times = {}
                for config in sweep_configs():
                    if any(c % config[0] for c in cols[:-1]):
                        continue
                    try:
                        times[config] = time_cycle_us(
                            [lambda ws=ws, c=config: launch(x, ws, config=c) for ws in sets],
                            max(5, args.repeats // 4))
                    except triton.runtime.errors.OutOfResources:
                        pass
                sweeps[f"rows {rows} {name}"] = (times, size)
            del sets, joined
    for name, (times, size) in sweeps.items():
        best = sorted(times, key=times.get)[:5]
        print(f"{name}: " + ", ".join(f"{c} {times[c]:.1f} ({size / times[c] / 1e6:.2f} TB/s)"
                                      for c in best), flush=True)


if __name__ == "__main__":
    main()
