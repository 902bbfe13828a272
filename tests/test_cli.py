"""The trace-replay command line: results on disk, one-line errors, exit codes."""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import trace_replay
from trace_replay.cli import _HelpFormatter, _parser, main
from trace_replay.runs.replay import replay

COMMANDS = ("replay", "record", "merge", "report", "demo", "serve")


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "trace_replay.cli", *args], capture_output=True, text=True
    )


def test_bad_trace_file_is_one_line_error(tmp_path):
    """A malformed JSONL line gives one error line naming file and line, exit 2, no traceback."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "completion": "y"}\n{not json\n')
    out = _run("replay", str(path), "--engine", "prefill", "--out", str(tmp_path / "r.parquet"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"{path}:2" in out.stderr and out.stderr.count("\n") == 1


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_commands_help_shows_every_option_with_its_default():
    """Every option of every command has help stating its default (flags are off unless
    given; required options say so), and each help page ends with examples."""
    for name, parser in _subparsers().items():
        page = parser.format_help()  # what --help prints
        assert "examples:\n  trace-replay " + name in page, name
        formatter = _HelpFormatter(prog="trace-replay")
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.option_strings[-1] in page, (name, action.dest)
            if isinstance(action, argparse._StoreTrueAction) or action.required:
                assert action.help, (name, action.dest)
                continue
            text = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in text, (name, action.dest, text)
    assert set(_subparsers()) == set(COMMANDS)


def _printed(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_and_version(capsys):
    """--help lists the commands in plain text (no reST) with examples; --version prints it."""
    page = _printed(["--help"], capsys)
    assert all(name in page for name in COMMANDS) and "examples:" in page
    assert "``" not in page and ":func:" not in page
    assert _printed(["--version"], capsys).strip() == f"trace-replay {trace_replay.__version__}"


def test_record_takes_the_engine_options():
    """record accepts --top-k, --batch-size, --engine-arg and --verbose like replay."""
    args = _parser().parse_args(
        [
            "record",
            "p.txt",
            "--out",
            "t.jsonl",
            "--max-tokens",
            "8",
            "--top-k",
            "3",
            "--batch-size",
            "2",
            "--engine-arg",
            "max_model_len=512",
            "--verbose",
        ]
    )
    assert (args.top_k, args.batch_size, args.engine_arg, args.verbose) == (
        3,
        2,
        [("max_model_len", 512)],
        True,
    )


@pytest.mark.parametrize(
    "command", [["report"], ["merge", "--out", "m.parquet"], ["replay", "--out", "r.parquet"]]
)
def test_missing_input_file_is_a_clear_error(tmp_path, command, capsys):
    """A missing input file gives one line saying which file does not exist, exit 2."""
    missing = str(tmp_path / "missing.parquet")
    assert main([command[0], missing, *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "command", [["report"], ["merge", "--out", "m.parquet"], ["replay", "--out", "r.parquet"]]
)
def test_a_fifo_as_input_is_named_not_missing(tmp_path, command, capsys):
    """An input that is a FIFO: one line saying it is not a regular file (not that it does
    not exist), exit 2, without blocking on it."""
    fifo = tmp_path / "in.parquet"
    os.mkfifo(fifo)
    assert main([command[0], str(fifo), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{fifo} is not a regular file" in err and err.count("\n") == 1, err


HELLO = {"id": "a", "prompt": "Hello", "completion": " world"}


def _run_together(*commands, env=None):
    """Run CLI commands side by side (start-up dominates); their CompletedProcess-like results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "trace_replay.cli", *map(str, c)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for c in commands
    ]
    return [subprocess.CompletedProcess(c.args, c.wait(), *c.communicate()) for c in children]


