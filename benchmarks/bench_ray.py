"""Cluster runs on Ray against the single-process run: traces/s, and what Ray adds.

Every configuration replays the same token-id traces end to end through ``tr.replay`` into
a fresh checkpoint folder: the single-process run (engine by name) and Ray runs of 1, 2…
actors on one already started cluster (``ray.init`` is not timed; each run's probe, actor
starts and final verified read are). Each is run at two sizes, ``--small`` and ``--traces``
traces, in rounds that interleave the configurations (each round starting with the next
one); the marginal rate, (large − small) /
(median time large − median time small), cancels the fixed start-up of each path (model
loads, Ray's actor pool) and is the throughput a long run approaches; the single-process
run's engine (kept by name for the process) is started once, untimed, before the rounds, so
a first run does not carry it alone. Ratios are to the single-process run of the same round
set. The marginal rate takes the difference of two end-to-end times, so it carries the
spread of Ray's start-up (several seconds on a GPU, where a run is tens of seconds); the
steady rate (:func:`steady_rate`, from the large run's checkpoint parts) is the rate while
parts were being written, start-up and the final read left out, and its ratio is taken
per round (neighbours in time).

The embedded model on the CPU by default (bundled traces cut to ``--length`` tokens), one
thread per actor and in the single-process run (2 actors on 2 cores). ``--device cuda``:
one GPU per actor; ``--model FOLDER`` any model folder, or ``--shape NAME`` a random-weight
model of that shape (``shapes.py``) saved with a byte-level tokenizer, random token ids.

Usage::

    python benchmarks/bench_ray.py --actors 1,2 --traces 32 --small 8 --length 32
    python benchmarks/bench_ray.py --device cuda --actors 1 --traces 2048 --small 256 \
        --length 256 --batch 64 --shape llama-3.1-8b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import trace_replay as tr
from trace_replay.runs.cluster import RayCluster
from trace_replay.runs.parts import PART_NAME


def bundled_traces(count: int, length: int) -> list[dict]:
    """``count`` token-id traces of ``length`` tokens from the bundled ones (repeated under
    new ids when there are fewer)."""
    from trace_replay import datasets
    from trace_replay.models.load import load_tokenizer

    traces = [
        t for t in datasets.load().tokenize(load_tokenizer()) if len(t.trace_token_ids) >= length
    ]
    return [
        {
            "id": f"x{i}",
            "prompt_token_ids": list(traces[i % len(traces)].prompt_token_ids),
            "trace_token_ids": list(traces[i % len(traces)].trace_token_ids[:length]),
        }
        for i in range(count)
    ]


def random_traces(count: int, length: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(count * 7919 + length)
    return [
        {
            "id": f"x{i}",
            "prompt_token_ids": torch.randint(3, vocab, (16,), generator=gen).tolist(),
            "trace_token_ids": torch.randint(3, vocab, (length,), generator=gen).tolist(),
        }
        for i in range(count)
    ]


def shape_folder(shape: str, device: str) -> tuple[str, int]:
    """A random-weight model of ``shape`` (bfloat16 on CUDA, float32 on the CPU) saved with
    a byte-level tokenizer; the ids traces may use (the tokenizer's 256)."""
    from bench_vllm_gpu import add_byte_tokenizer
    from shapes import saved_random_model

    folder, _ = saved_random_model(shape, device)
    add_byte_tokenizer(folder)
    return folder, 256


def timed(
    traces: list[dict], options: dict, cluster: RayCluster | None
) -> tuple[float, float | None]:
    """One end-to-end run into a fresh checkpoint folder: its seconds, and its steady rate
    (:func:`steady_rate`)."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        df = tr.replay(
            traces, **options, progress=False, checkpoint=Path(folder) / "c", cluster=cluster
        )
        seconds = time.perf_counter() - start
        rate = steady_rate(Path(folder) / "c", (cluster.actors or 1) if cluster else 1)
    assert df["trace_id"].nunique() == len(traces)
    return seconds, rate


def steady_rate(checkpoint: Path, writers: int = 1) -> float | None:
    """Traces/s while a run wrote its parts: the traces of the parts after the first
    ``writers`` over the time from the ``writers``-th part's write to the last's (a part's
    name holds its write time in ns). Start-up before the first parts (engine starts, Ray's
    pool) and the final read after the last are outside it. With one writer (one process or
    one actor) it is exact; with N actors the N first parts stand in for each actor's first,
    which they are only when the actors keep pace. ``None`` with too few parts."""
    import pyarrow.parquet as pq

    parts = sorted(
        (int(match["ns"]), path)
        for path in checkpoint.rglob("part-*")
        if (match := PART_NAME.match(path.name))
    )
    if len(parts) <= writers:
        return None
    traces = sum(
        len(pq.read_table(path, columns=["trace_id"]).column(0).unique())
        for _, path in parts[writers:]
    )
    return traces / ((parts[-1][0] - parts[writers - 1][0]) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--actors", default="1,2", help="actor counts, comma-separated")
    parser.add_argument("--traces", type=int, default=32, help="traces of the large run")
    parser.add_argument(
        "--small",
        type=int,
        default=8,
        help="traces of the small run (0: no "
        "small run, so no marginal rate; the steady rate alone)",
    )
    parser.add_argument("--length", type=int, default=32, help="trace tokens per trace")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="traces per engine call "
        "and at most per part (default: replay's, 4 x batch); smaller gives the "
        "steady rate more parts",
    )
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--model", default=None, help="model folder (default: embedded)")
    parser.add_argument("--shape", default=None, help="random-weight model of this shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--address",
        default=None,
        help="a running cluster (default: a new local one with every CPU and GPU of this machine)",
    )
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    model, vocab = args.model, None
    if args.shape:
        model, vocab = shape_folder(args.shape, args.device)
    options = {
        "engine": args.engine,
        "model": model,
        "device": args.device,
        "batch_size": args.batch,
        "dtype": args.dtype,
        "chunk_size": args.chunk_size,
    }
    large = (
        random_traces(args.traces, args.length, vocab)
        if vocab
        else bundled_traces(args.traces, args.length)
    )
    sizes = ({"small": large[: args.small]} if args.small else {}) | {"large": large}
    gpu = args.device == "cuda"
    configs = {"single process": None} | {
        f"ray, {n} actor{'s' if n > 1 else ''}": RayCluster(actors=n, num_gpus=1 if gpu else 0)
        for n in map(int, args.actors.split(","))
    }
    if not gpu:
        torch.set_num_threads(1)  # the single-process run's threads: one, as each actor's
    ray.init(
        address=args.address or "local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    # the single-process run keeps the engine it starts (engine by name): start it untimed,
    # so its every timed run is warm, as each Ray run's actors are after their own start
    timed(large[: args.small or args.batch], options, None)
    seconds = {(c, s): [] for c in configs for s in sizes}
    steady = {c: [] for c in configs}  # the large run's steady rate, per round
    for round_ in range(args.repeats):
        names = list(configs)
        names = names[round_ % len(names) :] + names[: round_ % len(names)]  # no run always first
        for name in names:
            cluster = configs[name]
            for size, traces in sizes.items():
                run_seconds, rate = timed(traces, options, cluster)
                seconds[name, size].append(run_seconds)
                if size == "large":
                    steady[name].append(rate)
                print(
                    f"  round {round_}: {name}, {len(traces)} traces: {run_seconds:.1f} s"
                    + (f", steady {rate:.2f} traces/s" if rate else ""),
                    flush=True,
                )
    ray.shutdown()
    device = torch.cuda.get_device_name() if gpu else f"{platform.machine()} CPU"
    print(
        f"\n{dt.date.today()} · {device}, {os.cpu_count()} cores · "
        f"torch {torch.__version__} · ray {ray.__version__} · {args.engine} engine, batch "
        f"{args.batch} · {args.small} and {args.traces} traces × {args.length} tokens · "
        f"median of {args.repeats}"
    )
    print(
        "\n| run | s, small | s, large | marginal traces/s | × single process "
        "| steady traces/s | × single process, steady (per round) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    base = None
    for name in configs:
        big = statistics.median(seconds[name, "large"])
        small = statistics.median(seconds[name, "small"]) if args.small else None
        rate = (args.traces - args.small) / (big - small) if args.small else None
        base = base or rate
        rounds = [
            r / b if r and b else None for r, b in zip(steady[name], steady["single process"])
        ]
        known = [r for r in rounds if r is not None]
        median = f"{statistics.median(known):.2f}" if known else "–"
        each = ", ".join("–" if r is None else f"{r:.2f}" for r in rounds)
        rates = [r for r in steady[name] if r]
        steady_median = f"{statistics.median(rates):.2f}" if rates else "–"
        marginal = f"{rate:.2f} | {rate / base:.2f}" if rate else "– | –"
        print(
            f"| {name} | {f'{small:.1f}' if small else '–'} | {big:.1f} | {marginal} "
            f"| {steady_median} | {median} ({each}) |"
        )


if __name__ == "__main__":
    main()
