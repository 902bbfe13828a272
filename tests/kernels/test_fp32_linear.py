"""Tests for trace_replay.kernels.fp32_linear: float32 linear layers on tensor cores (3xTF32)
are as close to the float64 product as float32 FMAs, in the static backend too."""

import pytest
import torch

from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.fp32_linear import (
    blocks,
    fp32_linear,
    group_blocks,
    launch,
    launch_group_partials,
    launch_partials,
    split_depth,
    sum_partials,
)


def error_from_float64(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> float:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.parametrize(
    "rows, depth, cols, bias",
    [
        (64, 576, 192, False),  # SmolLM2's k/v at a decode step of 64 rows
        (9, 100, 70, True),  # nothing a multiple of a block; Qwen2's q/k/v carry a bias
        (1, 40, 33, True),  # one row
    ],
)
def test_kernel_is_as_close_to_float64_as_float32(device, rows, depth, cols, bias):
    """The 3xTF32 kernel's largest error from the float64 product, relative to the largest
    output, is below 1e-6 — float32 rounding (cuBLAS's float32 on an H200: 2e-7 to 1.2e-6
    at SmolLM2's shapes); plain TF32 gives ~3e-4."""
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("without Triton the reference runs")
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, depth, generator=gen).to(device)
    weight = (torch.randn(cols, depth, generator=gen) * depth**-0.5).to(device)
    b = torch.randn(cols, generator=gen).to(device) if bias else None
    out = fp32_linear(x, weight, b)
    assert out.shape == (rows, cols) and out.dtype == torch.float32
    assert error_from_float64(out, x, weight, b) < 1e-6


