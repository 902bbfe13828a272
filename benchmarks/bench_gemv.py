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

A second table times what the compiled layer fuses at one row: the MLP's first half
(grouped gate/up GEMV, then the compiled SiLU·mul, against ``kernels.gated_gemv``'s one
launch) and the down projection with its residual add (GEMV, then the compiled add, against
the GEMV that adds it, ``gemv_add``), and the RMSNorm before q/k/v and gate/up (the norm
kernel, then the GEMV, against the GEMV that norms its input); ``--sweep`` sweeps the gated
and normed kernels' blocks too (q/k/v rows print ``BLOCK_N`` halved: the sweep doubles it).

    python benchmarks/bench_gemv.py [--sweep] [--shape llama-3.1-8b] [--rows 1] [--fused-only]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_kernels import time_graph_us
from shapes import SHAPES

from trace_replay.kernels import gated_gemv
from trace_replay.kernels._triton import triton
from trace_replay.kernels.gemv import blocks, launch
from trace_replay.kernels.rms_norm import Norm, rms_norm, rms_norm_reference

L2_BYTES = 256 << 20  # cycled through per graph: well past an H200's 50 MB of L2


def layers(shape: str) -> dict[str, tuple[int, list[int]]]:
    """``{name: (K, [N per member])}`` for one decoder layer and the head of ``shape``."""
    c = SHAPES[shape][1]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {
        "q/k/v": (c["hidden_size"], [q, kv, kv]),
        "o": (q, [c["hidden_size"]]),
        "gate/up": (c["hidden_size"], [c["intermediate_size"]] * 2),
        "down": (c["intermediate_size"], [c["hidden_size"]]),
        "lm_head": (c["hidden_size"], [c["vocab_size"]]),
    }


def time_cycle_us(fns, repeats: int) -> float:
    """Median device µs per call of a CUDA graph that calls each of ``fns`` once."""
    return time_graph_us(lambda: [fn() for fn in fns], repeats, 1) / len(fns)