def _assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("trace-replay: error: ")
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def _write_traces(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_arguments_fail_before_any_work(tmp_path):
    """Bad --batch-size/--top-k/--device/--shard/--out: one line, exit 2, nothing started."""
    traces = _write_traces(tmp_path / "t.jsonl", [HELLO])
    (tmp_path / "file").write_text("")
    cases = {
        "batch_size must be an integer >= 1": ["--batch-size", "-1"],
        "top_k must be an integer >= 0": ["--top-k", "-1"],
        "shard must be (index, count) with 0 <= index < count": ["--shard", "2/2"],
        "is a folder": ["--out", tmp_path],
        "is a file, not a folder": ["--out", tmp_path / "file" / "r.parquet"],
    }
    if not torch.cuda.is_available():
        cases["device 'cuda' is not available"] = ["--device", "cuda"]
    commands = [
        [
            "replay",
            traces,
            "--engine",
            "prefill",
            "--out",
            tmp_path / "r.parquet",
            "--checkpoint",
            tmp_path / f"ckpt{i}",
            "--quiet",
            *extra,
        ]
        for i, extra in enumerate(cases.values())
    ]
    for i, (message, result) in enumerate(zip(cases, _run_together(*commands))):
        _assert_one_line_error(result, message)
        assert not (tmp_path / f"ckpt{i}").exists()  # refused before the engine was built
    assert not (tmp_path / "r.parquet").exists()


def test_checkpoint_every_refuses_bad_seconds_naming_the_flag(capsys):
    """--checkpoint-every takes seconds >= 0: a negative, NaN or non-number value stops the
    parser with an error naming the flag (exit 2); its default is replay()'s."""
    base = ["replay", "t.jsonl", "--out", "r.parquet"]
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit) as done:
            _parser().parse_args([*base, "--checkpoint-every", bad])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --checkpoint-every: expected seconds >= 0, got '{bad}'" in err
    assert _parser().parse_args([*base, "--checkpoint-every", "0"]).checkpoint_every == 0.0
    default = inspect.signature(replay).parameters["checkpoint_every"].default
    assert _parser().parse_args(base).checkpoint_every == default


@pytest.mark.slow
def test_checkpoint_every_sets_how_often_parts_are_written(tmp_path):
    """--checkpoint-every 0 writes a part after every engine call (batch 1: one trace per
    part); a bound that never elapses leaves one part per --chunk-size traces."""
    traces = _write_traces(
        tmp_path / "t.jsonl",
        [
            {"id": f"t{i}", "prompt": "Hello", "completion": text}
            for i, text in enumerate([" world", " there", " again"])
        ],
    )
    for every, part_sizes in (("0", [1, 1, 1]), ("1e9", [3])):
        ckpt = tmp_path / f"ckpt{every}"
        assert (
            main(
                [
                    "replay",
                    str(traces),
                    "--engine",
                    "prefill",
                    "--batch-size",
                    "1",
                    "--chunk-size",
                    "4",
                    "--checkpoint",
                    str(ckpt),
                    "--checkpoint-every",
                    every,
                    "--quiet",
                    "--out",
                    str(tmp_path / f"r{every}.parquet"),
                ]
            )
            == 0
        )
        parts = [pd.read_parquet(p) for p in ckpt.glob("part-*.parquet")]
        assert sorted(part["trace_id"].nunique() for part in parts) == part_sizes, every
        assert sorted(pd.concat(parts)["trace_id"].unique()) == ["t0", "t1", "t2"]