def test_leading_dimensions_and_strides():
    """``[..., K]`` inputs keep their leading shape; a transposed (non-contiguous) weight
    and a sliced input give what F.linear gives."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 50, generator=gen)[..., :40]
    weight = torch.randn(40, 24, generator=gen).T
    out = fp32_linear(x, weight)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [(16, 32, 64, 4, 3), (64, 128, 32, 4, 2), (32, 64, 32, 4, 3, 3)])
def test_every_block_configuration_computes_the_same_product(config):
    """The launcher's block choice (split-K included) changes speed, not the product
    (within rounding); :func:`blocks` gives all six entries."""
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(70, 130, generator=gen), torch.randn(150, 130, generator=gen)
    torch.testing.assert_close(
        launch(x, weight, config=config), torch.nn.functional.linear(x, weight), atol=2e-5, rtol=0
    )


@pytest.mark.parametrize("rows", [1, 64, 576, 1024])
@pytest.mark.parametrize(
    "cols, depth", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
)
def test_blocks_split_k_only_where_tiles_are_few(rows, cols, depth):
    """blocks(): a split only where the output has fewer tiles than two waves of programs,
    none for the lm_head, and never more programs than that target (or the tiles alone)."""
    block_m, block_n, _, _, _, split = blocks(rows, cols, depth)
    tiles = -(-rows // block_m) * -(-cols // block_n)
    assert split >= 1 and (split == 1 or tiles * 2 <= 264)
    assert tiles * split <= max(264, tiles)
    if cols >= 16384:
        assert split == 1


# --- split-K: tiny shapes (the interpreter is slow) in 16-wide blocks, so that K = 40 is 3
# steps (the last one 8 deep) and K = 100 is 7 ----------------------------------------------


def split_config(split: int) -> tuple[int, int, int, int, int, int]:
    return 16, 16, 16, 4, 3, split


def split_inputs(depth: int, bias: bool = True, seed: int = 6):
    """``x`` [5, depth], ``weight`` [24, depth] (two column tiles), ``bias`` [24] or None."""
    gen = torch.Generator().manual_seed(seed + depth)
    x = torch.randn(5, depth, generator=gen)
    weight = torch.randn(24, depth, generator=gen) * depth**-0.5
    return x, weight, torch.randn(24, generator=gen) if bias else None


def skip_without_triton(device: str) -> None:
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("without Triton there is no kernel to launch")


def test_split_depth_covers_k_in_nonempty_ranges():
    """For every K, step and requested split, the split that runs is at most the requested
    one, each range is whole steps, and the ranges cover K with none empty:
    ``(split - 1) * per_split < K <= split * per_split``. A split below 1 is refused."""
    for depth in range(1, 120):
        for block_k in (16, 32):
            for requested in range(1, 10):
                split, per_split = split_depth(depth, block_k, requested)
                assert 1 <= split <= requested and per_split % block_k == 0
                assert (split - 1) * per_split < depth <= split * per_split
    with pytest.raises(ValueError, match="split"):
        split_depth(40, 16, 0)


@pytest.mark.parametrize(
    "depth, split",
    [
        (40, 1),
        (40, 2),  # 2 + 1 steps: K = 40 is no multiple of split × BLOCK_K
        (40, 3),
        (40, 4),  # one step each; 4 asks for more splits than K has steps (runs as 3)
        (100, 3),
        (100, 4),  # 3 + 3 + 1 and 2 + 2 + 2 + 1 steps
    ],
)
def test_split_k_is_as_close_to_float64_as_float32(device, depth, split):
    """Split-K's largest error from the float64 product (bias included), relative to the
    largest output, is below 1e-6 — float32 rounding, as for the one-pass kernel."""
    skip_without_triton(device)
    x, weight, bias = (t.to(device) for t in split_inputs(depth))
    out = launch(x, weight, bias, config=split_config(split))
    assert out.shape == (5, 24) and out.dtype == torch.float32
    assert error_from_float64(out, x, weight, bias) < 1e-6


@pytest.mark.parametrize("split", [1, 3])
def test_bias_is_added_once(device, split):
    """With zero weights every partial is zero, so the output is exactly the bias: added
    once, not once per split."""
    skip_without_triton(device)
    x, weight, bias = (t.to(device) for t in split_inputs(40))
    out = launch(x, torch.zeros_like(weight), bias, config=split_config(split))
    assert torch.equal(out, bias.expand(5, -1))


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_is_deterministic(device, split):
    """No atomics: the partials are summed in the fixed order s = 0, 1, ..., so two calls on
    the same inputs give the same bits."""
    skip_without_triton(device)
    x, weight, bias = (t.to(device) for t in split_inputs(100))
    first = launch(x, weight, bias, config=split_config(split))
    assert torch.equal(launch(x, weight, bias, config=split_config(split)), first)


@pytest.mark.parametrize("depth, split", [(100, 1), (16, 4)])
def test_split_one_is_the_one_pass_kernel(device, depth, split):
    """A 6-entry config at split 1, or a split that clamps to 1 (K of one step), gives the
    same bits as the 5-entry config: the one-pass kernel, no workspace, no second sum."""
    skip_without_triton(device)
    x, weight, bias = (t.to(device) for t in split_inputs(depth))
    one_pass = launch(x, weight, bias, config=split_config(1)[:5])
    assert torch.equal(launch(x, weight, bias, config=split_config(split)), one_pass)


def test_bad_configs_are_refused():
    """A config of other than 5 or 6 entries, or a split below 1, is a ValueError (before
    any launch)."""
    x, weight = torch.zeros(5, 40), torch.zeros(24, 40)
    with pytest.raises(ValueError, match="config"):
        launch(x, weight, config=(16, 16, 16, 4))
    with pytest.raises(ValueError, match="split"):
        launch(x, weight, config=split_config(0))


def test_other_dtypes_and_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="float32"):
        fp32_linear(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="features"):
        fp32_linear(torch.zeros(2, 4), torch.zeros(3, 5))


def test_compiled_call_is_one_operator():
    """Inside ``torch.compile(fullgraph=True)`` the kernel is one operator: no graph break."""
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(4, 32, generator=gen), torch.randn(8, 32, generator=gen), None
    compiled = torch.compile(fp32_linear, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, weight, bias), fp32_linear(x, weight, bias))


@pytest.mark.parametrize("split", [2, 3])
def test_torch_sum_of_partials_is_the_sum_kernel(device, split):
    """sum_partials (torch ops, what a compiled layer fuses into its consumer) adds the same
    float32 numbers in the same order as the sum kernel: the same bits, bias included."""
    skip_without_triton(device)
    x, weight, bias = (t.to(device) for t in split_inputs(100))
    partials = launch_partials(x, weight, bias, config=split_config(split))
    assert partials.shape == (split, 5, 24)
    assert torch.equal(
        sum_partials(partials, bias), launch(x, weight, bias, config=split_config(split))
    )


def test_compiled_split_k_gives_the_eager_bits(device):
    """Compiled, fp32_linear runs the partials operator and sums in torch ops; eagerly the
    sum kernel. At a shape where blocks() splits K (5 rows, K = 200: 4 ranges) both give
    the same bits; the operator's fake output has the split's shape."""
    skip_without_triton(device)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 200, generator=gen).to(device)
    weight = (torch.randn(24, 200, generator=gen) * 200**-0.5).to(device)
    bias = torch.randn(24, generator=gen).to(device)
    _, _, block_k, _, _, split = blocks(5, 24, 200)
    assert split_depth(200, block_k, split)[0] == 4
    compiled = torch.compile(fp32_linear, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, weight, bias), fp32_linear(x, weight, bias))
    assert error_from_float64(compiled(x, weight, bias), x, weight, bias) < 1e-6


def test_group_blocks_put_every_member_on_tiles_of_its_own():
    """group_blocks: the whole output's blocks at the given split, BLOCK_N narrowed until
    it divides every member's first column; None when even 16 does not."""
    assert group_blocks(64, [576, 192, 192], 576, 5) == (*blocks(64, 960, 576)[:5], 5)
    assert group_blocks(5, [48, 16, 16], 200, 4)[1] == 16  # 48 is no multiple of 32
    assert group_blocks(5, [40, 24], 200, 4) is None


@pytest.mark.parametrize("split, bias", [(1, True), (1, False), (3, True)])
def test_group_launch_is_each_members_launch(device, split, bias):
    """Three weights side by side in one launch: each member's columns hold what its own
    launch at the same blocks and split holds (partials, or at split 1 the output with its
    bias), to float32 rounding."""
    skip_without_triton(device)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 100, generator=gen).to(device)
    weights = [(torch.randn(n, 100, generator=gen) * 0.1).to(device) for n in (32, 16, 48)]
    biases = [torch.randn(n, generator=gen).to(device) for n in (32, 16, 48)] if bias else None
    group = launch_group_partials(x, weights, biases, split)
    config = group_blocks(5, [32, 16, 48], 100, split)
    assert group.shape == (split_depth(100, config[2], split)[0], 5, 96)
    start = 0
    for i, weight in enumerate(weights):
        own = launch_partials(x, weight, None if biases is None else biases[i], config=config)
        torch.testing.assert_close(
            group[:, :, start : start + weight.shape[0]], own, atol=1e-6, rtol=0
        )
        start += weight.shape[0]


def test_group_launch_refuses_tiles_across_members():
    x = torch.zeros(5, 100)
    with pytest.raises(ValueError, match="tile"):
        launch_group_partials(x, [torch.zeros(40, 100), torch.zeros(24, 100)], None, 1)
