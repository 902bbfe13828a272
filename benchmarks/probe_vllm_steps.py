"""Where small-batch replay time goes: plain vLLM greedy against the package's engines, step by
step (issue 45).

``bench_vllm_gpu.py`` gives each path's total time. This probe splits it. The same engines as
there (plain ``vllm.LLM`` greedy, ``make_engine("vllm")`` native, ``native=False`` forcing, each
engine core in its own process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) run the same batch in
rotating rounds, and every ``LLMEngine.step`` call is time-stamped (an instance-level wrapper, so
``LLM.generate`` and the package's loop are measured by the same clock). Per path:

* ``head``: from the call to the first step's return (requests added, prefill);
* ``step``: the median interval between step returns afterwards (the decode loop);
* ``tail``: from the last step's return to the call's return (outputs to results);
* ``total`` and its ratio to greedy's, per round, median (min–max).

Two more paths separate the engine from the package: ``native-greedy`` (the native engine
decoding greedily, no trace: what ``enable_trace_replay`` costs an engine) and
``native-vllm`` (``LLM.generate`` on the native engine with the package's own trace params: vLLM's
replay without the package's loop).

``--py-spy SECONDS`` then samples every process of this run (front end and engine cores) with
py-spy while each of greedy and native loops over the batch, and prints the functions holding
the most samples per process (py-spy must be on PATH).

Usage::

    python3 benchmarks/probe_vllm_steps.py --shape smollm2-135m --batches 1,16 --rounds 9
    # a CPU (forcing only; the engine core in this process)
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/probe_vllm_steps.py --device cpu \\
        --shape tiny --batches 1,16 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import statistics
import subprocess
import tempfile
import time

import torch
from bench_vllm_gpu import random_prompts, spread
from shapes import saved_random_model


class StepClock:
    """Time stamps of an ``LLMEngine``'s ``step`` returns (wraps the instance's method)."""

    def __init__(self, llm_engine) -> None:
        self.stamps: list[float] = []
        step = llm_engine.step

        def timed_step(*args, **kwargs):
            out = step(*args, **kwargs)
            self.stamps.append(time.perf_counter())
            return out

        llm_engine.step = timed_step


def split(start: float, end: float, stamps: list[float]) -> dict[str, float]:
    """``head``, median ``step``, ``tail`` and ``total`` seconds of one call."""
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "head": stamps[0] - start if stamps else float("nan"),
        "step": statistics.median(steps) if steps else float("nan"),
        "tail": end - stamps[-1] if stamps else float("nan"),
        "total": end - start,
        "steps": len(stamps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--memory", type=float, default=0.25)
    parser.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    folder, vocab = saved_random_model(args.shape, args.device)
    engine_args = {
        "skip_tokenizer_init": True,
        "max_model_len": args.prompt_len + args.new_tokens + 16,
    }
    if cuda:
        engine_args["gpu_memory_utilization"] = args.memory
    engines = {}
    for path, native in (("native", None), ("forcing", False)) if cuda else (("forcing", False),):
        engines[path] = make_engine(
            "vllm",
            folder,
            dtype=str(dtype)[6:],
            batch_size=args.max_num_seqs,
            top_k=5,
            native=native,
            engine_args=engine_args,
        )
    first = next(iter(engines.values()))
    plain = LLM(**first.llm_args)
    clocks = {"greedy": StepClock(plain.llm_engine)}
    for path, engine in engines.items():
        clocks[path] = StepClock(engine.llm.llm_engine)
    greedy = SamplingParams(
        temperature=0.0,
        max_tokens=args.new_tokens,
        logprobs=5,
        ignore_eos=True,
        detokenize=False,
        flat_logprobs=True,
    )
    paths = ["greedy", *engines]
    if "native" in engines:
        paths += ["native-greedy", "native-vllm"]
    settings = first.settings()
    print(
        f"{dt.date.today()} · {torch.cuda.get_device_name() if cuda else 'CPU'} · "
        f"{args.shape} · engine core {settings['engine_core']} · max_num_seqs "
        f"{args.max_num_seqs} · {args.rounds} rounds · {args.new_tokens} tokens/row",
        flush=True,
    )

    def call(path, prompts, requests):
        """Run ``path`` once: ``(start, end, stamps)``."""
        engine = engines.get(path.split("-")[0])
        clock = clocks["greedy" if engine is None else path.split("-")[0]]
        clock.stamps = []
        start = time.perf_counter()
        if path == "greedy":
            plain.generate(prompts, greedy, use_tqdm=False)
        elif path == "native-greedy":
            engine.llm.generate(prompts, greedy, use_tqdm=False)
        elif path == "native-vllm":
            engine.llm.generate(prompts, [engine._params(r) for r in requests], use_tqdm=False)
        else:
            engine.run(requests)
        return start, time.perf_counter(), clock.stamps

    for batch in (int(b) for b in args.batches.split(",")):
        ids = random_prompts(batch, args.prompt_len, vocab)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        outs = plain.generate(prompts, greedy, use_tqdm=False)
        requests = [
            ReplayRequest(f"b{batch}-{i}", tuple(p), tuple(o.outputs[0].token_ids))
            for i, (p, o) in enumerate(zip(ids, outs))
        ]
        for path in paths:  # warm-up
            call(path, prompts, requests)
        runs = collections.defaultdict(list)
        for r in range(args.rounds):
            for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
                runs[path].append(split(*call(path, prompts, requests)))
        print(
            f"\nbatch {batch}: ms (median over rounds); ratio = greedy total / path total "
            "per round\n\n| path | total | head | step | tail | steps | greedy / path |\n"
            "|---|---:|---:|---:|---:|---:|---:|"
        )
        for path in paths:
            med = {
                k: 1e3 * statistics.median(r[k] for r in runs[path])
                for k in ("total", "head", "step", "tail")
            }
            ratio = spread([g["total"] / p["total"] for g, p in zip(runs["greedy"], runs[path])])
            print(
                f"| {path} | {med['total']:.1f} | {med['head']:.2f} | {med['step']:.3f} | "
                f"{med['tail']:.2f} | {runs[path][0]['steps']} | {ratio} |",
                flush=True,
            )
        if args.py_spy:
            for path in ("greedy", "native" if "native" in engines else "forcing"):
                sample(path, args.py_spy, lambda p=path: call(p, prompts, requests))
    for engine in engines.values():
        engine.close()


def sample(path: str, seconds: float, run) -> None:
    """py-spy over this process and its children while ``run`` loops for ``seconds``; the
    top functions by samples per process."""
    with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as file:
        out = file.name
    spy = subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(os.getpid()),
            "--subprocesses",
            "--nonblocking",
            "--rate",
            "400",
            "--duration",
            str(int(seconds)),
            "--format",
            "raw",
            "--output",
            out,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    stop = time.monotonic() + seconds
    time.sleep(0.5)
    while time.monotonic() < stop:
        run()
    _, err = spy.communicate(timeout=60)
    if spy.returncode:
        print(f"py-spy failed: {err.decode()[-300:]}")
        return
    per_process = collections.defaultdict(collections.Counter)
    inclusive = collections.defaultdict(collections.Counter)
    totals = collections.Counter()
    with open(out) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            process = frames[0][:60]  # 'process PID:"NAME"'
            leaf = frames[-1]
            per_process[process][leaf] += int(count)
            for frame in set(frames[1:]):
                inclusive[process][frame] += int(count)
            totals[process] += int(count)
    print(
        f"\npy-spy, {path}: samples per process; leaf functions holding >= 2% (self), "
        "then functions by inclusive share"
    )
    for process, count in totals.most_common(4):
        print(f"- {process}: {count} samples")
        for leaf, n in per_process[process].most_common(12):
            if n >= 0.02 * count:
                print(f"    self {100 * n / count:5.1f}%  {leaf[:150]}")
        for frame, n in inclusive[process].most_common(25):
            print(f"    incl {100 * n / count:5.1f}%  {frame[:150]}")


if __name__ == "__main__":
    main()