def read_tb_s(dtype: torch.dtype, repeats: int) -> float:
    """TB/s of a plain read of 2 GiB (``torch.sum``): the practical ceiling for streaming."""
    big = torch.ones((1 << 31) // dtype.itemsize, dtype=dtype, device="cuda")
    return 2**31 / time_cycle_us([big.sum] * 4, repeats) / 1e6


def sweep_configs(
    block_ns=(4, 8, 16, 32), warps=(2, 4, 8), most=16384
) -> list[tuple[int, int, int]]:
    """``(BLOCK_N, BLOCK_K, warps)`` with ``BLOCK_N × BLOCK_K`` at most ``most``."""
    return [(n, k, w) for n in block_ns for k in (256, 512, 1024) for w in warps if n * k <= most]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", default="llama-3.1-8b", choices=[s for s in SHAPES if s != "smollm2-135m"]
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fused-only", action="store_true", help="the second table only")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {args.shape} "
        f"{args.dtype} · device µs per call in a CUDA graph, median of {args.repeats}; "
        f"TB/s = weight bytes / time; torch.sum of 2 GiB: "
        f"{read_tb_s(dtype, args.repeats):.2f} TB/s\n"
    )
    print(
        "| rows | layer (K → N) | cuBLAS per member | cuBLAS concatenated | kernel | "
        "TB/s cuBLAS (per member) | TB/s kernel | cuBLAS / kernel | max Δ vs cuBLAS | blocks |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sweeps = {}
    for rows in [] if args.fused_only else args.rows:
        for name, (depth, cols) in layers(args.shape).items():
            size = sum(cols) * depth * dtype.itemsize
            copies = max(2, -(-L2_BYTES // size))
            sets = [
                [
                    (torch.randn(n, depth, generator=gen, device="cuda") * depth**-0.5).to(dtype)
                    for n in cols
                ]
                for _ in range(copies)
            ]
            joined = [torch.cat(ws) for ws in sets]
            x = torch.randn(rows, depth, generator=gen, device="cuda").to(dtype)

            def members(ws):
                return lambda: [F.linear(x, w) for w in ws]

            per_member = time_cycle_us([members(ws) for ws in sets], args.repeats)
            concatenated = time_cycle_us([lambda w=w: F.linear(x, w) for w in joined], args.repeats)
            kernel = time_cycle_us([lambda ws=ws: launch(x, ws) for ws in sets], args.repeats)
            want = F.linear(x.float(), joined[0].float())
            delta = ((launch(x, sets[0]).float() - want).abs().max() / want.abs().max()).item()
            print(
                f"| {rows} | {name} ({depth} → {'+'.join(map(str, cols))}) | "
                f"{per_member:.1f} | {concatenated:.1f} | {kernel:.1f} | "
                f"{size / per_member / 1e6:.2f} | {size / kernel / 1e6:.2f} | "
                f"{per_member / kernel:.2f} | {delta:.1e} | {blocks(sum(cols), depth)} |",
                flush=True,
            )
            if args.sweep:
                times = {}
                for config in sweep_configs():
                    if any(c % config[0] for c in cols[:-1]):
                        continue
                    try:
                        times[config] = time_cycle_us(
                            [lambda ws=ws, c=config: launch(x, ws, config=c) for ws in sets],
                            max(5, args.repeats // 4),
                        )
                    except triton.runtime.errors.OutOfResources:
                        pass
                sweeps[f"rows {rows} {name}"] = (times, size)
            del sets, joined
    sweeps.update(fused(args.shape, dtype, args.repeats, args.sweep, gen))
    for name, (times, size) in sweeps.items():
        best = sorted(times, key=times.get)[:5]
        print(
            f"{name}: "
            + ", ".join(f"{c} {times[c]:.1f} ({size / times[c] / 1e6:.2f} TB/s)" for c in best),
            flush=True,
        )


def fused(shape: str, dtype: torch.dtype, repeats: int, sweep: bool, gen) -> dict:
    """Print the fused-epilogue table at one row; return the gated kernel's sweep."""
    c = SHAPES[shape][1]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    size = 2 * inter * hidden * dtype.itemsize
    copies = max(2, -(-L2_BYTES // size))
    pairs = [
        [
            (torch.randn(inter, hidden, generator=gen, device="cuda") * hidden**-0.5).to(dtype)
            for _ in range(2)
        ]
        for _ in range(copies)
    ]
    downs = [
        (torch.randn(hidden, inter, generator=gen, device="cuda") * inter**-0.5).to(dtype)
        for _ in range(copies)
    ]
    x = torch.randn(1, hidden, generator=gen, device="cuda").to(dtype)
    h = torch.randn(1, inter, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(1, hidden, generator=gen, device="cuda").to(dtype)
    head_dim = hidden // c["num_attention_heads"]
    qkv = [c["num_attention_heads"] * head_dim] + [c["num_key_value_heads"] * head_dim] * 2
    trios = [
        [
            (torch.randn(n, hidden, generator=gen, device="cuda") * hidden**-0.5).to(dtype)
            for n in qkv
        ]
        for _ in range(max(2, -(-L2_BYTES // (sum(qkv) * hidden * 2))))
    ]
    norm = Norm((1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype), 1e-5)
    normed = rms_norm_reference(x.float(), Norm(norm.weight.float(), norm.eps))
    silu_mul = torch.compile(lambda both: F.silu(both[:, :inter]) * both[:, inter:])
    add = torch.compile(torch.add)
    rows = {
        "gate/up, act·mul": (
            size,
            [lambda ws=ws: silu_mul(launch(x, ws)) for ws in pairs],
            [lambda ws=ws: gated_gemv.launch(x, *ws) for ws in pairs],
            gated_gemv.launch(x, *pairs[0]).float(),
            F.silu(F.linear(x.float(), pairs[0][0].float()))
            * F.linear(x.float(), pairs[0][1].float()),
        ),
        "down + residual": (
            size // 2,
            [lambda w=w: add(launch(h, [w]), residual) for w in downs],
            [lambda w=w: launch(h, [w], residual=residual) for w in downs],
            launch(h, [downs[0]], residual=residual).float(),
            F.linear(h.float(), downs[0].float()) + residual.float(),
        ),
        "norm, q/k/v": (
            sum(qkv) * hidden * dtype.itemsize,
            [lambda ws=ws: launch(rms_norm(x, norm), ws) for ws in trios],
            [lambda ws=ws: launch(x, ws, norm=norm) for ws in trios],
            launch(x, trios[0], norm=norm).float(),
            F.linear(normed, torch.cat(trios[0]).float()),
        ),
        "norm, gate/up, act·mul": (
            size,
            [lambda ws=ws: gated_gemv.launch(rms_norm(x, norm), *ws) for ws in pairs],
            [lambda ws=ws: gated_gemv.launch(x, *ws, norm=norm) for ws in pairs],
            gated_gemv.launch(x, *pairs[0], norm=norm).float(),
            F.silu(F.linear(normed, pairs[0][0].float())) * F.linear(normed, pairs[0][1].float()),
        ),
    }
    print(
        "\n| layer, one row | GEMV + compiled pointwise or norm kernel (µs) | "
        "fused launch (µs) | "
        "TB/s fused | unfused / fused | max Δ vs float32 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, (nbytes, apart, together, got, want) in rows.items():
        apart_us = time_cycle_us(apart, repeats)
        together_us = time_cycle_us(together, repeats)
        delta = ((got - want).abs().max() / want.abs().max()).item()
        print(
            f"| {name} | {apart_us:.1f} | {together_us:.1f} | "
            f"{nbytes / together_us / 1e6:.2f} | {apart_us / together_us:.2f} | "
            f"{delta:.1e} |",
            flush=True,
        )
    if not sweep:
        return {}
    configs = sweep_configs((1, 2, 4, 8, 16), (1, 2, 4, 8), 8192)
    runs = {
        "gated gate/up": (size, lambda ws, c: gated_gemv.launch(x, *ws, config=c), pairs),
        "norm, gated gate/up": (
            size,
            lambda ws, c: gated_gemv.launch(x, *ws, norm=norm, config=c),
            pairs,
        ),
        "norm, q/k/v": (
            sum(qkv) * hidden * dtype.itemsize,
            lambda ws, c: launch(x, ws, norm=norm, config=(2 * c[0], *c[1:])),
            trios,
        ),
    }
    sweeps = {}
    for name, (nbytes, fn, sets) in runs.items():
        times = {}
        for config in configs:
            try:
                times[config] = time_cycle_us(
                    [lambda ws=ws, c=config: fn(ws, c) for ws in sets], max(5, repeats // 4)
                )
            except (triton.runtime.errors.OutOfResources, ValueError):
                pass
        sweeps[f"rows 1 {name}"] = (times, nbytes)
    return sweeps


if __name__ == "__main__":
    main()
