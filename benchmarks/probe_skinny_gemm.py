"""Could a Triton tensor-core GEMM stream the 8B shape's weights faster than cuBLAS at 16-64 rows?

Issue 32 item 1 asks for the Llama-3.1-8B bf16 decode step at >= 70% of the HBM bound at
batch 16 and 64; the profile (RESULTS, "the built-in engine profiled") puts 86% of the step
in cuBLAS GEMMs streaming weights at 3.1-3.3 TB/s, 72-77% of a plain read. This probe times,
for each layer of one decoder layer and the head (q/k/v and gate/up over their
concatenated weights, as one launch), cuBLAS ``F.linear`` against a split-K Triton GEMM
(``tl.dot``, float32 accumulation; the split's partials summed by ``torch.sum`` in the same
graph) over a sweep of tiles, stages and splits, and prints the best configuration's µs and
TB/s beside cuBLAS's, then the sum over a step (32 layers + head) for both.

Times are device µs per call inside a CUDA graph that cycles through enough weight copies
that none is in L2 when its turn comes (``bench_gemv.time_cycle_us``), median of
``--repeats``. First line: what a plain read of 2 GiB reaches.

    python benchmarks/probe_skinny_gemm.py [--rows 16 64] [--repeats 10]
"""

# No `from __future__ import annotations`: Triton must see `tl.constexpr` itself.

import argparse
import itertools

import torch
import torch.nn.functional as F
from bench_gemv import L2_BYTES, layers, read_tb_s, time_cycle_us

from trace_replay.kernels._triton import tl, triton


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out: [SPLIT, M, N] float32 partials; program (n tile, k range)
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        k = start + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * K + k[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :],
                    mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + pid_s.to(tl.int64) * M * N
    tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def skinny(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int]):
    """``x @ w.T`` (bf16 out) by the kernel at ``(BLOCK_N, BLOCK_K, warps, stages, split)``."""
    rows, depth = x.shape
    cols = w.shape[0]
    block_n, block_k, warps, stages, split = config
    per_split = -(-depth // (split * block_k)) * block_k
    split = -(-depth // per_split)
    partials = torch.empty((split, rows, cols), dtype=torch.float32, device=x.device)
    _skinny_kernel[(triton.cdiv(cols, block_n), split)](
        x, w, partials, rows, cols, depth, per_split, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return (partials[0] if split == 1 else partials.sum(0)).to(x.dtype)


def configs(cols: int) -> list[tuple[int, int, int, int, int]]:
    out = []
    for block_n, block_k, warps, stages in itertools.product((32, 64, 128), (64, 128, 256),
                                                             (4, 8), (3, 5)):
        if block_n * block_k > 128 * 128:
            continue
        tiles = -(-cols // block_n)
        for split in sorted({1, max(1, 264 // tiles), max(1, 528 // tiles)}):
            out.append((block_n, block_k, warps, stages, min(split, 16)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton "
          f"{triton.__version__} · {args.shape} bf16 · torch.sum of 2 GiB: "
          f"{read_tb_s(dtype, args.repeats):.2f} TB/s\n")
    print("| rows | layer (K → N) | cuBLAS µs | TB/s | Triton best µs | TB/s | cuBLAS / Triton | "
          "max rel Δ | config (BLOCK_N, BLOCK_K, warps, stages, split) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_layer = layers(args.shape)
    count = 32  # decoder layers of the 8B shape
    for rows in args.rows:
        step = {"cublas": 0.0, "triton": 0.0}
        for name, (depth, cols) in per_layer.items():
            n = sum(cols)
            size = n * depth * dtype.itemsize
            copies = max(2, -(-L2_BYTES // size))
            ws = [(torch.randn(n, depth, generator=gen, device="cuda") * depth**-0.5).to(dtype)
                  for _ in range(copies)]
            x = torch.randn(rows, depth, generator=gen, device="cuda").to(dtype)
            cublas = time_cycle_us([lambda w=w: F.linear(x, w) for w in ws], args.repeats)
            times = {}
            for config in configs(n):
                try:
                    times[config] = time_cycle_us([lambda w=w: skinny(x, w, config) for w in ws],
                                                  max(3, args.repeats // 2))
                except (triton.runtime.errors.OutOfResources, RuntimeError):
                    continue
            best = min(times, key=times.get)
            fast = time_cycle_us([lambda w=w: skinny(x, w, best) for w in ws], args.repeats)
            want = F.linear(x.float(), ws[0].float())
            delta = ((skinny(x, ws[0], best).float() - want).abs().max()
                     / want.abs().max()).item()
            weight = 1 if name == "lm_head" else count
            step["cublas"] += weight * cublas
            step["triton"] += weight * min(fast, cublas)
            print(f"| {rows} | {name} ({depth} → {n}) | {cublas:.1f} | {size / cublas / 1e6:.2f} | "
                  f"{fast:.1f} | {size / fast / 1e6:.2f} | {cublas / fast:.2f} | {delta:.1e} | "
                  f"{best} |", flush=True)
            del ws
        print(f"\nrows {rows}: linears of one step (32 layers + head) cuBLAS "
              f"{step['cublas'] / 1e3:.2f} ms, the faster of the two per layer "
              f"{step['triton'] / 1e3:.2f} ms\n", flush=True)


if __name__ == "__main__":
    main()
