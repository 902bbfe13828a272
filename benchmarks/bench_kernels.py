"""Trace-replay kernels: launch latency and trace storage, printed as markdown tables.

Per launch (median over repeats, CUDA events), for ``apply_trace_tokens`` and the verified
kernel (k = 8), eager and inside one captured CUDA graph of ``--graph-launches`` launches:
our kernels (ragged layout, as ``TraceReplayState`` stores traces) against the pure-torch
reference and a plain one-program-per-row Triton kernel on the 2-D layout (the verified one
walking positions with a scalar loop). Then the bytes per held trace token of
``TraceReplayState`` against upstream's ``max_num_reqs x max_model_len`` int32 layout.

Runs on CUDA only. ``--interpret-smoke`` runs one tiny iteration on CPU under
``TRITON_INTERPRET=1`` so the script itself can be checked without a GPU.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --interpret-smoke
"""

import os
import sys

if "--interpret-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: jit reads it

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from trace_replay.engines.replay_state import RequestState, TraceReplayState  # noqa: E402
from trace_replay.kernels import (  # noqa: E402
    apply_trace_tokens,
    apply_trace_tokens_reference,
    apply_trace_tokens_to_verified,
    apply_trace_tokens_to_verified_reference,
)
from trace_replay.kernels._triton import HAS_TRITON, tl, triton  # noqa: E402

NUM_REQS = (1, 4, 16, 64, 256, 1024, 4096)


@triton.jit
def _baseline_trace_tokens_kernel(
    sampled_ptr,  # [num_reqs], int64, mutated in place
    idx_mapping_ptr,  # [num_reqs], int32
    trace_ptr,  # [max_num_reqs, max_trace_len], int32
    trace_stride,
    trace_len_ptr,  # [max_num_reqs], int32
    total_len_ptr,  # [max_num_reqs], int32
    prompt_len_ptr,  # [max_num_reqs], int32
):
    b = tl.program_id(0)
    r = tl.load(idx_mapping_ptr + b)
    if r < 0:
        return
    step = tl.load(total_len_ptr + r) - tl.load(prompt_len_ptr + r)
    if (step < 0) | (step >= tl.load(trace_len_ptr + r)):
        return
    token = tl.load(trace_ptr + r.to(tl.int64) * trace_stride + step)
    tl.store(sampled_ptr + b, token.to(tl.int64))


@triton.jit
def _baseline_verified_kernel(
    sampled_ptr,  # [num_reqs, num_cols], int64, mutated in place
    sampled_stride,
    num_sampled_ptr,  # [num_reqs], int32, mutated in place
    draft_ptr,  # [num_logits], int64
    cu_num_logits_ptr,  # [num_reqs + 1], int32
    idx_mapping_ptr,  # [num_reqs], int32
    trace_ptr,  # [max_num_reqs, max_trace_len], int32
    trace_stride,
    trace_len_ptr,  # [max_num_reqs], int32
    total_len_ptr,  # [max_num_reqs], int32
    prompt_len_ptr,  # [max_num_reqs], int32
    num_cols,
):
    b = tl.program_id(0)
    r = tl.load(idx_mapping_ptr + b)
    if r < 0:
        return
    trace_len = tl.load(trace_len_ptr + r)
    step = tl.load(total_len_ptr + r) - tl.load(prompt_len_ptr + r)
    if (step < 0) | (step >= trace_len):
        return
    first = tl.load(cu_num_logits_ptr + b)
    n = tl.load(cu_num_logits_ptr + b + 1) - first
    row_ptr = trace_ptr + r.to(tl.int64) * trace_stride + step
    count = step * 0
    going = step >= 0
    for i in range(0, num_cols):
        write = going & (step + i < trace_len)
        token = tl.load(row_ptr + i, mask=write, other=0).to(tl.int64)
        tl.store(sampled_ptr + b * sampled_stride + i, token, mask=write)
        count = tl.where(write, i + 1, count)
        draft = tl.load(draft_ptr + first + i + 1, mask=write & (i < n - 1), other=-1)
        going = write & (i < n - 1) & (draft == token)
    tl.store(num_sampled_ptr + b, count)


def baseline_trace_tokens(sampled, idx_mapping, traces, trace_len, total_len, prompt_len):
    _baseline_trace_tokens_kernel[(idx_mapping.shape[0],)](
        sampled, idx_mapping, traces, traces.stride(0), trace_len, total_len, prompt_len
    )


