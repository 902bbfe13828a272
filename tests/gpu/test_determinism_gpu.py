"""Deterministic mode on a CUDA GPU: the bitwise promises, with the CUDA arithmetic.

On CUDA deterministic mode runs other kernels than on the CPU (float32 linears by the
3xTF32 Triton GEMM at one configuration per weight shape, Triton norms, attention and
scoring, decode steps in CUDA graphs), so the CPU suite's bitwise tests do not cover it.
Run by hand on a GPU machine (``benchmarks/h200_perf.sh tests``); CI skips the module. The
model is random (a 4-layer Llama of SmolLM2-135M's widths, init 0.3: distributions far
from uniform), prompts and traces random token ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from trace_replay.engines import make_engine  # noqa: E402
from trace_replay.engines.base import ReplayRequest  # noqa: E402

COLUMNS = ("logprob", "rank", "top_token_ids", "top_logprobs", "entropy")


def requests(count: int = 20) -> list[ReplayRequest]:
    """Prompts of 3-40 tokens, traces of 1-70 (some cross a 32-key block, one a 64-row tile)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        prompt = rng.integers(1, 49152, int(rng.integers(3, 41))).tolist()
        trace = rng.integers(1, 49152, 1 + (i * 7) % 70).tolist()
        out.append(ReplayRequest(f"t{i}", tuple(prompt), tuple(trace)))
    return out


def same_bits(a, b) -> None:
    """Every column of every trace bitwise equal (floats by bit pattern)."""
    by_id = {r.trace_id: r for r in b}
    for ra in a:
        rb = by_id[ra.trace_id]
        for column in COLUMNS:
            x, y = (
                np.ascontiguousarray(getattr(ra, column)),
                np.ascontiguousarray(getattr(rb, column)),
            )
            assert x.shape == y.shape and x.tobytes() == y.tobytes(), (ra.trace_id, column)


@pytest.fixture(
    scope="module",
    params=[
        (torch.float32, "rows"),
        (torch.bfloat16, "rows"),
        (torch.float32, "tiles"),
        (torch.bfloat16, "tiles"),
    ],
    ids=["fp32", "bf16", "fp32-tiled", "bf16-tiled"],
)
def runs(request, make_tiny_lm, smol_widths):
    """Deterministic decode replay at batch 16 and at batch 5 with the traces reversed,
    and teacher-forced prefill at batch 3; the arithmetic each engine reports. "tiled":
    the tiled attention kernel (``deterministic_attention="tiles"``, the default), which must
    keep every promise."""
    dtype, attention = request.param
    lm = make_tiny_lm("LlamaConfig", **smol_widths).to(device="cuda", dtype=dtype)
    reqs = requests()
    options = {"deterministic": True, "deterministic_attention": attention}
    big = make_engine("torch", lm, batch_size=16, **options)
    small = make_engine("torch", lm, batch_size=5, **options)
    prefill = make_engine("prefill", lm, batch_size=3, **options)
    out = {
        "big": big.run(reqs),
        "small": small.run(reqs[::-1]),
        "prefill": prefill.run(reqs),
        "arithmetic": big.settings()["arithmetic"],
        "dtype": dtype,
        "attention": attention,
        "default": make_engine("torch", lm, batch_size=16).run(reqs),
        "default_prefill": make_engine("prefill", lm, batch_size=3).run(reqs),
    }
    return out


def test_arithmetic_is_the_cuda_one(runs):
    """float32 linears run the 3xTF32 Triton GEMM, bfloat16 cuBLAS in probed row blocks;
    norms, attention and scoring are the Triton kernels."""
    arithmetic = runs["arithmetic"]
    if runs["dtype"] == torch.float32:
        assert arithmetic["linear"].startswith("triton 3xtf32")
    else:
        assert arithmetic["linear"].startswith("torch, [")
    assert arithmetic["norm"] == "triton"
    assert arithmetic["attention"] == (
        "triton" if runs["attention"] == "rows" else "triton, tiles of 16 queries"
    )
    assert arithmetic["score"].startswith("triton")


def test_batch_and_order_do_not_reach_the_bits(runs):
    """Batch 16 and batch 5 with the traces reversed give the same bits in every column."""
    same_bits(runs["big"], runs["small"])


def test_decode_replay_equals_teacher_forced_prefill(runs):
    """Step-by-step replay (CUDA graphs) and one teacher-forced forward give the same bits."""
    same_bits(runs["big"], runs["prefill"])


def _worst(a, b) -> float:
    return max(float(np.abs(x.logprob - y.logprob).max()) for x, y in zip(a, b))


def test_close_to_the_default_path(runs):
    """Deterministic arithmetic moves a logprob by rounding only, not more: against the
    default path's replay of the same traces. float32: within 1e-3. bfloat16: on this model
    its rounding alone moves logprobs by units (8.5 at most between float32 and bfloat16
    over one 40-token prompt, measured on the CPU), so the bound is the default path's own
    spread, its decode replay against its teacher-forced prefill (other kernels, the same
    model), doubled for the maximum's spread over ~800 tokens."""
    worst = _worst(runs["big"], runs["default"])
    if runs["dtype"] == torch.float32:
        assert worst < 1e-3
    else:
        spread = _worst(runs["default"], runs["default_prefill"])
        assert 0 < worst <= 2 * spread, (worst, spread)
