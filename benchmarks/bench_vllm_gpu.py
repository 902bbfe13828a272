"""vLLM on a GPU: the package's native and forcing replay against plain vLLM greedy decoding.

Three engines live side by side, each with its engine core in its own process (vLLM
captures one LLM's CUDA graphs per process): plain ``vllm.LLM`` with the package engine's
own arguments but no trace flag and no processor ("greedy"), ``make_engine("vllm")``
(native trace replay on Model Runner V2) and ``make_engine("vllm", native=False)``
(forcing, MRV2's logits processor). Per batch: random token-id prompts, vLLM's greedy
output as the traces (so replay must emit exactly them), then rounds that time each path
once, in a rotating order; ratios are per round (neighbours in time), their median and
range printed. Greedy is timed as a user runs it (``LLM.generate``, top-5 raw logprobs,
``ignore_eos``); replay as ``engine.run`` (the package's requests and result arrays
included). Weights are random (``shapes.py``); speed does not depend on their values.

Usage (on the H200 with ../shared/tools/vllm-h200, see benchmarks/h200_vllm.sh)::

    python3 benchmarks/bench_vllm_gpu.py --shape llama-3.1-8b --batches 1,16,64,256 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from shapes import random_model

PATHS = ("greedy", "native", "forcing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", type=float, default=0.28,
                        help="gpu_memory_utilization of each of the three engines")
    args = parser.parse_args()
    # each engine core in its own process: vLLM captures CUDA graphs for one LLM per process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest

    folder = tempfile.mkdtemp()
    lm = random_model(args.shape, getattr(torch, args.dtype), torch.device("cuda"))
    lm.save_pretrained(folder)
    vocab = lm.config.vocab_size
    del lm
    torch.cuda.empty_cache()
    batches = [int(b) for b in args.batches.split(",")]
    engine_args = {"skip_tokenizer_init": True, "gpu_memory_utilization": args.memory,
                   "max_model_len": args.prompt_len + args.new_tokens + 16}

    startup = {}
    engines = {}
    for path, native in (("native", None), ("forcing", False)):
        start = time.perf_counter()
        engines[path] = make_engine("vllm", folder, dtype=args.dtype, batch_size=max(batches),
                                    top_k=5, engine_args=engine_args, native=native)
        startup[path] = time.perf_counter() - start
    start = time.perf_counter()
    plain = LLM(**engines["native"].llm_args)
    startup["greedy"] = time.perf_counter() - start
    settings = {p: engines[p].settings() for p in engines}
    greedy_params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, logprobs=5,
                                   ignore_eos=True, detokenize=False)

    def timed(path, prompts, requests):
        start = time.perf_counter()
        if path == "greedy":
            out = plain.generate(prompts, greedy_params, use_tqdm=False)
        else:
            out = engines[path].run(requests)
        return time.perf_counter() - start, out

    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        ids = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(batch)]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        _, greedy = timed("greedy", prompts, None)  # warm-up; its outputs are the traces
        greedy = [o.outputs[0] for o in greedy]
        requests = [ReplayRequest(f"b{batch}-{i}", tuple(p), tuple(g.token_ids))
                    for i, (p, g) in enumerate(zip(ids, greedy))]
        want = np.concatenate([[lp[t].logprob for t, lp in zip(g.token_ids, g.logprobs)]
                               for g in greedy])
        seconds = {p: [] for p in PATHS}
        delta = {}
        for path in PATHS[1:]:  # warm-up, and the numbers against greedy's
            _, results = timed(path, prompts, requests)
            delta[path] = float(np.abs(np.concatenate([r.logprob for r in results]) - want).max())
        for r in range(args.rounds):
            order = PATHS[r % 3:] + PATHS[:r % 3]  # rotating: no path always runs first
            for path in order:
                seconds[path].append(timed(path, prompts, requests)[0])
        tokens = batch * args.new_tokens
        ratios = {p: [g / s for g, s in zip(seconds["greedy"], seconds[p])] for p in PATHS[1:]}
        rows.append((batch, {p: tokens / statistics.median(seconds[p]) for p in PATHS},
                     ratios, delta))
        print(f"  batch {batch}: " + ", ".join(f"{p} {statistics.median(seconds[p]):.3f} s"
                                              for p in PATHS), flush=True)
    for engine in engines.values():
        engine.close()

    name = torch.cuda.get_device_name()
    print(f"\n{dt.date.today()} · {name} · vLLM {vllm.__version__} · torch {torch.__version__} · "
          f"{args.shape} random weights · {args.dtype} · {args.prompt_len}-token prompts · "
          f"{args.new_tokens} tokens/row · {args.rounds} interleaved rounds · start-up s: "
          + ", ".join(f"{p} {startup[p]:.0f}" for p in PATHS))
    for path in engines:
        print(f"{path}: {settings[path]['engine_path']}, model runner "
              f"{settings[path]['model_runner']}, engine core {settings[path]['engine_core']}")
    print("\nRatios: replay speed / greedy speed, the median over rounds of each round's "
          "ratio (min–max in brackets). >= 0.97 is the target.")
    print("\n| batch | greedy tok/s | native tok/s | forcing tok/s | native / greedy | "
          "forcing / greedy | max |Δ logprob| native, forcing vs greedy |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for batch, speed, ratios, delta in rows:
        print(f"| {batch} | {speed['greedy']:,.0f} | {speed['native']:,.0f} | "
              f"{speed['forcing']:,.0f} | {spread(ratios['native'])} | "
              f"{spread(ratios['forcing'])} | {delta['native']:.1e}, {delta['forcing']:.1e} |")


def spread(ratios: list[float]) -> str:
    """``median (min–max)`` of per-round ratios."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


if __name__ == "__main__":
    main()
