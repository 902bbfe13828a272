"""A stock vLLM server with native trace replay against the offline native engine: speed.

One random model of a shape (``shapes.py``; a byte-level tokenizer added, which the client's
start-up check needs). The offline native engine (``make_engine("vllm")``, engine core in this
process, the package's default) and a stock ``vllm serve --enable-trace-replay
--enable-scale-out`` started with the same engine arguments (``serve.llm_options``) share the
GPU, ``--memory`` of it each, started one after the other. Per batch: random token-id
prompts, the offline engine's greedy output as the traces; the client
(``engine="vllm-server"``, as many requests in flight as the batch) sends the batch at once. Rounds time the two in alternating order; the ratio served
speed / offline speed is taken per round, its median and range printed, with the largest
|Δ logprob| between the two (batched requests: the server may group them otherwise, so
the bits may differ; ``tests/gpu/test_vllm_server_gpu.py`` checks one trace at a time is
bitwise equal). Weights are random: speed does not depend on their values.

Usage (on the H200 with ../shared/tools/vllm-h200, see benchmarks/h200_vllm.sh served)::

    python3 benchmarks/bench_vllm_served.py --shape smollm2-135m --batches 1,16,64 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_vllm_gpu import model_folder, random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--memory",
        type=float,
        default=0.3,
        help="gpu_memory_utilization of the engine and of the server each",
    )
    parser.add_argument(
        "--model-dir", default=None, help="save the random model here, or reuse the one saved there"
    )
    args = parser.parse_args()
    args.layers, args.tp = None, 1  # what bench_vllm_gpu.model_folder reads besides
    batches = [int(b) for b in args.batches.split(",")]

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest
    from trace_replay.engines.server.serve import (
        llm_options,
        start_server,
        stop_server,
        vllm_serve,
        wait_for_server,
    )

    folder, vocab = model_folder(args)
    engine_args = {
        "gpu_memory_utilization": args.memory,
        "max_model_len": args.prompt_len + args.new_tokens + 16,
    }
    # what make_engine("vllm") will give vllm.LLM (its llm_args), checked once it has started
    llm_args = {
        "model": folder,
        "dtype": args.dtype,
        "seed": 0,
        "max_logprobs": 20,
        "logprobs_mode": "raw_logprobs",
        "enable_prefix_caching": False,
        "use_tqdm_on_load": False,
        "max_num_seqs": max(batches),
        **engine_args,
    }
    if args.dtype == "float32":
        llm_args["attention_backend"] = "FLEX_ATTENTION"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "server.log"
    started = time.perf_counter()
    server = start_server(
        vllm_serve(
            folder,
            [
                "--served-model-name",
                args.shape,
                "--enable-trace-replay",
                "--enable-scale-out",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *llm_options(llm_args),
            ],
        ),
        log,
    )
    try:
        # one start-up at a time: vLLM's memory profiling fails where another process
        # releases GPU memory meanwhile (gpu_worker.py: "Error in memory profiling")
        url = f"http://127.0.0.1:{port}/v1"
        wait_for_server(url, server, timeout_s=400, log_path=log)
        served = make_engine(
            "vllm-server", folder, batch_size=max(batches), top_k=5, engine_args={"base_url": url}
        )
        server_s = time.perf_counter() - started
        started = time.perf_counter()
        offline = make_engine(
            "vllm",
            folder,
            dtype=args.dtype,
            batch_size=max(batches),
            top_k=5,
            engine_args=engine_args,
        )
        offline_s = time.perf_counter() - started
        if offline.llm_args != llm_args:
            print(f"NOTE: the server's arguments differ from the engine's: {offline.llm_args}")
        rows = [measure(offline, served, batch, vocab, args, ReplayRequest) for batch in batches]
        settings = (offline.settings(), served.settings())
        served.close()
        offline.close()
    finally:
        stop_server(server)
    import vllm

    print(
        f"\n{dt.date.today()} · {torch.cuda.get_device_name()} · vLLM {vllm.__version__} · "
        f"torch {torch.__version__} · {args.shape} random weights · {args.dtype} · "
        f"{args.prompt_len}-token prompts · {args.new_tokens} tokens/row · {args.rounds} "
        f"alternating rounds · start-up s: server {server_s:.0f}, offline {offline_s:.0f}"
    )
    print(
        f"offline: {settings[0]['engine_path']}, model runner {settings[0]['model_runner']}, "
        f"engine core {settings[0]['engine_core']}; served: {settings[1]['engine_path']}, "
        f"server_forcing {settings[1]['server_forcing']}, vLLM {settings[1]['vllm_version']}"
    )
    print(
        "\n| batch | offline tok/s | served tok/s | served / offline | "
        "max |Δ logprob| served vs offline |"
    )
    print("|---:|---:|---:|---:|---:|")
    for batch, speed, ratios, delta in rows:
        print(
            f"| {batch} | {speed['offline']:,.0f} | {speed['served']:,.0f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) | "
            f"{delta:.1e} |"
        )


def measure(offline, served, batch: int, vocab: int, args, request_type) -> tuple:
    """One batch: greedy traces of the offline engine, a warm-up of each, then
    ``--rounds`` alternating timed runs: (batch, tok/s medians, ratios, max |Δ logprob|)."""
    prompts = random_prompts(batch, args.prompt_len, vocab)
    traces = [ids for ids, _ in offline.generate(prompts, max_tokens=args.new_tokens)]
    requests = [
        request_type(f"b{batch}-{i}", tuple(p), tuple(t))
        for i, (p, t) in enumerate(zip(prompts, traces))
    ]
    engines = {"offline": offline, "served": served}
    results = {path: engine.run(requests) for path, engine in engines.items()}  # warm-up
    delta = float(
        np.abs(
            np.concatenate(
                [a.logprob - b.logprob for a, b in zip(results["offline"], results["served"])]
            )
        ).max()
    )
    seconds = {path: [] for path in engines}
    for r in range(args.rounds):
        for path in ("offline", "served") if r % 2 == 0 else ("served", "offline"):
            start = time.perf_counter()
            engines[path].run(requests)
            seconds[path].append(time.perf_counter() - start)
    tokens = sum(len(t) for t in traces)
    ratios = [o / s for o, s in zip(seconds["offline"], seconds["served"])]
    print(
        f"  batch {batch}: offline {statistics.median(seconds['offline']):.3f} s, served "
        f"{statistics.median(seconds['served']):.3f} s",
        flush=True,
    )
    return (batch, {p: tokens / statistics.median(s) for p, s in seconds.items()}, ratios, delta)


if __name__ == "__main__":
    main()
