"""Float32 products on TF32 tensor cores at verify and prefill row counts: how far below
one tensor-core product a float32-accurate split can go, on CUDA.

Issue 16 asks a k = 8 verify forward (9 tokens per row: 576 rows at batch 64) to run ≥ 4×
the step-by-step replay. In float32 that forward is compute-bound in the 3xTF32 linears
(``kernels/fp32_linear.py``), so this benchmark prints, per SmolLM2-135M layer (q/k/v and
gate/up as the grouped launches run them), device µs per call inside a CUDA graph (median
of ``--repeats`` graphs of 20 calls; each variant at its best blocks of ``CONFIGS``) and
the largest error against the float64 product over the largest |output|:

- ``cuBLAS TF32``: one TF32 product (``allow_tf32``): scale only, not float32-accurate;
- ``one TF32 dot``: the same in Triton (one ``tl.dot`` at ``input_precision="tf32"``);
- ``launcher``: ``fp32_linear.launch`` as the engine runs it (its blocks and split-K);
- ``tf32x3``: Triton's split inside ``tl.dot`` (``input_precision="tf32x3"``), split 1;
- ``pre-split``: the weight split once on the host into TF32 ``hi`` and ``lo``
  (:func:`split_tf32`: round to nearest, then the rest rounded), ``x`` split in the
  kernel, and per K step the chain ``lo·hi + hi·lo + hi·hi`` started from zero and added to
  the accumulator (Triton's own order);
- ``pre-split, one chain``: the same three products accumulated straight into one
  accumulator across all of K.

It also prints whether a TF32 dot of unrounded float32 operands equals the dot of their
truncations or of their roundings (what the tensor core reads of a float32 operand).

    python benchmarks/bench_tf32_split.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_fp32_linear import relative_error, time_or_inf
from bench_kernels import time_graph_us

from trace_replay.kernels._triton import tl, triton
from trace_replay.kernels.fp32_linear import launch

HIDDEN, INTERMEDIATE, KV, VOCAB = 576, 1536, 192, 49152  # SmolLM2-135M
LAYERS = {"q/k/v": (HIDDEN, HIDDEN + 2 * KV), "o": (HIDDEN, HIDDEN),
          "gate/up": (HIDDEN, 2 * INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN),
          "lm_head": (HIDDEN, VOCAB)}
ROWS = {"verify b64 k=8": 576, "prefill b64×16": 1024}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps); 3 stages
CONFIGS = [c for c in itertools.product((64, 128), (32, 64, 128), (32, 64), (4, 8))
           if c[:3] != (128, 128, 64)]
VARIANTS = {"one TF32 dot": 0, "tf32x3": 1, "pre-split": 2, "pre-split, one chain": 3}
TRUNCATED, ROUNDED = 4, 5  # one dot of the truncated / rounded operands


@triton.jit
def _round_tf32(v):
    # to the nearest TF32 value (ties away from zero): add half of the 13 dropped bits' unit
    bits = v.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _variant_kernel(x_ptr, w_ptr, w_lo_ptr, out_ptr, rows, cols, depth,
                    VARIANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # w_ptr: the weight (its TF32 `hi` for the pre-split variants); w_lo_ptr: its `lo`
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = offs_m[:, None] < rows, offs_n[:, None] < cols
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * depth
    w_rows = offs_n.to(tl.int64)[:, None] * depth
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, depth, BLOCK_K):  # depth: a multiple of BLOCK_K here
        k = start + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(x_rows + k, mask=row_ok, other=0.0)
        w = tl.load(w_ptr + w_rows + k, mask=col_ok, other=0.0)
        if VARIANT == 0:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
        elif VARIANT == 1:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")
        elif VARIANT == 4:
            x_t = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            w_t = (w.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            acc = tl.dot(x_t, tl.trans(w_t), acc, input_precision="tf32")
        elif VARIANT == 5:
            acc = tl.dot(_round_tf32(x), tl.trans(_round_tf32(w)), acc, input_precision="tf32")
        else:
            w_lo = tl.load(w_lo_ptr + w_rows + k, mask=col_ok, other=0.0)
            x_hi = _round_tf32(x)
            x_lo = _round_tf32(x - x_hi)
            if VARIANT == 2:
                step = tl.dot(x_lo, tl.trans(w), input_precision="tf32")
                step = tl.dot(x_hi, tl.trans(w_lo), step, input_precision="tf32")
                step = tl.dot(x_hi, tl.trans(w), step, input_precision="tf32")
                # the select keeps Triton from folding `acc + dot(..)` into the dot's own
                # accumulator (which would make this variant 3)
                acc += tl.where(step == step, step, 0.0)
            else:
                acc = tl.dot(x_lo, tl.trans(w), acc, input_precision="tf32")
                acc = tl.dot(x_hi, tl.trans(w_lo), acc, input_precision="tf32")
                acc = tl.dot(x_hi, tl.trans(w), acc, input_precision="tf32")
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * cols + offs_n[None, :], acc,
             mask=row_ok & (offs_n[None, :] < cols))


def split_tf32(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)``: ``hi`` the TF32 value nearest ``t``, ``lo`` the rest rounded to TF32."""
    def round_tf32(v):
        return ((v.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)
    hi = round_tf32(t)
    return hi, round_tf32(t - hi)


def run(variant, x, weight, weight_lo, out, config):
    (rows, depth), cols = x.shape, weight.shape[0]
    block_m, block_n, block_k, warps = config
    grid = (triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))
    _variant_kernel[grid](x, weight, weight_lo, out, rows, cols, depth, VARIANT=variant,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          num_warps=warps, num_stages=3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton "
          f"{triton.__version__} · µs per call in a CUDA graph, median of {args.repeats}; "
          "error: max |Δ| from float64 / max |out|; each variant at its best blocks\n")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, HIDDEN, generator=gen).cuda()
    weight = torch.randn(HIDDEN, HIDDEN, generator=gen).cuda()
    outs = {v: run(v, x, weight, weight, torch.empty(64, HIDDEN, device="cuda"), (64, 64, 32, 4))
            for v in (VARIANTS["one TF32 dot"], TRUNCATED, ROUNDED)}
    print("A TF32 dot of unrounded float32 operands equals the dot of their truncations: "
          f"{torch.equal(outs[0], outs[TRUNCATED])}; of their roundings: "
          f"{torch.equal(outs[0], outs[ROUNDED])}\n")
    print("| rows | layer (K → N) | cuBLAS TF32 | " + " | ".join(VARIANTS) + " | launcher | "
          + " | ".join(f"error {name}" for name in [*VARIANTS, "launcher"]) + " |")
    print("|---|---|" + "---:|" * (2 * len(VARIANTS) + 3))
    for (rows_name, rows), (layer, (depth, cols)) in itertools.product(ROWS.items(),
                                                                        LAYERS.items()):
        x = torch.randn(rows, depth, generator=gen).cuda()
        weight = (torch.randn(cols, depth, generator=gen) * depth**-0.5).cuda()
        weight_hi, weight_lo = split_tf32(weight)
        exact = x.double() @ weight.double().T
        out = torch.empty(rows, cols, device="cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        cublas = time_graph_us(lambda: x @ weight.T, args.repeats, 20)
        torch.backends.cuda.matmul.allow_tf32 = False
        times, errors = [], []
        for variant in VARIANTS.values():
            w = weight_hi if variant in (2, 3) else weight
            timed = {c: time_or_inf(lambda c=c: run(variant, x, w, weight_lo, out, c),
                                    args.repeats) for c in CONFIGS}
            best = min(timed, key=timed.get)
            times.append(f"{timed[best]:.1f} {best}")
            errors.append(relative_error(run(variant, x, w, weight_lo, out, best), exact))
        times.append(f"{time_graph_us(lambda: launch(x, weight), args.repeats, 20):.1f}")
        errors.append(relative_error(launch(x, weight), exact))
        print(f"| {rows} | {layer} ({depth} → {cols}) | {cublas:.1f} | " + " | ".join(times)
              + " | " + " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)


if __name__ == "__main__":
    main()