def baseline_verified(
    sampled, num_sampled, drafts, cu, idx_mapping, traces, trace_len, total_len, prompt_len
):
    _baseline_verified_kernel[(idx_mapping.shape[0],)](
        sampled,
        sampled.stride(0),
        num_sampled,
        drafts,
        cu,
        idx_mapping,
        traces,
        traces.stride(0),
        trace_len,
        total_len,
        prompt_len,
        sampled.shape[1],
    )


def make_inputs(num_reqs, k, device, gen, max_trace_len):
    """A batch replaying mid-trace: ragged state, the same traces 2-D, drafts that often agree."""
    lengths = torch.randint(32, max_trace_len + 1, (num_reqs,), generator=gen)
    traces = [torch.randint(0, 50_000, (int(n),), generator=gen) for n in lengths]
    req_states = RequestState(num_reqs, device)
    state = TraceReplayState(req_states)
    for slot, trace in enumerate(traces):
        state.add_request(slot, trace)
    state.apply_staged_writes()
    steps = (torch.rand(num_reqs, generator=gen) * lengths).long()
    req_states.prompt_len.fill_(16)
    req_states.total_len.copy_(16 + steps)
    dense = torch.zeros(num_reqs, int(lengths.max()), dtype=torch.int32)
    for slot, trace in enumerate(traces):
        dense[slot, : len(trace)] = trace
    idx_mapping = torch.randperm(num_reqs, generator=gen).to(torch.int32)
    fed = torch.randint(0, 50_000, (num_reqs, k + 1), generator=gen)
    for b, r in enumerate(idx_mapping.tolist()):
        step, num_agree = int(steps[r]), int(torch.randint(0, k + 1, (), generator=gen))
        agree = traces[r][step : step + num_agree]
        fed[b, 1 : 1 + len(agree)] = agree
    return state, {
        "idx_mapping": idx_mapping.to(device),
        "dense": dense.to(device),
        "drafts": fed.flatten().to(device),
        "cu": (torch.arange(num_reqs + 1, dtype=torch.int32) * (k + 1)).to(device),
        "sampled": torch.zeros(num_reqs, dtype=torch.int64, device=device),
        "verified": torch.zeros(num_reqs, k + 1, dtype=torch.int64, device=device),
        "num_sampled": torch.zeros(num_reqs, dtype=torch.int32, device=device),
    }


def launchers(state, x):
    """{(kernel, impl): zero-argument launch} for one batch."""
    rs, ragged = state.req_states, (state.trace_token_ids, state.trace_len)
    lens = (rs.total_len, rs.prompt_len)
    offsets = {"trace_offsets": state.trace_offsets}
    plain = (x["sampled"], x["idx_mapping"])
    spec = (x["verified"], x["num_sampled"], x["drafts"], x["cu"], x["idx_mapping"])
    return {
        ("trace_tokens", "ours"): lambda: apply_trace_tokens(*plain, *ragged, *lens, **offsets),
        ("trace_tokens", "baseline"): lambda: baseline_trace_tokens(
            *plain, x["dense"], state.trace_len, *lens
        ),
        ("trace_tokens", "reference"): lambda: apply_trace_tokens_reference(
            *plain, *ragged, *lens, **offsets
        ),
        ("verified", "ours"): lambda: apply_trace_tokens_to_verified(
            *spec, *ragged, *lens, **offsets
        ),
        ("verified", "baseline"): lambda: baseline_verified(
            *spec, x["dense"], state.trace_len, *lens
        ),
        ("verified", "reference"): lambda: apply_trace_tokens_to_verified_reference(
            *spec, *ragged, *lens, **offsets
        ),
    }


def time_eager_us(fn, repeats, inner, device):
    """Median microseconds per launch over ``repeats`` bursts of ``inner`` launches.

    CUDA events on CUDA, wall clock elsewhere (the CPU smoke run passes 1 x 1).
    """
    fn()  # compile
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            wall = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            samples.append((time.perf_counter() - wall) * 1e6 / inner)
    return statistics.median(samples)


def time_graph_us(fn, repeats, launches):
    """Median microseconds per launch of one CUDA graph holding ``launches`` launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(samples)


def per_call_arguments(doc: str, configure=None) -> argparse.Namespace:
    """``--repeats`` and ``--sweep`` (and what ``configure(parser)`` adds) of the per-call
    benchmarks timed by :func:`time_graph_us` (``bench_cache_attention.py``,
    ``bench_fp32_linear.py``); prints their title line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    if configure is not None:
        configure(parser)
    args = parser.parse_args()
    print(
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · µs per call in a "
        f"CUDA graph, median of {args.repeats}",
        end="",
    )
    return args


