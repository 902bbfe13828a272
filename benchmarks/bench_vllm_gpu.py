"""vLLM on a GPU: the package's native and forcing replay against plain vLLM greedy decoding.

Three engines live side by side, each with its engine core in its own process (vLLM
captures one LLM's CUDA graphs per process): plain ``vllm.LLM`` with the package engine's
own arguments but no trace flag and no processor ("greedy"), ``make_engine("vllm")``
(native trace replay on Model Runner V2) and ``make_engine("vllm", native=False)``
(forcing, MRV2's logits processor). Per batch: random token-id prompts, vLLM's greedy
output as the traces (so replay must emit exactly them), then rounds that time each path
once, in a rotating order; ratios are per round (neighbours in time), their median and
range printed; ``--seconds`` adds rounds where calls are short (batch 1 and 16 calls at
135M take ~0.3 s and spread ±20% from call to call). Greedy is timed as a user runs it
(``LLM.generate``, top-5 raw logprobs, ``ignore_eos``), and again with ``flat_logprobs``
(the form the package's engine asks for); replay as ``engine.run`` (the package's
requests and result arrays included).
Weights are random (``shapes.py``); speed does not depend on their values. The
``in-process`` part then times native replay with its engine core in this process (the
package's default) against the own-process median.

Tensor parallelism (``--tp 2``, issue 33): the three engines run at that size, and the
``agreement`` part replays the same on- and off-policy traces (every 7th token replaced)
through native and forcing at TP=1 and at ``--tp``, one engine at a time, eager, and prints
the bf16 statistics: median and max |Δ logprob|, rank agreement, tokens followed exactly;
the ``served`` part adds ``trace-replay serve``'s server at ``--tp`` (``vllm serve`` with the
forcing processor, ``--tensor-parallel-size``) replayed through ``engine="vllm-server"``,
against TP=1 forcing (the model folder gets a byte-level tokenizer for the server's checks).
``--layers`` builds a model of a shape's widths with fewer layers (``llama-3.1-70b
--layers 40``: 72.6 GB of bf16 weights, 36.3 GB per GPU at TP=2; the full 80 layers, 141 GB,
exceed the two-GPU machine's 128 GiB disk and three TP=2 engines side by side, and the
agreement part needs the model on one GPU too). ``--model-dir`` keeps the saved model for the
next command (speed and agreement in separate commands fit the 10-minute limit).

Usage (on the H200 with ../shared/tools/vllm-h200, see benchmarks/h200_vllm.sh)::

    python3 benchmarks/bench_vllm_gpu.py --shape llama-3.1-8b --batches 1,16,64,256 --rounds 5
    python3 benchmarks/bench_vllm_gpu.py --shape smollm2-135m --parts speed,in-process
    python3 benchmarks/bench_vllm_gpu.py --tp 2 --shape llama-3.1-70b --layers 40 \
        --model-dir /tmp/m70 --parts speed --batches 1,16,64 --memory 0.3
    python3 benchmarks/bench_vllm_gpu.py --tp 2 --shape llama-3.1-70b --layers 40 \
        --model-dir /tmp/m70 --parts agreement,served
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from shapes import random_model

PATHS = ("greedy", "greedy-flat", "native", "forcing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="per batch, add rounds (up to 8 x --rounds) until the timed calls "
        "reach this many seconds: more rounds where calls are short",
    )
    parser.add_argument(
        "--memory",
        type=float,
        default=0.28,
        help="gpu_memory_utilization of each of the three engines",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the random model (default: the shape's own)",
    )
    parser.add_argument(
        "--model-dir", default=None, help="save the random model here, or reuse the one saved there"
    )
    parser.add_argument(
        "--parts",
        default=None,
        help="speed, in-process, agreement, served, comma-separated (default: "
        "speed; speed, agreement and served with --tp > 1)",
    )
    parser.add_argument(
        "--check-batch",
        type=int,
        default=32,
        help="traces of the agreement part (as many off-policy)",
    )
    args = parser.parse_args()
    parts = (args.parts or ("speed,agreement,served" if args.tp > 1 else "speed")).split(",")
    # each engine core in its own process: vLLM captures CUDA graphs for one LLM per process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    folder, vocab = model_folder(args)
    if "speed" in parts:
        requests, native_seconds = speed(folder, vocab, args)
        if "in-process" in parts:
            in_process(folder, requests, native_seconds, args)
    if "agreement" in parts or "served" in parts:
        agreement(folder, vocab, args, "agreement" in parts, "served" in parts)


def model_folder(args) -> tuple[str, int]:
    """The random model's folder (saved now, or found in ``--model-dir``) and vocabulary."""
    import transformers

    if args.model_dir and (Path(args.model_dir) / "config.json").is_file():
        return args.model_dir, transformers.AutoConfig.from_pretrained(args.model_dir).vocab_size
    folder = args.model_dir or tempfile.mkdtemp()
    lm = random_model(args.shape, getattr(torch, args.dtype), torch.device("cuda"), args.layers)
    lm.save_pretrained(folder)
    vocab = lm.config.vocab_size
    del lm
    torch.cuda.empty_cache()
    add_byte_tokenizer(folder)
    return folder, vocab


