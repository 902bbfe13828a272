"""Replay throughput: the built-in engine against plain decoding and HF ``generate``.

All rows come from one run on one machine, so the ratios compare like with like:
same model (the embedded SmolLM2-135M-Instruct), dtype, batch, prompt and trace lengths.

* ``hf-generate+forcing`` — transformers ``generate`` (greedy, KV cache) with a logits
  processor that forces the trace, scores returned: the usual way to replay with HF.
* ``torch[B] greedy``  — the built-in loop on backend B decoding freely (no trace),
  logprobs kept.
* ``torch[B] replay``  — the built-in loop replaying the trace step by step.
* ``torch[B] verify(trace, k)`` — the verify path, drafts taken from the trace.
* ``prefill``       — teacher-forced scoring of the same traces.

Backends (``--backends``): ``hf`` (transformers forward, growing cache) and ``static``
(the model's own forward over a static KV cache; compiled CUDA graphs on GPU). "× greedy"
divides by greedy on the same backend. "HBM bound" is the least time of the decode steps
when every weight and every row's keys and values are read once per step at
``--bandwidth`` (4.8 TB/s: the H200's), over the measured time. On CUDA the host
synchronizations of one full replay are counted and the start-up cost of compiling and
capturing is printed; ``--profile`` adds, per backend, a torch.profiler table of one
replay's kernels per decode step; ``--fidelity`` compares every replay's logprobs with a
float64 teacher-forced forward of the same model; ``--host-profile`` prints a cProfile of one
run per engine.

The paths run interleaved, one run each per round (``--repeats`` rounds), and every ratio
is the median over rounds of the ratio within a round, with its range: on the H200 a path
moved by up to 20% between runs minutes apart, more than the effects measured here.

``--shape`` replaces the embedded model by random weights of a published shape
(``smollm2-135m``, ``llama-3.1-8b``, ``qwen2.5-7b``; see ``shapes.py``) and the prompts by
``--prompt-len`` random token ids: speed does not depend on weight values.

Usage::

    python benchmarks/bench_replay.py --device cpu --batch 8 --new-tokens 64
    python benchmarks/bench_replay.py --device cuda --batch 64 --new-tokens 128 --backends hf,static
    python benchmarks/bench_replay.py --shape llama-3.1-8b --dtype bfloat16 --batch 1,16,64 \
        --backends static --k 0
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time
import warnings

import torch
from shapes import SHAPES, hbm_bound_seconds, random_model

from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest
from trace_replay.models.load import load_model, load_tokenizer, resolve_dtype

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about the sea.",
    "Q: What is 17 * 23?\nA:",
    "import numpy as np\n\n",
    "Once upon a time,",
    "The three laws of motion are",
    "SELECT name FROM users WHERE",
]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_rounds(fns, device, repeats):
    """Seconds of each of ``fns`` per round, ``repeats`` rounds, the paths interleaved.

    Every path runs once per round (the order rotating from round to round), so a drift of
    the machine — clocks, another tenant, the allocator — lands on all paths alike and the
    ratio of two paths within a round is what the tables report (median over rounds).
    """
    for fn in fns:
        fn()  # warm-up: compiles and captures
    times = [[] for _ in fns]
    for round_ in range(repeats):
        order = list(range(len(fns)))
        order = order[round_ % len(fns) :] + order[: round_ % len(fns)]
        for i in order:
            _sync(device)
            start = time.perf_counter()
            fns[i]()
            _sync(device)
            times[i].append(time.perf_counter() - start)
    return times


def paired(numerator, denominator):
    """Median and range over rounds of ``numerator[r] / denominator[r]``."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return statistics.median(ratios), min(ratios), max(ratios)


def host_profile(run, label, top=14):
    """cProfile of one ``run()`` (after the timed rounds): where the host's time goes."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    run()
    torch.cuda.synchronize()
    profiler.disable()
    wall = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    body = lines[next(i for i, line in enumerate(lines) if "ncalls" in line) :]
    return "\n".join(
        [
            f"{label}: host profile of one run ({wall * 1e3:.1f} ms wall under "
            "cProfile), top functions by cumulative time:",
            *body,
        ]
    )


def hf_generate_forcing(lm, prompts, traces, pad_id):
    """transformers generate, greedy, with a processor forcing each row's trace."""
    from transformers import LogitsProcessor, LogitsProcessorList

    width = max(len(p) for p in prompts)
    device = lm.device
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    forced = torch.tensor(traces, device=device)

    class Force(LogitsProcessor):
        def __call__(self, ids, scores):
            step = ids.shape[1] - width
            keep = forced[:, step]
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, keep[:, None], 0.0)

    def run():
        out = lm.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=forced.shape[1],
            min_new_tokens=forced.shape[1],
            do_sample=False,
            logits_processor=LogitsProcessorList([Force()]),
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad_id,
        )
        # logprob and rank of the forced token from the raw logits, as replay reports them
        logits = torch.stack(out.logits, 1).float()
        logprobs = torch.log_softmax(logits, -1)
        lp = logprobs.gather(2, forced[:, :, None])
        return (logprobs > lp).sum(-1)

    return run


