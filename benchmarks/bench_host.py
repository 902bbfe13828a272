"""The host's share of a replay: per trace, one engine call against the work after it.

Every replay loop (the single process's, a cluster actor's) turns each engine call's results
into rows on the host before the next call starts, while the device waits: the check of
the engine's results (``check_results``), the frame (``to_frame``), and with a checkpoint
the part write (``write_checked``: the read-back rules, then Parquet) and the verified read
at the end or by a cluster's driver (``read_part``). This times each of them on the results
of one real engine call of ``--traces`` traces × ``--length`` tokens, against that call,
median of ``--repeats``; the share is of the call plus everything after it. Last, the
verified read of a whole checkpoint folder, what a resumed run and a cluster run's driver
pay once: those results copied to ``--folder-traces`` traces, written as parts of 256
traces by a ``Checkpoint``, then opened and read by a new one (tokens/s).

The stages depend on the trace count, trace length and top-k, not on the weights: the
default is the ``smollm2-135m`` shape with random weights (``shapes.py``), random token ids.

Usage::

    python benchmarks/bench_host.py --device cpu --engine prefill --traces 64 --length 256
    python benchmarks/bench_host.py --device cuda --engine torch --batch 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_ray import random_traces, shape_folder

from trace_replay.engines import make_engine
from trace_replay.engines.validate import check_results
from trace_replay.runs.checkpoint import Checkpoint, trace_digest
from trace_replay.runs.frame import TokenDecoder, to_frame
from trace_replay.runs.parts import read_part, write_checked
from trace_replay.runs.replay import prepare_run
from trace_replay.traces.sets import load_traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", default="prefill")
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--traces", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder-traces", type=int, default=1024)
    args = parser.parse_args()

    folder, vocab = shape_folder(args.shape, args.device)
    engine = make_engine(
        args.engine, folder, device=args.device, dtype=args.dtype, batch_size=args.batch
    )
    limits = {"top_k": engine.settings().get("top_k"), "vocab_size": engine.vocab_size}
    traces, requests, _ = prepare_run(
        load_traces(random_traces(args.traces, args.length, vocab)),
        tokenizer=engine.tokenizer,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        top_k=limits["top_k"],
        truncate=False,
    )
    traces = {t.id: t for t in traces}
    digests = {trace_digest("bench", r, traces[r.trace_id]): r for r in requests}
    digest_of = {r.trace_id: d for d, r in digests.items()}
    decode = TokenDecoder(engine.tokenizer)  # one memo for the run, as a replay keeps
    to_frame(engine.run(requests[: args.batch]), traces, decode)  # warm-up: caches, the memo

    stages = ["engine call", "check_results", "to_frame", "write_checked", "read_part"]
    seconds = {stage: [] for stage in stages}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            start = time.perf_counter()
            results = engine.run(requests)
            marks = [time.perf_counter()]
            check_results(requests, results, **limits)
            marks.append(time.perf_counter())
            frame = to_frame(results, traces, decode)
            marks.append(time.perf_counter())
            frame = frame.assign(trace_digest=frame["trace_id"].map(digest_of))
            part, failed = write_checked(Path(scratch), frame, "bench", requests=digests, **limits)
            assert part is not None and not failed, failed
            marks.append(time.perf_counter())
            read_part(part, requests=digests, **limits)
            marks.append(time.perf_counter())
            for stage, begin, end in zip(stages, [start, *marks], marks):
                seconds[stage].append(end - begin)

        read_s, tokens = folder_read(
            Path(scratch) / "folder",
            engine,
            results,
            traces,
            requests,
            decode,
            args.folder_traces,
            args.repeats,
        )

    device = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"{platform.machine()} CPU"
    )
    print(
        f"{dt.date.today()} · {device}, {os.cpu_count()} cores · torch {torch.__version__} · "
        f"{args.engine} engine, {args.shape} shape ({engine.settings().get('dtype')}), batch "
        f"{args.batch}, top-k {limits['top_k']} · {args.traces} traces × {args.length} tokens "
        f"in one call · median of {args.repeats}"
    )
    medians = {stage: statistics.median(seconds[stage]) for stage in stages}
    total = sum(medians.values())
    print("\n| stage | ms per trace | share |\n|---|---:|---:|")
    for stage in stages:
        print(
            f"| {stage} | {medians[stage] * 1e3 / args.traces:.3f} | {medians[stage] / total:.1%} |"
        )
    host = total - medians["engine call"]
    print(f"| host, all stages | {host * 1e3 / args.traces:.3f} | {host / total:.1%} |")
    print(
        f"\ncheckpoint folder of {args.folder_traces} traces ({tokens} tokens) opened and "
        f"read: {read_s:.2f} s, {tokens / read_s:,.0f} tokens/s"
    )


def folder_read(
    folder: Path,
    engine,
    results: list,
    traces: dict,
    requests: list,
    decode: TokenDecoder,
    count: int,
    repeats: int,
) -> tuple[float, int]:
    """Seconds (median) for a new ``Checkpoint`` to open a folder of ``count`` traces (the
    results copied under new ids) and read it; and its token count."""
    copies = [
        (
            replace(result, trace_id=f"{result.trace_id}.{i}"),
            replace(request, trace_id=f"{request.trace_id}.{i}"),
            replace(traces[result.trace_id], id=f"{result.trace_id}.{i}"),
        )
        for i in range(-(-count // len(results)))
        for result, request in zip(results, requests)
    ][:count]
    results = {result.trace_id: result for result, _, _ in copies}
    requests = [request for _, request, _ in copies]
    traces = {trace.id: trace for _, _, trace in copies}
    settings = engine.settings()
    with Checkpoint(
        folder,
        settings,
        requests,
        traces,
        max_traces=256,
        every_s=1e9,
        vocab_size=engine.vocab_size,
    ) as store:
        while group := store.claim(256):
            store.add(to_frame([results[r.trace_id] for r in group], traces, decode))
        store.read()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        with Checkpoint(folder, settings, requests, traces, vocab_size=engine.vocab_size) as store:
            frame = store.read()
        seconds.append(time.perf_counter() - start)
    assert len(frame) == sum(r.trace_len for r in requests)
    return statistics.median(seconds), len(frame)


if __name__ == "__main__":
    main()