def add_byte_tokenizer(folder: str) -> None:
    """Save a byte-level tokenizer (256 ids, no merges) in ``folder``: a server needs one, and
    the vllm-server engine checks the server encodes text as it does."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


def random_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """``batch`` token-id prompts, seeded by the batch size."""
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def speed_engine_args(args) -> dict:
    """The ``engine_args`` of the speed and in-process parts' engines."""
    return {
        "skip_tokenizer_init": True,
        "gpu_memory_utilization": args.memory,
        "max_model_len": args.prompt_len + args.new_tokens + 16,
        "tensor_parallel_size": args.tp,
    }


def speed(folder: str, vocab: int, args) -> tuple[dict, dict]:
    """Greedy, native and forcing side by side at ``--tp``: interleaved rounds, ratio table.

    Greedy is timed twice per round: as vLLM gives logprobs by default (a dict and a
    ``Logprob`` per entry; "greedy", the issue's baseline) and with ``flat_logprobs``, the
    form the package's engine asks for ("greedy-flat"), so the table shows how much of a
    ratio is that choice. Returns each batch's requests and native's median seconds."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest
    from trace_replay.engines.vllm.inprocess import multicast_off

    batches = [int(b) for b in args.batches.split(",")]
    engine_args = speed_engine_args(args)

    startup = {}
    engines = {}
    for path, native in (("native", None), ("forcing", False)):
        start = time.perf_counter()
        engines[path] = make_engine(
            "vllm",
            folder,
            dtype=args.dtype,
            batch_size=max(batches),
            top_k=5,
            engine_args=engine_args,
            native=native,
        )
        startup[path] = time.perf_counter() - start
    start = time.perf_counter()
    with multicast_off(args.tp > 1):  # as the package's engines start
        plain = LLM(**engines["native"].llm_args)
    startup["greedy"] = time.perf_counter() - start
    settings = {p: engines[p].settings() for p in engines}
    greedy_params = {
        flat: SamplingParams(
            temperature=0.0,
            max_tokens=args.new_tokens,
            logprobs=5,
            ignore_eos=True,
            detokenize=False,
            flat_logprobs=flat,
        )
        for flat in (False, True)
    }

    def timed(path, prompts, requests):
        start = time.perf_counter()
        if path.startswith("greedy"):
            out = plain.generate(prompts, greedy_params[path == "greedy-flat"], use_tqdm=False)
        else:
            out = engines[path].run(requests)
        return time.perf_counter() - start, out

    rows = []
    all_requests, native_seconds = {}, {}
    for batch in batches:
        ids = random_prompts(batch, args.prompt_len, vocab)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        _, greedy = timed("greedy", prompts, None)  # warm-up; its outputs are the traces
        greedy = [o.outputs[0] for o in greedy]
        requests = [
            ReplayRequest(f"b{batch}-{i}", tuple(p), tuple(g.token_ids))
            for i, (p, g) in enumerate(zip(ids, greedy))
        ]
        all_requests[batch] = requests
        want = np.concatenate(
            [[lp[t].logprob for t, lp in zip(g.token_ids, g.logprobs)] for g in greedy]
        )
        seconds = {p: [] for p in PATHS}
        delta = {}
        timed("greedy-flat", prompts, None)  # warm-up
        for path in PATHS[2:]:  # warm-up, and the numbers against greedy's
            _, results = timed(path, prompts, requests)
            delta[path] = float(np.abs(np.concatenate([r.logprob for r in results]) - want).max())
        r = 0
        while r < args.rounds or (
            sum(map(sum, seconds.values())) < args.seconds and r < 8 * args.rounds
        ):
            shift = r % len(PATHS)
            order = PATHS[shift:] + PATHS[:shift]  # rotating: no path always runs first
            for path in order:
                seconds[path].append(timed(path, prompts, requests)[0])
            r += 1
        tokens = batch * args.new_tokens
        ratios = {p: [g / s for g, s in zip(seconds["greedy"], seconds[p])] for p in PATHS[1:]}
        ratios.update(
            {
                f"{p}/flat": [g / s for g, s in zip(seconds["greedy-flat"], seconds[p])]
                for p in PATHS[2:]
            }
        )
        native_seconds[batch] = statistics.median(seconds["native"])
        rows.append(
            (batch, {p: tokens / statistics.median(seconds[p]) for p in PATHS}, ratios, delta)
        )
        print(
            f"  batch {batch}, {r} rounds: "
            + ", ".join(f"{p} {statistics.median(seconds[p]):.3f} s" for p in PATHS),
            flush=True,
        )
    for engine in engines.values():
        engine.close()

    rounds = f"{args.rounds}" + (f"+ (to {args.seconds:g} s a batch)" if args.seconds else "")
    print(
        f"\n{header(args)} · {rounds} interleaved rounds · start-up s: "
        + ", ".join(f"{p} {startup[p]:.0f}" for p in startup)
    )
    for path in engines:
        print(
            f"{path}: {settings[path]['engine_path']}, model runner "
            f"{settings[path]['model_runner']}, engine core {settings[path]['engine_core']}, "
            f"tensor_parallel_size {settings[path]['tensor_parallel_size']}"
        )
    print(
        "\nRatios: replay speed / greedy speed, the median over rounds of each round's "
        "ratio (min–max in brackets). >= 0.97 is the target."
    )
    print(
        "\n| batch | greedy tok/s | native tok/s | forcing tok/s | native / greedy | "
        "forcing / greedy | greedy-flat / greedy | native / greedy-flat | "
        "forcing / greedy-flat | max |Δ logprob| native, forcing vs greedy |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for batch, speed, ratios, delta in rows:
        print(
            f"| {batch} | {speed['greedy']:,.0f} | {speed['native']:,.0f} | "
            f"{speed['forcing']:,.0f} | {spread(ratios['native'])} | "
            f"{spread(ratios['forcing'])} | {spread(ratios['greedy-flat'])} | "
            f"{spread(ratios['native/flat'])} | {spread(ratios['forcing/flat'])} | "
            f"{delta['native']:.1e}, {delta['forcing']:.1e} |"
        )
    return all_requests, native_seconds


def in_process(folder: str, requests: dict, native_seconds: dict, args) -> None:
    """Native replay with the engine core in this process (the package's default), after
    the speed part's engines (their cores in their own processes) are shut: the same
    requests, ``--rounds`` runs per batch, median against native's own-process median.
    One LLM at a time here: vLLM captures CUDA graphs for one in-process LLM per process."""
    from trace_replay.engines import make_engine

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start = time.perf_counter()
    engine = make_engine(
        "vllm",
        folder,
        dtype=args.dtype,
        batch_size=max(requests),
        top_k=5,
        engine_args=speed_engine_args(args),
    )
    print(
        f"\nin-process native: started in {time.perf_counter() - start:.0f} s, "
        f"engine core {engine.settings()['engine_core']}"
    )
    print(
        "\n| batch | native in-process tok/s | in-process / own process (medians) | "
        "in-process rounds s |"
    )
    print("|---:|---:|---:|---|")
    for batch, group in requests.items():
        engine.run(group)  # warm-up
        seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            engine.run(group)
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        print(
            f"| {batch} | {batch * args.new_tokens / median:,.0f} | "
            f"{native_seconds[batch] / median:.2f} | "
            f"{', '.join(f'{s:.3f}' for s in seconds)} |",
            flush=True,
        )
    engine.close()


def header(args) -> str:
    """The run's date, devices, versions, model and sizes, on one line."""
    import vllm

    layers = f" ({args.layers} layers)" if args.layers else ""
    return (
        f"{dt.date.today()} · {torch.cuda.device_count()}x {torch.cuda.get_device_name()} · "
        f"vLLM {vllm.__version__} · torch {torch.__version__} · {args.shape}{layers} random "
        f"weights · {args.dtype} · TP={args.tp} · {args.prompt_len}-token prompts · "
        f"{args.new_tokens} tokens/row"
    )


def agreement(folder: str, vocab: int, args, in_process: bool = True, served: bool = False) -> None:
    """Native and forcing at TP=1 and (``in_process``) at ``--tp``, and (``served``) a
    server at ``--tp``, on the same traces, one engine at a time: the table of differences
    of each against its TP=1 run (the server's against TP=1 forcing)."""
    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest

    engine_args = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": args.prompt_len + args.new_tokens + 16,
    }
    if torch.cuda.is_available():  # one engine at a time
        engine_args["gpu_memory_utilization"] = 0.7
    prompts = random_prompts(args.check_batch, args.prompt_len, vocab)
    results, requests = {}, None
    for tp in (1, args.tp) if in_process else (1,):
        for path, native in (("native", None), ("forcing", False)):
            engine = make_engine(
                "vllm",
                folder,
                dtype=args.dtype,
                batch_size=2 * len(prompts),
                top_k=5,
                native=native,
                engine_args={**engine_args, "tensor_parallel_size": tp},
            )
            try:
                if requests is None:  # TP=1 native's greedy output, then every 7th replaced
                    traces = [
                        ids for ids, _ in engine.generate(prompts, max_tokens=args.new_tokens)
                    ]
                    requests = on_and_off_policy(prompts, traces, vocab, ReplayRequest)
                results[tp, path] = (engine.settings()["engine_path"], engine.run(requests))
            except RuntimeError as exc:  # a trace not followed: the finding, said below
                results[tp, path] = (str(exc), None)
            finally:
                engine.close()
    rows = [(path, path) for path in ("native", "forcing") if (args.tp, path) in results]
    if served:
        results[args.tp, "served"] = replay_served(folder, requests, args)
        rows.append(("served", "forcing"))
    print(
        f"\n{header(args)} · {len(requests)} traces ({len(prompts)} greedy, "
        f"{len(prompts)} with every 7th token replaced) · eager"
    )
    print(
        "\n| path | engine path at TP | median |Δ logprob| | max |Δ logprob| | "
        "rank agreement | tokens followed exactly |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for path, reference in rows:
        base, other = results[1, reference][1], results[args.tp, path][1]
        if base is None or other is None:
            print(f"| {path} | failed: {results[1, reference][0]} / {results[args.tp, path][0]} |")
            continue
        delta = np.abs(np.concatenate([a.logprob - b.logprob for a, b in zip(base, other)]))
        ranks = np.concatenate([a.rank == b.rank for a, b in zip(base, other)])
        followed = sum(
            int((r.token_ids == q.trace_token_ids).sum()) for r, q in zip(other, requests)
        )
        total = sum(q.trace_len for q in requests)
        print(
            f"| {path} | {results[args.tp, path][0]} | {np.median(delta):.2e} | "
            f"{delta.max():.2e} | {ranks.mean():.4f} | {followed}/{total} |"
        )


def replay_served(folder: str, requests: list, args) -> tuple[str, list | None]:
    """Start ``trace-replay serve``'s command at ``--tp`` (in ``--dtype``, eager), replay
    ``requests`` through ``engine="vllm-server"``, stop it: (what ran, results or None)."""
    from trace_replay.engines import make_engine
    from trace_replay.engines.server.serve import (
        serve_command,
        start_server,
        stop_server,
        wait_for_server,
    )

    port = 8321
    extra = [
        "--tensor-parallel-size",
        str(args.tp),
        "--dtype",
        args.dtype,
        "--enforce-eager",
        "--max-model-len",
        str(args.prompt_len + args.new_tokens + 16),
        "--max-num-seqs",
        str(len(requests)),
    ]
    if torch.cuda.is_available():
        extra += ["--gpu-memory-utilization", "0.7"]
    command = serve_command(folder, port=port, extra_args=extra)
    log = Path(tempfile.mkdtemp()) / "server.log"
    process = start_server(command, log)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_for_server(base_url, process, timeout_s=500, log_path=log)
        with make_engine(
            "vllm-server",
            folder,
            batch_size=len(requests),
            top_k=5,
            engine_args={"base_url": base_url},
        ) as engine:
            label = (
                f"vllm serve --tensor-parallel-size {args.tp}, {engine.settings()['engine_path']}"
            )
            try:
                return label, engine.run(requests)
            except RuntimeError as exc:  # a trace not followed: the finding
                return f"{label}: {exc}", None
    finally:
        stop_server(process)


def on_and_off_policy(prompts, traces, vocab, request_type) -> list:
    """Requests of ``traces`` as given, then again with every 7th token (from step 3)
    replaced by a seeded random one."""
    gen = torch.Generator().manual_seed(7)
    off = []
    for trace in traces:
        trace = list(trace)
        for step in range(3, len(trace), 7):
            trace[step] = int(torch.randint(3, vocab, (1,), generator=gen))
        off.append(trace)
    return [
        request_type(f"{kind}{i}", tuple(p), tuple(t))
        for kind, group in (("on", traces), ("off", off))
        for i, (p, t) in enumerate(zip(prompts, group))
    ]


def spread(ratios: list[float]) -> str:
    """``median (min–max)`` of per-round ratios."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


if __name__ == "__main__":
    main()