def profile_replay(engine, requests, device, prompts=None, new_tokens=0):
    """Top kernels of one full replay (after a warm-up), per decode step, as a text table.

    With ``prompts``, the same engine's greedy ``generate`` is profiled first and both
    paths' kernel sums per step are printed against their wall time under the profiler:
    what replay adds on the device, and how much of a step is not kernel time.
    """
    from torch.profiler import ProfilerActivity, profile

    steps = max(r.trace_len for r in requests)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kind = "CUDA" if device.type == "cuda" else "CPU"  # kernels only: ops would count twice
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def kernels(run):
        run()  # warm-up: graph capture happens here
        _sync(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            run()
            _sync(device)
        ms = (time.perf_counter() - start) * 1e3
        events = sorted(
            (e for e in prof.key_averages() if e.device_type.name == kind),
            key=lambda e: getattr(e, key),
            reverse=True,
        )
        return ms, events

    sums = []
    if prompts is not None:
        ms, events = kernels(lambda: engine.generate(prompts, max_tokens=new_tokens))
        sums.append(("greedy", ms, sum(getattr(e, key) for e in events)))
    ms, events = kernels(lambda: engine.run(requests))
    total = sum(getattr(e, key) for e in events) or 1
    sums.append(("replay", ms, total))
    per = "trace token" if "verify" in engine.settings()["engine_path"] else "step"
    lines = [
        f"{engine.settings()['engine_path']}: one replay ({steps} trace tokens + prefill) "
        f"in {ms:.1f} ms under the profiler; kernels per {per} (device time):",
        "| kernel | µs/step | calls/step | share |",
        "|---|---:|---:|---:|",
    ]
    for e in events[:25]:
        lines.append(
            f"| {e.key[:70]} | {getattr(e, key) / steps:.1f} | {e.count / steps:.1f} | "
            f"{getattr(e, key) / total:.1%} |"
        )
    lines.append(f"(all kernels: {total / steps:.0f} µs per {per})")
    if len(sums) > 1:
        lines += [
            "",
            "Kernel time against wall time under the profiler, per step:",
            "| path | kernels µs/step | wall µs/step | kernels / wall |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {path} | {busy / steps:.0f} | {wall * 1e3 / steps:.0f} | "
            f"{busy / (wall * 1e3):.0%} |"
            for path, wall, busy in sums
        ]
    return "\n".join(lines)


def phases(engine, run, label):
    """Wall ms of one ``run()`` split into admission, prefill, results and the rest (the
    decode loop), each phase fenced by device synchronizations (so nothing overlaps)."""
    import trace_replay.engines.builtin.engine as torch_engine

    spent = dict.fromkeys(("admit", "prefill", "results"), 0.0)

    def fenced(name, fn):
        def call(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            return out

        return call

    patches = [(engine.slots, "admit"), (engine.backend, "prefill"), (torch_engine, "wave_results")]
    saved = [getattr(obj, name) for obj, name in patches]
    for (obj, name), fn, phase in zip(patches, saved, spent):
        setattr(obj, name, fenced(phase, fn))
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    finally:
        for (obj, name), fn in zip(patches, saved):
            if obj is torch_engine:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # back to the class's method
    loop = total - sum(spent.values())
    return (
        f"{label}: phases of one run, ms (fenced): "
        + ", ".join(f"{name} {value * 1e3:.1f}" for name, value in spent.items())
        + f", decode loop {loop * 1e3:.1f}, total {total * 1e3:.1f}"
    )


def count_syncs(engine, requests, device):
    """Host synchronizations in one full replay (CUDA sync debug mode warnings)."""
    if device.type != "cuda":
        return None
    engine.run(requests)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.run(requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def float64_logprobs(lm, requests):
    """Teacher-forced float64 logprob of every trace token (one forward per request)."""
    import copy

    lm64 = copy.deepcopy(lm).double()
    out = {}
    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor(
                [list(r.prompt_token_ids) + list(r.trace_token_ids)],
                device=next(lm64.parameters()).device,
            )
            logits = lm64(input_ids=ids).logits[0, r.prompt_len - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, r.prompt_len :, None])
            out[r.trace_id] = lp[:, 0].cpu().numpy()
    return out


def max_abs_delta(results, reference):
    return max(float(abs(res.logprob - reference[res.trace_id]).max()) for res in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="embedded", choices=["embedded", *SHAPES])
    parser.add_argument("--prompt-len", type=int, default=16, help="random prompts (--shape)")
    parser.add_argument("--batch", default="8", help="batch size, or several: 1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=8, help="drafts per verify step (0: none)")
    parser.add_argument("--skip-hf", action="store_true", help="skip hf-generate+forcing")
    parser.add_argument(
        "--backends",
        default="hf,static",
        help="torch engine backends; static:ieee = float32 without tensor cores",
    )
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s")
    parser.add_argument(
        "--topk-chunk",
        type=int,
        default=None,
        help="first-pass chunk of the top-k kernel (default: its CHUNK)",
    )
    parser.add_argument(
        "--topk-group",
        type=int,
        default=None,
        help="chunks per first-pass program of the top-k kernel",
    )
    parser.add_argument(
        "--topk-warps",
        type=int,
        default=None,
        help="warps of the top-k kernel's first pass (default: its NUM_WARPS)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="kernel table of one replay per backend"
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="per engine (CUDA): phases of one run, and its cProfile",
    )
    parser.add_argument(
        "--fidelity", action="store_true", help="max |Δ logprob| of each replay against float64"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.topk_chunk or args.topk_group or args.topk_warps:  # module defaults, read per call
        from trace_replay.kernels import top_k

        top_k.CHUNK = args.topk_chunk or top_k.CHUNK
        top_k.GROUP = args.topk_group or top_k.GROUP
        top_k.NUM_WARPS = args.topk_warps or top_k.NUM_WARPS
        print(f"top-k kernel: chunk {top_k.CHUNK}, group {top_k.GROUP}, {top_k.NUM_WARPS} warps")
    if args.shape == "embedded":
        lm = load_model(dtype=args.dtype, device=device)
    else:
        lm = random_model(args.shape, resolve_dtype(args.dtype), device)
    for batch in map(int, args.batch.split(",")):
        run_batch(lm, args, batch, device)


def engine_options(spec: str) -> dict:
    """``static`` or ``static:ieee`` (a backend and the float32 matmul) as engine options."""
    backend, _, matmul = spec.partition(":")
    return {"backend": backend, "float32_matmul": matmul or "3xtf32"}


def run_batch(lm, args, batch, device):
    """Every path of the table at one batch size; prints the table."""
    if args.shape == "embedded":
        tok = load_tokenizer()
        prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    else:
        gen = torch.Generator().manual_seed(batch)
        prompts = [
            torch.randint(3, lm.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]
    backends = args.backends.split(",")
    greedy = make_engine("torch", lm, batch_size=batch, **engine_options(backends[0]))
    generated = greedy.generate(prompts, max_tokens=args.new_tokens)  # no EOS stop: fixed length
    compiled = getattr(greedy.backend, "cuda_graphs", False)
    first_compile = greedy.backend.compile_seconds if compiled else None
    del greedy
    traces = [ids for ids, _ in generated]
    requests = [
        ReplayRequest(str(i), tuple(p), tuple(t)) for i, (p, t) in enumerate(zip(prompts, traces))
    ]
    tokens = sum(len(t) for t in traces)
    bound = hbm_bound_seconds(
        lm, batch, sum(map(len, prompts)) / len(prompts), args.new_tokens, args.bandwidth
    )
    reference = float64_logprobs(lm, requests) if args.fidelity else None

    notes = []
    if first_compile is not None:
        from torch._dynamo.utils import counters

        notes.append(
            f"torch[{backends[0]}] first decode shape: compile + capture "
            f"{first_compile:.1f} s; dynamo graphs so far "
            f"{counters['stats']['unique_graphs']}"
        )

    paths = []  # (name, backend spec, fn)
    if not args.skip_hf:
        paths.append(("hf-generate+forcing", "–", hf_generate_forcing(lm, prompts, traces, 0)))
    engines = {}  # backend spec -> {what: engine}
    for backend in backends:
        engine = make_engine("torch", lm, batch_size=batch, **engine_options(backend))
        label = f"torch[{engine.backend.name}]"
        engines[backend] = {"replay": engine}
        paths.append(
            (
                f"{label} greedy (no trace)",
                backend,
                lambda e=engine: e.generate(prompts, max_tokens=args.new_tokens),
            )
        )
        paths.append((f"{label} replay", backend, lambda e=engine: e.run(requests)))
        if args.k:
            verify = make_engine(
                "torch",
                lm,
                batch_size=batch,
                **engine_options(backend),
                speculative={"method": "trace", "num_tokens": args.k},
            )
            engines[backend][f"verify(trace, k={args.k})"] = verify
            paths.append(
                (f"{label} verify(trace, k={args.k})", backend, lambda e=verify: e.run(requests))
            )
    if args.shape == "embedded":
        prefill = make_engine("prefill", lm, batch_size=batch)
        paths.append(("prefill (teacher-forced)", "–", lambda: prefill.run(requests)))
    times = timed_rounds([fn for _, _, fn in paths], device, args.repeats)
    for (name, _, _), seconds in zip(paths, times):
        print(f"  {name}: " + " ".join(f"{s:.3f}" for s in seconds) + " s", flush=True)

    profiles, syncs = [], {}
    for backend, of_backend in engines.items():
        label = f"torch[{of_backend['replay'].backend.name}]"
        for what, e in of_backend.items():
            if getattr(e.backend, "cuda_graphs", False):
                notes.append(
                    f"{label} {what}: compile + capture {e.backend.compile_seconds:.1f} s"
                    " at start-up"
                )
            if reference is not None:
                notes.append(
                    f"{label} {what}: max |Δ logprob| vs float64 "
                    f"{max_abs_delta(e.run(requests), reference):.2e}"
                )
            if args.host_profile and device.type == "cuda":
                notes.append(phases(e, lambda e=e: e.run(requests), f"{label} {what}"))
                if what == "replay":
                    notes.append(
                        phases(
                            e,
                            lambda e=e: e.generate(prompts, max_tokens=args.new_tokens),
                            f"{label} greedy",
                        )
                    )
                profiles.append(host_profile(lambda e=e: e.run(requests), f"{label} {what}"))
        engine = of_backend["replay"]
        syncs[label] = count_syncs(engine, requests, device)
        if args.profile:
            profiles.append(profile_replay(engine, requests, device, prompts, args.new_tokens))
            if args.k:  # the verify forward: where its time goes against k + 1 single steps
                profiles.append(
                    profile_replay(of_backend[f"verify(trace, k={args.k})"], requests, device)
                )
    del engines

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"\n{dt.date.today()} · {name or platform.machine()} · torch {torch.__version__} · "
        f"{args.shape} · {args.dtype} · batch {batch} · {args.new_tokens} trace tokens/row"
        f" · {args.repeats} interleaved rounds · HBM bound {bound * 1e3 / args.new_tokens:.2f} ms/step"
    )
    by_name = {name: (backend, seconds) for (name, backend, _), seconds in zip(paths, times)}
    greedy = {b: seconds for name, (b, seconds) in by_name.items() if "greedy" in name}
    replay = {b: seconds for name, (b, seconds) in by_name.items() if name.endswith(" replay")}
    hf = by_name.get("hf-generate+forcing", (None, None))[1]
    print("\nRatios are medians over rounds of the ratio within a round (min–max over rounds).")
    print(
        "\n| path | median s | ms/step | tokens/s | × hf-generate+forcing | "
        "× greedy (same backend) | HBM bound / time |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (backend, seconds) in by_name.items():
        median = statistics.median(seconds)
        vs_hf = _ratio(hf, seconds) if hf and name != "hf-generate+forcing" else "–"
        if "verify" in name:  # against step-by-step replay, the verify target's ratio
            vs_greedy = _ratio(greedy[backend], seconds)
            vs_greedy += f"; × replay {_ratio(replay[backend], seconds)}"
        else:
            vs_greedy = _ratio(greedy[backend], seconds) if backend in greedy else "–"
        stepwise = "verify" not in name and "prefill" not in name
        step_ms = f"{median * 1e3 / args.new_tokens:.2f}" if stepwise else "–"
        of_bound = f"{bound / median:.0%}" if stepwise else "–"
        print(
            f"| {name} | {median:.3f} | {step_ms} | {tokens / median:,.0f} | {vs_hf} | "
            f"{vs_greedy} | {of_bound} |"
        )
    if device.type == "cuda":
        print(
            "\nHost synchronizations in one full replay (CUDA sync debug mode): "
            + ", ".join(f"{label} {n}" for label, n in syncs.items())
        )
    for note in notes:
        print(note)
    for table in profiles:
        print("\n" + table)
    print(flush=True)


def _ratio(baseline, seconds):
    """ "median (min–max)" of ``baseline / seconds`` over rounds: × the baseline's speed."""
    mid, low, high = paired(baseline, seconds)
    return f"{mid:.2f} ({low:.2f}–{high:.2f})"


if __name__ == "__main__":
    main()