def latency_table(args, device):
    gen = torch.Generator().manual_seed(0)
    rows = [
        "| num_reqs | kernel | ours eager µs | baseline eager µs | reference eager µs "
        "| ours graph µs | baseline graph µs | baseline/ours graph | reference/ours eager |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for num_reqs in args.num_reqs:
        state, x = make_inputs(num_reqs, args.k, device, gen, args.max_trace_len)
        fns = launchers(state, x)
        for kernel in ("trace_tokens", "verified"):
            eager = {
                impl: time_eager_us(fns[kernel, impl], args.repeats, args.inner, device)
                for impl in ("ours", "baseline", "reference")
            }
            graph = {impl: float("nan") for impl in ("ours", "baseline")}
            if device.type == "cuda":  # the reference syncs (nonzero): it cannot be captured
                graph = {
                    impl: time_graph_us(fns[kernel, impl], args.repeats, args.graph_launches)
                    for impl in graph
                }
            rows.append(
                f"| {num_reqs} | {kernel} | {eager['ours']:.2f} | {eager['baseline']:.2f} "
                f"| {eager['reference']:.2f} | {graph['ours']:.2f} | {graph['baseline']:.2f} "
                f"| {graph['baseline'] / graph['ours']:.2f} "
                f"| {eager['reference'] / eager['ours']:.2f} |"
            )
    return rows


def storage_table(args, device):
    """Bytes per held trace token: ragged state (fresh, then after churn) vs upstream's layout."""
    gen = torch.Generator().manual_seed(1)
    n = args.storage_reqs
    state = TraceReplayState(RequestState(n, device))

    def add(slot):
        length = int(torch.randint(32, 2049, (), generator=gen))
        state.add_request(slot, torch.randint(0, 50_000, (length,), generator=gen))

    for slot in range(n):
        add(slot)
    state.apply_staged_writes()
    upstream = n * args.max_model_len * 4
    rows = [
        f"Trace storage: {n} requests, lengths 32..2048, max_model_len {args.max_model_len}",
        "",
        "| state | held tokens | ours bytes | ours B/token | upstream bytes | upstream B/token "
        "| upstream/ours |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def row(label):
        held = state.num_trace_tokens
        rows.append(
            f"| {label} | {held} | {state.storage_bytes} | {state.bytes_per_trace_token:.2f} "
            f"| {upstream} | {upstream / held:.1f} | {upstream / state.storage_bytes:.1f} |"
        )

    row("fresh")
    for _ in range(10):  # churn: each step replaces a quarter of the requests
        for slot in torch.randperm(n, generator=gen)[: n // 4].tolist():
            if torch.rand((), generator=gen) < 0.5:
                state.remove_request(slot)
            else:
                add(slot)
        state.apply_staged_writes()
    row("after churn")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-reqs", type=int, nargs="+", default=list(NUM_REQS))
    parser.add_argument("--k", type=int, default=8, help="draft tokens per verified row")
    parser.add_argument("--repeats", type=int, default=50, help="timed bursts; median taken")
    parser.add_argument("--inner", type=int, default=100, help="eager launches per burst")
    parser.add_argument("--graph-launches", type=int, default=100, help="launches per graph")
    parser.add_argument("--max-trace-len", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--storage-reqs", type=int, default=1024)
    parser.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="one tiny iteration on CPU under TRITON_INTERPRET=1",
    )
    args = parser.parse_args()
    if not HAS_TRITON:
        sys.exit("bench_kernels needs triton (pip install triton)")
    if args.interpret_smoke:
        device = torch.device("cpu")
        args.num_reqs, args.repeats, args.inner, args.max_trace_len = [1, 4], 1, 1, 64
        args.storage_reqs = 64
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("bench_kernels runs on CUDA; use --interpret-smoke to check it on CPU")

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# Trace-replay kernels on {name}")
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
    )
    print(
        f"k = {args.k}; eager: median of {args.repeats} bursts of {args.inner} launches; "
        f"graph: {args.graph_launches} launches per captured graph\n"
    )
    print("\n".join(latency_table(args, device)))
    print()
    print("\n".join(storage_table(args, device)))


if __name__ == "__main__":
    main()
