"""Float32 linear layers: cuBLAS against the 3xTF32 tensor-core kernel, per call, on CUDA.

For the linear layers of a float32 SmolLM2-135M replay at 64 rows (decode), 576 rows (a
k = 8 verify forward: 9 tokens per row) and 1,024 rows (a 16-token prefill), this prints
device µs per call inside a CUDA graph (no launch cost; median of ``--repeats`` graphs of 20
calls) for cuBLAS in float32 (what ``F.linear`` runs with TF32 off), cuBLAS with TF32 (for
scale only: it is not accurate enough), and ``kernels.fp32_linear``; and each one's largest
error against the float64 product, relative to the largest |output|. ``--sweep`` times every
block configuration of the kernel at split 1 (no split-K), and splits 2 to 8 of a few block
configurations (``SPLIT_BLOCKS`` and the launcher's own), and prints the best five of each
shape as ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split) µs``; a split is printed as it
runs (``fp32_linear.split_depth``: clamped so that no split's range of K is empty), and one
that clamps to a split already timed is timed once.

    python benchmarks/bench_fp32_linear.py [--sweep] [--rows decode|verify|prefill]
        [--layers q/o k/v gate/up down lm_head]
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from bench_kernels import per_call_arguments, time_graph_us

from trace_replay.kernels._triton import triton
from trace_replay.kernels.fp32_linear import blocks, fp32_linear, launch, split_depth

HIDDEN, INTERMEDIATE, KV, VOCAB = 576, 1536, 192, 49152  # SmolLM2-135M
LAYERS = {
    "q/o": (HIDDEN, HIDDEN),
    "k/v": (HIDDEN, KV),
    "gate/up": (HIDDEN, INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
    "lm_head": (HIDDEN, VOCAB),
}
ROWS = {"decode b64": 64, "verify b64 k=8": 576, "prefill b64×16": 1024}
SPLITS = (2, 3, 4, 6, 8)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) swept at SPLITS too, besides the launcher's
# own: decode's deep-step choice, and 64-row tiles (fewer, each more efficient: split-K is
# then what gives the SMs enough programs)
SPLIT_BLOCKS = ((16, 32, 128, 4, 3), (64, 32, 64, 4, 3), (64, 64, 64, 4, 3))


def time_or_inf(fn, repeats: int) -> float:
    """µs per call, or infinity for a configuration the GPU cannot run (shared memory)."""
    try:
        return time_graph_us(fn, repeats, 20)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


def sweep_configs(rows: int, cols: int, depth: int) -> list[tuple[int, ...]]:
    """Every block configuration at split 1, and ``SPLITS`` of ``SPLIT_BLOCKS`` and the
    launcher's blocks, each split as it runs (clamped), without repeats."""
    configs = [
        (m, n, k, w, s, 1)
        for m in (16, 32, 64)
        for n in (32, 64, 128)
        for k in (32, 64, 128)
        for w in (4,)
        for s in (2, 3, 4)
    ]
    if cols >= 16384:  # lm_head: compute-bound at many rows, so wide tiles and 8 warps too
        configs += [
            (m, n, k, w, s, 1)
            for m in (64, 128)
            for n in (64, 128, 256)
            for k in (16, 32)
            for w in (4, 8)
            for s in (3, 4)
            if m * n >= 128 * 64
        ]
    for block in dict.fromkeys((blocks(rows, cols, depth)[:5], *SPLIT_BLOCKS)):
        configs += [(*block, split_depth(depth, block[2], split)[0]) for split in SPLITS]
    return list(dict.fromkeys(configs))


def main() -> None:
    def configure(parser):
        parser.add_argument(
            "--rows", choices=[name.split()[0] for name in ROWS], help="one row set only"
        )
        parser.add_argument("--layers", nargs="+", choices=list(LAYERS), help="these only")

    args = per_call_arguments(__doc__, configure)
    print("; error: max |Δ| from float64 / max |out|\n")
    gen = torch.Generator().manual_seed(0)
    print(
        "| rows | layer (K → N) | cuBLAS fp32 | cuBLAS TF32 | kernel 3xTF32 | cuBLAS / kernel "
        "| error cuBLAS fp32 | error TF32 | error kernel | kernel blocks |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    sweeps = {}
    row_sets = {name: n for name, n in ROWS.items() if args.rows in (None, name.split()[0])}
    layers = {name: shape for name, shape in LAYERS.items() if name in (args.layers or LAYERS)}
    for (rows_name, rows), (layer, (depth, cols)) in itertools.product(
        row_sets.items(), layers.items()
    ):
        x = torch.randn(rows, depth, generator=gen).cuda()
        weight = (torch.randn(cols, depth, generator=gen) * depth**-0.5).cuda()
        exact = x.double() @ weight.double().T
        times, errors = [], []
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            times.append(time_graph_us(lambda: F.linear(x, weight), args.repeats, 20))
            errors.append(relative_error(F.linear(x, weight), exact))
        torch.backends.cuda.matmul.allow_tf32 = False
        times.append(time_graph_us(lambda: fp32_linear(x, weight), args.repeats, 20))
        errors.append(relative_error(fp32_linear(x, weight), exact))
        print(
            f"| {rows_name} | {layer} ({depth} → {cols}) | {times[0]:.1f} | {times[1]:.1f} | "
            f"{times[2]:.1f} | {times[0] / times[2]:.2f} | {errors[0]:.1e} | {errors[1]:.1e} "
            f"| {errors[2]:.1e} | {blocks(rows, cols, depth)} |",
            flush=True,
        )
        if args.sweep:
            sweeps[f"{rows_name} {layer}"] = {
                c: time_or_inf(lambda c=c: launch(x, weight, config=c), args.repeats)
                for c in sweep_configs(rows, cols, depth)
            }
    for name, times in sweeps.items():
        best = sorted(times, key=times.get)[:5]
        print(f"{name}: " + ", ".join(f"{c} {times[c]:.1f}" for c in best), flush=True)


if __name__ == "__main__":
    main()