def test_damaged_inputs_are_one_line_errors(tmp_path):
    """A truncated .jsonl.gz, non-UTF-8 bytes, a lone surrogate: one line naming file and
    line (and trace), exit 2, no traceback."""
    good = json.dumps(HELLO) + "\n"
    packed = gzip.compress(good.encode() * 300)
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(packed[: len(packed) // 2])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(good.encode() + b'{"id": "b", "prompt": "caf\xe9", "completion": "y"}\n')
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text(good + '{"id": "s", "prompt": "\\ud800", "completion": "y"}\n')
    results = _run_together(
        *[
            ["replay", path, "--engine", "prefill", "--quiet", "--out", tmp_path / "r.parquet"]
            for path in (truncated, latin, surrogate)
        ]
    )
    _assert_one_line_error(results[0], f"{truncated}:", "gzip data is damaged or truncated")
    _assert_one_line_error(results[1], f"{latin}:2: not UTF-8 text: byte 0xe9")
    _assert_one_line_error(results[2], f"{surrogate}:2: trace 's': prompt holds a lone surrogate")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_out_fails_before_any_work(tmp_path):
    """--out in a read-only folder is refused before the model is loaded."""
    traces = _write_traces(tmp_path / "t.jsonl", [HELLO])
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    [result] = _run_together(
        [
            "replay",
            traces,
            "--engine",
            "prefill",
            "--quiet",
            "--out",
            locked / "r.parquet",
            "--checkpoint",
            tmp_path / "ckpt",
        ]
    )
    _assert_one_line_error(result, "cannot be written")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_empty_input_empty_shard_and_overflow(tmp_path):
    """Empty input: an error. Empty shard: an empty result, said so. Too long: file:line, id."""
    from trace_replay.traces.sets import _shard_of

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    one = _write_traces(tmp_path / "one.jsonl", [HELLO])
    empty_shard = 1 - _shard_of("a", 2)
    big = _write_traces(
        tmp_path / "big.jsonl",
        [HELLO, {"id": "big", "prompt": "x", "trace_token_ids": [28] * 9000}],
    )
    common = ["--engine", "prefill", "--quiet"]
    results = _run_together(
        [
            "replay",
            blank,
            *common,
            "--out",
            tmp_path / "b.parquet",
            "--checkpoint",
            tmp_path / "c1",
        ],
        [
            "replay",
            one,
            *common,
            "--out",
            tmp_path / "s.parquet",
            "--checkpoint",
            tmp_path / "c2",
            "--shard",
            f"{empty_shard}/2",
        ],
        ["replay", big, *common, "--out", tmp_path / "o.parquet"],
    )
    _assert_one_line_error(results[0], f"{blank}: no traces")
    shard = results[1]
    assert shard.returncode == 0, shard.stderr
    assert f"warning: shard {empty_shard}/2 holds none of the 1 trace of" in shard.stderr
    assert "empty on purpose" in shard.stderr and "Traceback" not in shard.stderr
    empty = pd.read_parquet(tmp_path / "s.parquet")
    assert len(empty) == 0 and {"trace_id", "step", "logprob", "rank"} <= set(empty.columns)
    _assert_one_line_error(results[2], f"{big}:2", "trace 'big'", "--truncate")


@pytest.mark.slow
def test_ctrl_c_and_sigterm_keep_finished_traces(tmp_path):
    """SIGINT / SIGTERM mid-run: one line, exit 130 / 143, finished traces saved; a rerun
    resumes from them. Three SIGTERMs in a row stop it as one does: no traceback, 143."""
    traces = _write_traces(
        tmp_path / "t.jsonl",
        [
            {"id": f"t{i}", "prompt": "Count:", "completion": " one two three four five six"}
            for i in range(200)
        ],
    )
    runs = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        ckpt = tmp_path / f"ckpt{int(signum)}"
        args = [
            "replay",
            str(traces),
            "--engine",
            "prefill",
            "--batch-size",
            "1",
            "--quiet",
            "--checkpoint",
            str(ckpt),
            "--out",
            str(tmp_path / f"r{int(signum)}.parquet"),
        ]
        # SIGINT at its default in the child, whatever this process has it at (a shell running
        # the suite in the background, or a library under test, may leave it ignored: then
        # Python never raises KeyboardInterrupt and the child runs to the end)
        runs[signum] = (
            ckpt,
            args,
            subprocess.Popen(
                [sys.executable, "-m", "trace_replay.cli", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            ),
        )
    # each child is signalled as soon as its first part exists (polled together: a child
    # left waiting while the other is watched could finish all 200 traces)
    deadline, waiting = time.monotonic() + 300, dict(runs)
    while waiting:
        assert time.monotonic() < deadline
        for signum, (ckpt, _, child) in list(waiting.items()):
            if list(ckpt.glob("part-*.parquet")) or child.poll() is not None:
                for _ in range(3 if signum == signal.SIGTERM else 1):
                    child.send_signal(signum)  # later ones land while it saves and exits
                    time.sleep(0.01)
                del waiting[signum]
        time.sleep(0.02)
    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        ckpt, args, child = runs[signum]
        _, stderr = child.communicate()
        assert child.returncode == status, stderr
        assert "Traceback" not in stderr
        assert stderr.splitlines()[-1] == (
            f"trace-replay: interrupted; finished traces are saved in {ckpt}, rerun to resume"
        )
        saved = pd.concat(pd.read_parquet(p) for p in ckpt.glob("part-*.parquet"))
        assert 1 <= saved["trace_id"].nunique() < 200
        assert not Path(args[-1]).exists() and not list(ckpt.glob(".*.tmp"))
    ckpt, args, _ = runs[signal.SIGINT]
    assert main(args) == 0
    df = pd.read_parquet(args[-1])
    assert df["trace_id"].nunique() == 200 and not df.duplicated(["trace_id", "step"]).any()
    saved = pd.concat(pd.read_parquet(p) for p in ckpt.glob("part-*.parquet"))
    assert df.attrs["resumed_traces"] > 0
    assert saved["trace_id"].nunique() == 200 and not saved.duplicated(["trace_id", "step"]).any()


@pytest.mark.slow
def test_replay_then_merge_and_report(tmp_path):
    """replay writes Parquet with provenance; shards merge; report writes HTML."""
    traces = tmp_path / "t.jsonl"
    traces.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "prompt": "The capital of France is", "completion": " Paris."},
                {"id": "b", "prompt": "1, 2, 3,", "completion": " 4, 5"},
                {"id": "c", "prompt": "Hello", "completion": " world"},
            ]
        )
        + "\n"
    )
    outs = []
    for i in range(2):
        out = tmp_path / f"s{i}.parquet"
        assert (
            main(
                [
                    "replay",
                    str(traces),
                    "--engine",
                    "prefill",
                    "--shard",
                    f"{i}/2",
                    "--out",
                    str(out),
                    "--quiet",
                ]
            )
            == 0
        )
        outs.append(out)
    merged = tmp_path / "all.parquet"
    assert main(["merge", *map(str, outs), "--out", str(merged)]) == 0
    df = pd.read_parquet(merged)
    assert sorted(df["trace_id"].unique()) == ["a", "b", "c"]
    assert df.attrs.get("engine") == "prefill"
    # provenance of the whole, not of the first shard
    assert df.attrs["num_traces"] == 3 and df.attrs["shard"] is None
    assert df.attrs["merged_from"] == [str(p) for p in outs]
    assert main(["report", str(merged), "--out", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").read_text().lower().startswith("<!doctype html>")


def test_serve_dry_run_prints_the_command(capsys):
    """serve --dry-run prints the server command: the forcing processor, raw logprobs, and the
    options after -- last, so they win."""
    from trace_replay.engines.server.serve import FORCING_PROCESSOR

    assert main(["serve", "--port", "8123", "--dry-run", "--", "--max-model-len", "512"]) == 0
    command = capsys.readouterr().out.splitlines()[0].split()
    assert command[command.index("--logits-processors") + 1] == FORCING_PROCESSOR
    assert command[command.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert command[command.index("--port") + 1] == "8123"
    assert command[-2:] == ["--max-model-len", "512"]


def test_serve_help_shows_the_command():
    """serve --help shows the vllm serve command it runs, with every option it adds."""
    from trace_replay.engines.server.serve import serve_args

    out = _run("serve", "--help")
    assert out.returncode == 0
    assert "vllm serve MODEL_FOLDER" in out.stdout
    for option in serve_args("NAME"):
        assert option in out.stdout


@pytest.mark.slow
def test_replay_reads_openai_logs_and_chat_turns(tmp_path):
    """--format openai puts the logged logprobs in ref_logprob; --turns all labels every
    replayed token of a chat trace with its turn and role."""
    log = tmp_path / "log.jsonl"
    log.write_text(
        json.dumps(
            {
                "request": {"prompt": "The capital of France is", "max_tokens": 2, "logprobs": 1},
                "response": {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "text": " Paris.",
                            "finish_reason": "length",
                            "logprobs": {
                                "tokens": ["token_id:7042", "token_id:30"],
                                "token_logprobs": [-0.25, -1.5],
                                "top_logprobs": [{"token_id:7042": -0.25}, {"token_id:30": -1.5}],
                            },
                        }
                    ],
                },
            }
        )
        + "\n"
    )
    out = tmp_path / "log.parquet"
    assert (
        main(
            [
                "replay",
                str(log),
                "--format",
                "openai",
                "--engine",
                "prefill",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    assert pd.read_parquet(out)["ref_logprob"].tolist() == [-0.25, -1.5]

    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps(
            {
                "id": "c",
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"},
                    {"role": "assistant", "content": "Bye."},
                ],
            }
        )
        + "\n"
    )
    for turns, roles in (("last", {"assistant"}), ("all", {"assistant", "user", "template"})):
        out = tmp_path / f"chat-{turns}.parquet"
        assert (
            main(
                [
                    "replay",
                    str(chat),
                    "--turns",
                    turns,
                    "--engine",
                    "prefill",
                    "--out",
                    str(out),
                    "--quiet",
                ]
            )
            == 0
        )
        assert set(pd.read_parquet(out)["role"]) == roles


def _bad_traces(tmp_path):
    """A traces file whose second line is not JSON: a run that got past the --out check fails
    on it at once (so these tests stay fast on code that would not refuse)."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HELLO) + "\n{not json\n")
    return path


@pytest.mark.parametrize("command", ["replay", "record", "merge", "report"])
def test_out_that_is_a_fifo_or_a_link_to_one_is_refused(tmp_path, command, capsys):
    """--out a FIFO, or a symlink to one, is refused before any work with one line naming it;
    the FIFO and the link are left as they were."""
    source = _bad_traces(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to("fifo")
    extra = ["--max-tokens", "1"] if command == "record" else []
    for out in (fifo, tmp_path / "link"):
        assert main([command, str(source), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"trace-replay: error: --out {out}") and err.count("\n") == 1
        assert "is a FIFO, not a regular file" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (tmp_path / "link").is_symlink()


@pytest.mark.parametrize("command", ["replay", "record", "merge", "report"])
def test_out_that_is_the_input_is_refused(tmp_path, command, capsys, monkeypatch):
    """--out naming an input file, however spelled (relative, ./, a symlink, a hard link), is
    refused before any work; the input is unchanged."""
    monkeypatch.chdir(tmp_path)
    source = _bad_traces(tmp_path)
    before = source.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(source.name)
    os.link(source, tmp_path / "hard.jsonl")
    extra = ["--max-tokens", "1"] if command == "record" else []
    for out in ("t.jsonl", "./t.jsonl", "link.jsonl", "hard.jsonl"):
        assert main([command, "t.jsonl", "--out", out, *extra]) == 2
        err = capsys.readouterr().err
        assert "is the input file t.jsonl" in err and err.count("\n") == 1, err
    assert source.read_bytes() == before


def test_out_through_a_symlink_writes_its_target(tmp_path, make_replay):
    """--out a symlink to a regular file writes through it: the link stays, the target holds
    the result."""
    results = tmp_path / "r.parquet"
    make_replay(n_traces=1, n_steps=4, seed=0).to_parquet(results)
    target = tmp_path / "target.parquet"
    target.write_text("old")
    link = tmp_path / "link.parquet"
    link.symlink_to(target.name)
    assert main(["merge", str(results), "--out", str(link)]) == 0
    assert link.is_symlink() and len(pd.read_parquet(target)) == 4


@pytest.mark.slow
def test_sigterm_during_start_up_names_no_folder_and_leaves_none(tmp_path):
    """SIGTERM while the engine starts: exit 143 with 'interrupted' alone (no checkpoint holds
    anything yet, so none is named), and the folders the run created are gone."""
    traces = _write_traces(tmp_path / "t.jsonl", [HELLO])
    out_folder, ckpt = tmp_path / "new" / "out", tmp_path / "ckpt"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trace_replay.cli",
            "replay",
            str(traces),
            "--engine",
            "prefill",
            "--quiet",
            "--checkpoint",
            str(ckpt),
            "--out",
            str(out_folder / "r.parquet"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while not out_folder.exists():  # made by the --out check, after the handlers are set
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 143, stderr
    assert stderr.splitlines()[-1] == "trace-replay: interrupted", stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_interrupt_while_out_folders_are_made_leaves_none(tmp_path, monkeypatch, capsys):
    """Ctrl-C landing right after --out's folders are made (before the check returns) still
    removes them: they are recorded before they are made (a SIGTERM there once left one)."""
    from trace_replay import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.tempfile, "NamedTemporaryFile", interrupted)
    traces = _write_traces(tmp_path / "t.jsonl", [HELLO])
    out = tmp_path / "new" / "out" / "r.parquet"
    assert (
        main(
            [
                "replay",
                str(traces),
                "--engine",
                "prefill",
                "--out",
                str(out),
                "--checkpoint",
                str(tmp_path / "ckpt"),
            ]
        )
        == 130
    )
    assert capsys.readouterr().err.splitlines()[-1] == "trace-replay: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_failed_run_removes_only_the_empty_folders_it_made(tmp_path, capsys):
    """A run that fails removes the --out and --checkpoint folders it created and left empty;
    a folder that was there before stays, even empty."""
    before = tmp_path / "before"
    before.mkdir()
    out = before / "made" / "deeper" / "r.parquet"
    assert (
        main(
            [
                "replay",
                str(_bad_traces(tmp_path)),
                "--out",
                str(out),
                "--checkpoint",
                str(tmp_path / "ckpt" / "run"),
            ]
        )
        == 2
    )
    assert "malformed JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before", "t.jsonl"]
    assert list(before.iterdir()) == []


def test_report_says_which_folder_it_created(tmp_path, make_replay, capsys):
    """--out in a missing folder: the folder is created and the command says so."""
    results = tmp_path / "r.parquet"
    make_replay(n_traces=1, n_steps=4, seed=0).to_parquet(results)
    out = tmp_path / "new" / "pages" / "r.html"
    assert main(["report", str(results), "--out", str(out)]) == 0
    assert out.is_file()
    assert f"created folder {out.parent}" in capsys.readouterr().out.splitlines()


def test_argument_errors_are_one_line_with_the_usage_hint(capsys):
    """A missing or bad argument prints one line: the command, what is wrong, and where its
    usage is; exit 2."""
    for argv, problem in (
        (["replay"], "the following arguments are required: traces, --out"),
        (
            ["replay", "t.jsonl", "--out", "r.parquet", "--top-k", "x"],
            "argument --top-k: invalid int value: 'x'",
        ),
        (["nonsense"], "argument <command>: invalid choice: 'nonsense'"),
    ):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        command = "trace-replay replay" if argv[0] == "replay" else "trace-replay"
        assert err == f"{command}: error: {problem}{err.split(problem, 1)[1]}", err
        assert err.count("\n") == 1 and err.endswith(f"(see {command} --help)\n"), err


def test_replay_help_examples_name_inputs_that_exist():
    """Each replay example's input is a bundled dataset name or a placeholder file name (never
    a path in the source tree that does not exist), and the help says a file wins."""
    from trace_replay.datasets import DATASETS

    page = _subparsers()["replay"].format_help()
    inputs = re.findall(r"^  trace-replay replay (\S+)", page, re.M)
    assert inputs and inputs[0] in DATASETS
    assert all(name in DATASETS or "/" not in name for name in inputs), inputs
    assert "a file of that name wins" in " ".join(page.split())


def test_replay_takes_a_bundled_dataset_name_and_a_limit(tmp_path, monkeypatch, capsys):
    """A bundled dataset's name is read as that dataset (a file of that name wins) and
    --limit N keeps the first N traces."""
    from trace_replay import datasets

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.parquet"
    assert (
        main(
            [
                "replay",
                "humaneval",
                "--limit",
                "2",
                "--engine",
                "prefill",
                "--quiet",
                "--top-k",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert pd.read_parquet(out)["trace_id"].unique().tolist() == datasets.load("humaneval").ids[:2]
    assert capsys.readouterr().out.startswith("2 traces, ")
    _write_traces(tmp_path / "t.jsonl", [HELLO, {**HELLO, "id": "b"}])
    assert (
        main(
            [
                "replay",
                "t.jsonl",
                "--limit",
                "1",
                "--engine",
                "prefill",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert pd.read_parquet(out)["trace_id"].tolist() == ["a"]
    assert capsys.readouterr().out.startswith("1 trace, 1 token (")
    (tmp_path / "humaneval").write_text("")  # a file of the dataset's name is read instead
    assert main(["replay", "humaneval", "--engine", "prefill", "--out", str(out)]) == 2
    assert "humaneval: unknown trace file type" in capsys.readouterr().err


def test_limit_must_be_at_least_one(capsys):
    """--limit 0, a negative or a non-number stops the parser naming the flag (exit 2)."""
    for bad in ("0", "-3", "two"):
        with pytest.raises(SystemExit) as done:
            _parser().parse_args(["replay", "t.jsonl", "--out", "r.parquet", "--limit", bad])
        assert done.value.code == 2
        assert f"argument --limit: expected an integer >= 1, got '{bad}'" in capsys.readouterr().err


def test_a_bad_speculative_value_says_the_form_expected(capsys):
    """--speculative with a K that is no integer: one line saying the METHOD[:K] form and the
    value given (not argparse's 'invalid _speculative value'), exit 2."""
    with pytest.raises(SystemExit) as done:
        _parser().parse_args(
            ["replay", "t.jsonl", "--out", "r.parquet", "--speculative", "trace:x"]
        )
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative: expected METHOD[:K] like trace:8" in err, err
    assert "'trace:x'" in err and "_speculative" not in err and err.count("\n") == 1, err


def test_record_refuses_an_out_that_replay_cannot_read(tmp_path, capsys):
    """record --out x.txt (JSONL under a name replay refuses) stops before any model is
    loaded, one line naming the kinds replay reads; nothing is written."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hi\n")
    out = tmp_path / "x.txt"
    assert (
        main(["record", str(prompts), "--max-tokens", "1", "--engine", "torch", "--out", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert f"--out {out}: a traces file ends in .jsonl, .jsonl.gz, .parquet" in err, err
    assert err.count("\n") == 1 and not out.exists()


def test_record_max_tokens_must_be_at_least_one(capsys):
    """record --max-tokens 0 or negative stops the parser naming the flag (exit 2), before a
    model is loaded."""
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as done:
            _parser().parse_args(["record", "p.txt", "--out", "t.jsonl", "--max-tokens", bad])
        assert done.value.code == 2
        assert "argument --max-tokens: expected an integer >= 1" in capsys.readouterr().err


def test_out_over_a_bundled_dataset_it_reads_is_refused():
    """replay humaneval --out <the package file humaneval is read from> is refused before any
    work (the input, named by its dataset name, would be destroyed), the file untouched."""
    from trace_replay import cli, datasets

    target = datasets.files("humaneval")[0]
    before = Path(target).read_bytes()
    args = cli._parser().parse_args(["replay", "humaneval", "--out", target])
    with pytest.raises(ValueError, match=r"is the input file .*humaneval_human\.jsonl"):
        cli._prepare_outputs(args)
    assert Path(target).read_bytes() == before


def test_out_ending_with_a_slash_is_refused_before_work(tmp_path):
    """--out new/ (a folder's name) is refused before any work, and no folder or file is
    made (was a Parquet file named 'new')."""
    from trace_replay import cli

    args = cli._parser().parse_args(["replay", "humaneval", "--out", f"{tmp_path}/new/"])
    with pytest.raises(ValueError, match=r"^--out .*new/ ends with /, so it names a folder"):
        cli._prepare_outputs(args)
    assert os.listdir(tmp_path) == []


def test_a_folder_named_like_a_dataset_does_not_hide_it(tmp_path, monkeypatch, capsys):
    """replay humaneval --out humaneval/r.parquet makes a folder 'humaneval'; the next
    replay humaneval still reads the bundled dataset (only a file of that name wins)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").mkdir()
    assert (
        main(
            [
                "replay",
                "humaneval",
                "--limit",
                "1",
                "--engine",
                "prefill",
                "--quiet",
                "--top-k",
                "1",
                "--out",
                "humaneval/r.parquet",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert pd.read_parquet(tmp_path / "humaneval" / "r.parquet")["trace_id"].nunique() == 1


def test_ray_options_make_the_cluster_run(capsys, tmp_path):
    """--ray alone is a new local cluster, --ray ADDRESS that cluster, each with the actors'
    options; those options without --ray are one line naming them, exit 2, nothing run."""
    from trace_replay.cli import _cluster
    from trace_replay.runs.cluster import RayCluster

    def cluster(*flags):
        return _cluster(_parser().parse_args(["replay", "t.jsonl", "--out", "r.parquet", *flags]))

    assert cluster() is None
    assert cluster("--ray") == RayCluster()
    assert cluster(
        "--ray", "auto", "--actors", "3", "--cpus-per-actor", "2", "--gpus-per-actor", "1"
    ) == RayCluster("auto", 3, num_gpus=1, num_cpus=2)
    traces = _write_traces(tmp_path / "t.jsonl", [HELLO])
    assert (
        main(
            [
                "replay",
                str(traces),
                "--out",
                str(tmp_path / "r.parquet"),
                "--actors",
                "2",
                "--gpus-per-actor",
                "1",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        "trace-replay: error: --actors, --gpus-per-actor configure a Ray cluster run: add --ray\n"
    )
    assert not (tmp_path / "r.parquet").exists()


def test_a_damaged_model_folder_exits_2_naming_the_file(tmp_path, capsys):
    """A model folder whose model.safetensors was cut short: exit 2 and one line naming the
    file and what is wrong (it was "internal error: SafetensorError", exit 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()  # save_pretrained's progress bar
    traces = tmp_path / "t.jsonl"
    traces.write_text(
        json.dumps({"id": "t", "prompt_token_ids": [1, 2], "trace_token_ids": [3, 4]}) + "\n"
    )
    assert (
        main(
            [
                "replay",
                str(traces),
                "--engine",
                "torch",
                "--model",
                str(tmp_path / "model"),
                "--quiet",
                "--out",
                str(tmp_path / "r.parquet"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"trace-replay: error: model weight file {weights} is damaged: its tensors need "
        "18,624 bytes after the header but it holds 18,524: the file was cut short; copy or "
        "convert the model again"
    )
