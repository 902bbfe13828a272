"""Could deterministic prefill batch its row blocks? A row's bits in a cuBLAS strided-batched
GEMM (``torch.bmm`` of B blocks of R rows) against its bits in one R-row ``F.linear`` (what a
decode step's block gets), for the layer shapes of SmolLM2-135M and Llama-3.1-8B.

Prints, per dtype, shape and block size R, the batch counts B at which the row's bits differ
(the row placed in the first, middle and last block, first, middle and last row). A count
that never differs could serve long prefills as one launch; any difference rules it out.

    python benchmarks/probe_batched_gemm.py            # CUDA
"""

import torch

SHAPES = {"135M": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)],
          "8B": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]}
COUNTS = (1, 2, 3, 4, 5, 8, 13, 16, 37, 64)


def differing_counts(weight: torch.Tensor, row: torch.Tensor, size: int) -> list[int]:
    """Batch counts at which ``row`` gets other bits than in one ``size``-row F.linear."""
    k, n = weight.shape[1], weight.shape[0]
    single = torch.randn(size, k, device=weight.device, dtype=weight.dtype)
    single[0] = row
    alone = torch.nn.functional.linear(single, weight)[0]
    bad = set()
    for count in COUNTS:
        for block in sorted({0, count // 2, count - 1}):
            for position in sorted({0, size // 2, size - 1}):
                x = torch.randn(count, size, k, device=weight.device, dtype=weight.dtype)
                x[block, position] = row
                got = torch.bmm(x, weight.t().expand(count, k, n))[block, position]
                if not torch.equal(got, alone):
                    bad.add(count)
    return sorted(bad)


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dtype in (torch.float32, torch.bfloat16):
        for name, shapes in SHAPES.items():
            for n, k in shapes:
                weight = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
                row = torch.randn(k, device="cuda", dtype=dtype)
                for size in (64, 128, 256):
                    print(f"{str(dtype)[6:]} {name} {n}x{k}, blocks of {size} rows: "
                          f"batch counts giving other bits: {differing_counts(weight, row, size)}",
                          flush=True)


if __name__ == "__main__":
    main()
