"""CPU: the built-in engine's replay time while other work shares the cores.

One bundled trace cut to ``--length`` tokens, replayed by the torch engine (batch 1) at
torch's default intra-op threads and at the engine's own choice
(:mod:`trace_replay.engines.threads`): alone, beside a busy process (a Python busy loop),
and right after a vLLM replay with the vLLM engine alive. Medians of ``--repeats``;
ratios from this one run.

Run it twice to compare vLLM's engine core in-process (the default) with its own process::

    python benchmarks/bench_threads.py
    VLLM_ENABLE_V1_MULTIPROCESSING=1 python benchmarks/bench_threads.py
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import torch
from bench_cpu import timed as median_time  # median of repeats after a warm-up

from trace_replay import datasets
from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest
from trace_replay.models.load import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=48, help="trace tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    trace = next(
        t
        for t in datasets.load(limit=4).tokenize(load_tokenizer())
        if len(t.trace_token_ids) >= args.length
    )
    request = [
        ReplayRequest(
            trace.id, tuple(trace.prompt_token_ids), tuple(trace.trace_token_ids[: args.length])
        )
    ]
    engine = make_engine("torch", device="cpu", batch_size=1)
    chosen, default = engine.threads, torch.get_num_threads()

    def timed(threads: int) -> float:
        engine.threads = threads
        return median_time(lambda: engine.run(request), args.repeats)

    rows = [("alone", default, timed(default)), ("alone", chosen, timed(chosen))]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1)
        rows += [("beside one busy process", n, timed(n)) for n in (default, chosen)]
    finally:
        spinner.kill()
        spinner.wait()
    vllm = make_engine("vllm", engine_args={"max_model_len": 1024})
    core = vllm.settings()["engine_core"]
    for n in (default, chosen):
        vllm.run(request)  # vLLM's worker busy-loops 1 s after a step (engine core own process)
        rows.append((f"right after a vLLM replay (engine core {core})", n, timed(n)))
    vllm.close()

    print(
        f"\n{platform.machine()} CPU, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} · torch {torch.__version__} · torch engine, batch 1, one "
        f"trace × {args.length} tokens · median of {args.repeats}; threads {default}: "
        f"torch's default, {chosen}: the engine's choice"
    )
    print("\n| condition | threads | replay s | × alone at threads |")
    print("|---|---:|---:|---:|")
    alone = {n: seconds for label, n, seconds in rows if label == "alone"}
    for label, n, seconds in rows:
        print(f"| {label} | {n} | {seconds:.2f} | {seconds / alone[n]:.1f} |")


if __name__ == "__main__":
    main()
