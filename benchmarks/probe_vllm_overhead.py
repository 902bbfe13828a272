"""Where a vLLM replay's time goes beside greedy decoding, on one engine (one engine core).

``bench_vllm_gpu.py`` sets the package's replay against a second ``LLM`` doing greedy
decoding; two engine instances in two processes add their own spread. Here one
``make_engine("vllm")`` does everything, so the differences are the work alone. Per batch,
rounds of (rotating order):

* ``greedy``: ``llm.generate`` without a trace, vLLM's default dict logprobs;
* ``greedy-flat``: the same with ``flat_logprobs`` (the form the engine asks for);
* ``vllm-replay``: ``llm.generate`` with the engine's own trace params but vLLM's default
  ``FINAL_ONLY`` outputs (vLLM's replay, none of the package's loop);
* ``engine.run``: the package's replay as a user runs it (DELTA outputs, one per request
  and step, for progress; result arrays).

Ratios: a baseline's seconds over each path's, per round, median (min–max); the baselines
are greedy-flat and greedy (the issue's: vLLM as a user runs it).

Usage (H200, bundle of ../shared/tools/vllm-h200)::

    python3 benchmarks/probe_vllm_overhead.py --shape smollm2-135m --batches 16,64,256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from bench_vllm_gpu import random_prompts, spread
from shapes import random_model

PATHS = ("greedy", "greedy-flat", "vllm-replay", "engine.run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
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

    folder = tempfile.mkdtemp()
    lm = random_model(args.shape, torch.bfloat16, torch.device("cuda"), None)
    lm.save_pretrained(folder)
    vocab = lm.config.vocab_size
    del lm
    torch.cuda.empty_cache()
    batches = [int(b) for b in args.batches.split(",")]
    engine = make_engine("vllm", folder, dtype="bfloat16", batch_size=max(batches), top_k=5,
                         native=None if args.native == "auto" else False,
                         engine_args={"skip_tokenizer_init": True, "gpu_memory_utilization": 0.3,
                                      "max_model_len": args.prompt_len + args.new_tokens + 16})
    settings = engine.settings()
    greedy = {flat: SamplingParams(temperature=0.0, max_tokens=args.new_tokens, logprobs=5,
                                   ignore_eos=True, detokenize=False, flat_logprobs=flat)
              for flat in (False, True)}
    print(f"{torch.cuda.get_device_name()} · {args.shape} · {settings['engine_path']} · engine "
          f"core {settings['engine_core']} · {args.rounds} rounds · {args.new_tokens} tokens/row")
    print("\n| batch | greedy-flat tok/s | × greedy-flat: greedy | vllm-replay | engine.run "
          "| × greedy: vllm-replay | engine.run |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        ids = random_prompts(batch, args.prompt_len, vocab)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        outs = engine.llm.generate(prompts, greedy[True], use_tqdm=False)
        requests = [ReplayRequest(f"r{i}", tuple(p), tuple(o.outputs[0].token_ids))
                    for i, (p, o) in enumerate(zip(ids, outs))]

        def replay_params():
            params = [engine._params(r) for r in requests]
            for p in params:
                p.output_kind = RequestOutputKind.FINAL_ONLY
            return params

        def run(path):
            if path == "engine.run":
                start = time.perf_counter()
                engine.run(requests)
                return time.perf_counter() - start
            params = replay_params() if path == "vllm-replay" else greedy[path == "greedy-flat"]
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
        print(f"| {batch} | {tokens / statistics.median(seconds['greedy-flat']):,.0f} | "
              f"{ratio('greedy')} | {ratio('vllm-replay')} | {ratio('engine.run')} | "
              f"{ratio('vllm-replay', 'greedy')} | {ratio('engine.run', 'greedy')} |", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
