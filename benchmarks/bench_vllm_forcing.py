"""vLLM: the package's forcing logits processor against vLLM's own greedy decoding.

One ``vllm.LLM`` with :class:`~trace_replay.engines.vllm.engine.TraceForcingProcessor`
loaded serves both paths (the processor returns at once while no request carries a
trace), so "forcing / greedy" is the cost of forcing alone. Loading any custom logits
processor has a cost of its own in vLLM V1: it hands processors every request's output
token list, which under async scheduling is completed from the GPU before each sampling
step. As the package's ``VLLMEngine`` does, the benchmark turns that off with
``read_lengths_only`` (the processor reads only the lists' lengths);
``--keep-output-tokens`` leaves vLLM's default, to measure what that costs. ``--vanilla``
starts a second ``LLM`` without the processor, side by side, and times its greedy decoding
in the same interleaved loop ("forcing / vanilla greedy").

Weights are random (a published shape from ``shapes.py``, saved with ``save_pretrained``;
no tokenizer: token-id prompts), the traces are vLLM's own greedy output, so replay must emit exactly them with exactly
greedy's logprobs; both are checked. Logprobs: ``raw_logprobs``, top 5, as the package asks.

Usage::

    VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/bench_vllm_forcing.py --batches 64,256

``--profile DIR`` runs vLLM's engine core in this process (as the package's ``VLLMEngine``
does) and, after the timed runs, profiles one greedy and one forcing ``generate`` per batch
with cProfile: ``DIR/{greedy,forcing}_b{batch}.prof`` and a text summary of the functions
whose own time differs most between the two paths.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import os
import pstats
import statistics
import tempfile
import time

import torch
from shapes import random_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--vanilla",
        action="store_true",
        help="also time greedy on a second LLM without the processor",
    )
    parser.add_argument(
        "--keep-output-tokens",
        action="store_true",
        help="leave vLLM completing output-token lists for the processor",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="engine core in process; cProfile one run of each path per batch",
    )
    args = parser.parse_args()
    if args.profile and args.vanilla and torch.cuda.is_available():
        # seen on the H200: "CUDA graph capturing detected at an inappropriate time"
        parser.error(
            "--profile runs the engine cores in this process, where vLLM refuses to "
            "capture a second LLM's CUDA graphs: drop --vanilla"
        )
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core's calls show up

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trace_replay.engines.vllm.engine import (
        TRACE_KEY,
        WORKER_EXTENSION,
        TraceForcingProcessor,
        read_lengths_only,
    )

    folder = tempfile.mkdtemp()
    lm = random_model(args.shape, getattr(torch, args.dtype), torch.device("cpu"))
    lm.save_pretrained(folder)
    vocab = lm.config.vocab_size
    del lm
    batches = [int(b) for b in args.batches.split(",")]

    def start_llm(processor: bool):
        # both instances live side by side (on CPU: host memory, a fixed KV cache each)
        memory = (0.3 if args.vanilla else 0.5) if torch.cuda.is_available() else 0.1
        return LLM(
            model=folder,
            skip_tokenizer_init=True,
            dtype=args.dtype,
            seed=0,
            max_num_seqs=max(batches),
            max_model_len=args.prompt_len + args.new_tokens + 16,
            max_logprobs=20,
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=False,
            gpu_memory_utilization=memory,
            **(
                {}
                if torch.cuda.is_available()
                else dict(enforce_eager=True, kv_cache_memory_bytes=512 << 20)
            ),
            logits_processors=(
                [f"{TraceForcingProcessor.__module__}:TraceForcingProcessor"] if processor else None
            ),
            worker_extension_cls=WORKER_EXTENSION if processor else "",
        )

    start = time.perf_counter()
    llm = start_llm(processor=True)
    startup = time.perf_counter() - start
    lengths_only = not args.keep_output_tokens and read_lengths_only(llm)
    vanilla = start_llm(processor=False) if args.vanilla else None
    common = dict(
        temperature=0.0, max_tokens=args.new_tokens, logprobs=5, ignore_eos=True, detokenize=False
    )

    def generate(prompts, params, engine=None):
        start = time.perf_counter()
        outputs = (engine or llm).generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0] for o in outputs]

    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [
            TokensPrompt(
                prompt_token_ids=torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
            )
            for _ in range(batch)
        ]
        greedy_params = SamplingParams(**common)
        _, greedy = generate(prompts, greedy_params)  # warm-up; these are the traces
        traces = [list(c.token_ids) for c in greedy]
        # one SamplingParams per request, never reused: skip vLLM's deep copy of the
        # trace, as the package's engine does
        forcing_params = [
            SamplingParams(**common, skip_clone=True, extra_args={TRACE_KEY: t}) for t in traces
        ]
        generate(prompts, forcing_params)  # warm-up
        if vanilla is not None:
            generate(prompts, greedy_params, vanilla)  # warm-up
        greedy_s, forcing_s, vanilla_s = [], [], []
        for _ in range(args.repeats):  # interleaved: drifts hit every path alike
            seconds, greedy = generate(prompts, greedy_params)
            greedy_s.append(seconds)
            seconds, forced = generate(prompts, forcing_params)
            forcing_s.append(seconds)
            if vanilla is not None:
                vanilla_s.append(generate(prompts, greedy_params, vanilla)[0])
        exact = all(list(c.token_ids) == t for c, t in zip(forced, traces))
        delta = max(
            abs(f.logprobs[i][tok].logprob - g.logprobs[i][tok].logprob)
            for f, g in zip(forced, greedy)
            for i, tok in enumerate(g.token_ids)
        )
        tokens = batch * args.new_tokens
        g, f = statistics.median(greedy_s), statistics.median(forcing_s)
        v = statistics.median(vanilla_s) if vanilla_s else float("nan")
        # ratios of neighbours in the loop, then their median and range: a drift of the
        # machine between repeats moves both members of a pair
        paired = [gs / fs for gs, fs in zip(greedy_s, forcing_s)]
        paired_v = [vs / fs for vs, fs in zip(vanilla_s, forcing_s)] or [float("nan")]
        rows.append(
            (
                batch,
                tokens / v,
                tokens / g,
                tokens / f,
                spread(paired),
                spread(paired_v),
                exact,
                delta,
            )
        )
        print(
            f"  batch {batch}: vanilla greedy {v:.3f} s, greedy {g:.3f} s, forcing {f:.3f} s",
            flush=True,
        )
        if args.profile:
            stats = {}
            for path, params in (("greedy", greedy_params), ("forcing", forcing_params)):
                profiler = cProfile.Profile()
                profiler.runcall(generate, prompts, params)
                stats[path] = pstats.Stats(profiler)
                stats[path].dump_stats(f"{args.profile}/{path}_b{batch}.prof")
            print(profile_difference(stats["greedy"], stats["forcing"], args.new_tokens))

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"\n{dt.date.today()} · {name} · vLLM {vllm.__version__} · "
        f"torch {torch.__version__} · {args.shape} random weights · {args.dtype} · "
        f"{args.prompt_len}-token prompts · "
        f"{args.new_tokens} tokens/row · median of {args.repeats} · start-up {startup:.0f} s · "
        f"output tokens to processors: {'no (lengths only)' if lengths_only else 'yes'}"
    )
    print("\nRatios: median over repeats of each repeat's pair (min–max in brackets).")
    print(
        "\n| batch | vanilla greedy tok/s | greedy tok/s (processor loaded) | forcing tok/s | "
        "forcing / greedy | forcing / vanilla greedy | emitted = trace | "
        "max |Δ logprob| vs greedy |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for batch, vanilla_tps, greedy_tps, forcing_tps, ratio, ratio_vanilla, exact, delta in rows:
        print(
            f"| {batch} | {vanilla_tps:,.0f} | {greedy_tps:,.0f} | {forcing_tps:,.0f} | "
            f"{ratio} | {ratio_vanilla} | {exact} | {delta:.1e} |"
        )


def spread(ratios: list[float]) -> str:
    """``median (min–max)`` of per-repeat ratios."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def profile_difference(
    greedy: pstats.Stats, forcing: pstats.Stats, steps: int, top: int = 25
) -> str:
    """The functions whose own (and cumulative) time per step grows most with forcing."""

    def table(stats):
        return {
            f"{func[0].rsplit('/', 2)[-1]}:{func[1]}({func[2]})": (tt, ct, nc)
            for func, (_, nc, tt, ct, _) in stats.stats.items()
        }

    a, b = table(greedy), table(forcing)
    lines = [
        f"    total: greedy {greedy.total_tt:.3f} s, forcing {forcing.total_tt:.3f} s "
        f"(+{(forcing.total_tt - greedy.total_tt) / steps * 1e3:.3f} ms/step)",
        "    Δ own ms/step | Δ cum ms/step | calls greedy → forcing | function",
    ]
    keys = sorted(
        a.keys() | b.keys(), key=lambda k: -(b.get(k, (0, 0, 0))[0] - a.get(k, (0, 0, 0))[0])
    )
    for key in keys[:top]:
        (tt_a, ct_a, n_a), (tt_b, ct_b, n_b) = a.get(key, (0, 0, 0)), b.get(key, (0, 0, 0))
        lines.append(
            f"    {(tt_b - tt_a) / steps * 1e3:+.3f} | {(ct_b - ct_a) / steps * 1e3:+.3f}"
            f" | {n_a} → {n_b} | {key}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
