"""Decode attention over the static cache: the kernel against SDPA, per call, on CUDA.

``kernels.cache_attention`` reads only the cache blocks some query can see; the static
backend used SDPA under the mask before, which reads every slot of the length bucket. For
the decode shapes the performance issue names (SmolLM2-135M's 3 kv heads of 64 with 3
query heads each; Llama-3.1-8B's 8 of 128 with 4 each), a 256-slot cache whose rows hold
16-144 tokens (a 16-token prompt and a 128-token trace, part way), this prints device µs
per call inside a CUDA graph (no launch cost; median of ``--repeats`` graphs of 20
calls) for SDPA, the kernel as the launcher runs it (float32 also with its products in
the 3xTF32 split, as the static backend runs it), and with ``--sweep`` every
(slots per block, warps), with the largest difference from SDPA's output.

    python benchmarks/bench_cache_attention.py [--sweep]
"""

from __future__ import annotations

import torch
from bench_kernels import per_call_arguments, time_graph_us

from trace_replay.kernels.cache_attention import (
    cache_attention,
    cache_attention_reference,
    launch,
)

SHAPES = {  # name: (rows, kv heads, query heads per kv head, tokens per row, head size, dtype)
    "SmolLM2 bf16 b256": (256, 3, 3, 1, 64, torch.bfloat16),
    "SmolLM2 fp32 b64": (64, 3, 3, 1, 64, torch.float32),
    "SmolLM2 fp32 b64 verify k=8": (64, 3, 3, 9, 64, torch.float32),
    "Llama-3.1-8B bf16 b1": (1, 8, 4, 1, 128, torch.bfloat16),
    "Llama-3.1-8B bf16 b16": (16, 8, 4, 1, 128, torch.bfloat16),
    "Llama-3.1-8B bf16 b64": (64, 8, 4, 1, 128, torch.bfloat16),
    "Qwen2.5-7B bf16 b1": (1, 4, 7, 1, 128, torch.bfloat16),
}
LENGTH = 256


def inputs(rows, kv_heads, groups, q, dim, dtype, gen):
    """Random query and cache; each row sees slots up to its own cursor (16..144)."""
    query = torch.randn(rows, kv_heads, groups * q, dim, generator=gen).to("cuda", dtype)
    key, value = (
        torch.randn(rows, kv_heads, LENGTH, dim, generator=gen).to("cuda", dtype) for _ in range(2)
    )
    cursor = torch.randint(16, 145 - q, (rows,), generator=gen)
    own = cursor[:, None] + torch.arange(q)
    hidden = torch.arange(LENGTH)[None, None, :] > own[:, :, None]
    mask = torch.zeros(rows, 1, q, LENGTH).masked_fill_(hidden[:, None], torch.finfo(dtype).min)
    return query, key, value, mask.to("cuda", dtype)


def main() -> None:
    args = per_call_arguments(__doc__)
    print(f" · {LENGTH}-slot cache\n")
    gen = torch.Generator().manual_seed(0)
    print("| shape | SDPA | kernel | SDPA / kernel | max |Δ| | kernel 3xTF32 | max |Δ| 3xTF32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    sweeps = {}
    for name, (rows, kv_heads, groups, q, dim, dtype) in SHAPES.items():
        query, key, value, mask = inputs(rows, kv_heads, groups, q, dim, dtype, gen)
        scale = dim**-0.5
        expected = cache_attention_reference(query, key, value, mask, scale)
        sdpa = time_graph_us(
            lambda: cache_attention_reference(query, key, value, mask, scale), args.repeats, 20
        )
        cells = []
        # float32 inputs: FMAs (the default) and the 3xTF32 split the static backend uses
        for precision in ("ieee", "tf32x3") if dtype == torch.float32 else ("ieee",):
            kernel = time_graph_us(
                lambda p=precision: cache_attention(query, key, value, mask, scale, precision=p),
                args.repeats,
                20,
            )
            error = (
                (
                    cache_attention(query, key, value, mask, scale, precision=precision).float()
                    - expected.float()
                )
                .abs()
                .max()
                .item()
            )
            cells.append((kernel, error))
        (kernel, error), tf32x3 = cells[0], cells[1:]
        extra = f"{tf32x3[0][0]:.1f} | {tf32x3[0][1]:.1e}" if tf32x3 else "– | –"
        print(
            f"| {name} | {sdpa:.1f} | {kernel:.1f} | {sdpa / kernel:.2f} | {error:.1e} | {extra} |",
            flush=True,
        )
        if args.sweep:
            sweeps[name] = {
                (n, w): time_graph_us(
                    lambda: launch(query, key, value, mask, scale, block_n=n, num_warps=w),
                    args.repeats,
                    20,
                )
                for n in (16, 32, 64, 128)
                for w in (1, 2, 4, 8)
            }
    if sweeps:
        configs = list(next(iter(sweeps.values())))
        print("\nSweep (slots per block × warps; µs per call):\n")
        print("| shape | " + " | ".join(f"{n}×{w}" for n, w in configs) + " |")
        print("|---|" + "---:|" * len(configs))
        for name, times in sweeps.items():
            print(f"| {name} | " + " | ".join(f"{times[c]:.1f}" for c in configs) + " |")


if __name__ == "__main__":
    main()
