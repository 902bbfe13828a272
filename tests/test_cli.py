"""The trace-replay command line: results on disk, one-line errors, exit codes."""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import trace_replay
from trace_replay.cli import _HelpFormatter, _parser, main
from trace_replay.replay import replay

COMMANDS = ("replay", "record", "merge", "report", "demo", "serve")


def _run(*args):
    return subprocess.run([sys.executable, "-m", "trace_replay.cli", *args],
                          capture_output=True, text=True)


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
    args = _parser().parse_args(["record", "p.txt", "--out", "t.jsonl", "--max-tokens", "8",
                                 "--top-k", "3", "--batch-size", "2", "--engine-arg",
                                 "max_model_len=512", "--verbose"])
    assert (args.top_k, args.batch_size, args.engine_arg, args.verbose) == \
        (3, 2, [("max_model_len", 512)], True)


@pytest.mark.parametrize("command", [["report"], ["merge", "--out", "m.parquet"],
                                     ["replay", "--out", "r.parquet"]])
def test_missing_input_file_is_a_clear_error(tmp_path, command, capsys):
    """A missing input file gives one line saying which file does not exist, exit 2."""
    missing = str(tmp_path / "missing.parquet")
    assert main([command[0], missing, *command[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and err.count("\n") == 1
HELLO = {"id": "a", "prompt": "Hello", "completion": " world"}


def _run_together(*commands, env=None):
    """Run CLI commands side by side (start-up dominates); their CompletedProcess-like results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    children = [subprocess.Popen([sys.executable, "-m", "trace_replay.cli", *map(str, c)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env) for c in commands]
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
    commands = [["replay", traces, "--engine", "prefill", "--out", tmp_path / "r.parquet",
                 "--checkpoint", tmp_path / f"ckpt{i}", "--quiet", *extra]
                for i, extra in enumerate(cases.values())]
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
    traces = _write_traces(tmp_path / "t.jsonl", [
        {"id": f"t{i}", "prompt": "Hello", "completion": text}
        for i, text in enumerate([" world", " there", " again"])])
    for every, part_sizes in (("0", [1, 1, 1]), ("1e9", [3])):
        ckpt = tmp_path / f"ckpt{every}"
        assert main(["replay", str(traces), "--engine", "prefill", "--batch-size", "1",
                     "--chunk-size", "4", "--checkpoint", str(ckpt), "--checkpoint-every",
                     every, "--quiet", "--out", str(tmp_path / f"r{every}.parquet")]) == 0
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
    results = _run_together(*[["replay", path, "--engine", "prefill", "--quiet", "--out",
                               tmp_path / "r.parquet"] for path in (truncated, latin, surrogate)])
    _assert_one_line_error(results[0], f"{truncated}:", "gzip data is damaged or truncated")
    _assert_one_line_error(results[1], f"{latin}:2: not UTF-8 text: byte 0xe9")
    _assert_one_line_error(results[2], f"{surrogate}:2: trace 's': prompt holds a lone surrogate")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_out_fails_before_any_work(tmp_path):
    """--out in a read-only folder is refused before the model is loaded."""
    traces = _write_traces(tmp_path / "t.jsonl", [HELLO])
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    [result] = _run_together(["replay", traces, "--engine", "prefill", "--quiet", "--out",
                              locked / "r.parquet", "--checkpoint", tmp_path / "ckpt"])
    _assert_one_line_error(result, "cannot be written")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_empty_input_empty_shard_and_overflow(tmp_path):
    """Empty input: an error. Empty shard: an empty result, said so. Too long: file:line, id."""
    from trace_replay.traces import _shard_of

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    one = _write_traces(tmp_path / "one.jsonl", [HELLO])
    empty_shard = 1 - _shard_of("a", 2)
    big = _write_traces(tmp_path / "big.jsonl", [
        HELLO,
        {"id": "big", "prompt": "x", "trace_token_ids": [28] * 9000}])
    common = ["--engine", "prefill", "--quiet"]
    results = _run_together(
        ["replay", blank, *common, "--out", tmp_path / "b.parquet",
         "--checkpoint", tmp_path / "c1"],
        ["replay", one, *common, "--out", tmp_path / "s.parquet", "--checkpoint", tmp_path / "c2",
         "--shard", f"{empty_shard}/2"],
        ["replay", big, *common, "--out", tmp_path / "o.parquet"])
    _assert_one_line_error(results[0], f"{blank}: no traces")
    shard = results[1]
    assert shard.returncode == 0, shard.stderr
    assert f"warning: shard {empty_shard}/2 holds none of the 1 traces" in shard.stderr
    assert "empty on purpose" in shard.stderr and "Traceback" not in shard.stderr
    empty = pd.read_parquet(tmp_path / "s.parquet")
    assert len(empty) == 0 and {"trace_id", "step", "logprob", "rank"} <= set(empty.columns)
    _assert_one_line_error(results[2], f"{big}:2", "trace 'big'", "--truncate")


@pytest.mark.slow
def test_ctrl_c_and_sigterm_keep_finished_traces(tmp_path):
    """SIGINT / SIGTERM mid-run: one line, exit 130 / 143, finished traces saved; a rerun
    resumes from them."""
    traces = _write_traces(tmp_path / "t.jsonl", [
        {"id": f"t{i}", "prompt": "Count:", "completion": " one two three four five six"}
        for i in range(200)])
    runs = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        ckpt = tmp_path / f"ckpt{int(signum)}"
        args = ["replay", str(traces), "--engine", "prefill", "--batch-size", "1", "--quiet",
                "--checkpoint", str(ckpt), "--out", str(tmp_path / f"r{int(signum)}.parquet")]
        # SIGINT at its default in the child, whatever this process has it at (a shell running
        # the suite in the background, or a library under test, may leave it ignored: then
        # Python never raises KeyboardInterrupt and the child runs to the end)
        runs[signum] = ckpt, args, subprocess.Popen(
            [sys.executable, "-m", "trace_replay.cli", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # each child is signalled as soon as its first part exists (polled together: a child
    # left waiting while the other is watched could finish all 200 traces)
    deadline, waiting = time.monotonic() + 300, dict(runs)
    while waiting:
        assert time.monotonic() < deadline
        for signum, (ckpt, _, child) in list(waiting.items()):
            if list(ckpt.glob("part-*.parquet")) or child.poll() is not None:
                child.send_signal(signum)
                del waiting[signum]
        time.sleep(0.02)
    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        ckpt, args, child = runs[signum]
        _, stderr = child.communicate()
        assert child.returncode == status, stderr
        assert "Traceback" not in stderr
        assert stderr.splitlines()[-1] == (f"trace-replay: interrupted; finished traces are "
                                           f"saved in {ckpt}, rerun to resume")
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
    traces.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "The capital of France is", "completion": " Paris."},
        {"id": "b", "prompt": "1, 2, 3,", "completion": " 4, 5"},
        {"id": "c", "prompt": "Hello", "completion": " world"}]) + "\n")
    outs = []
    for i in range(2):
        out = tmp_path / f"s{i}.parquet"
        assert main(["replay", str(traces), "--engine", "prefill", "--shard", f"{i}/2",
                     "--out", str(out), "--quiet"]) == 0
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
    from trace_replay.serve import FORCING_PROCESSOR

    assert main(["serve", "--port", "8123", "--dry-run", "--", "--max-model-len", "512"]) == 0
    command = capsys.readouterr().out.splitlines()[0].split()
    assert command[command.index("--logits-processors") + 1] == FORCING_PROCESSOR
    assert command[command.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert command[command.index("--port") + 1] == "8123"
    assert command[-2:] == ["--max-model-len", "512"]


def test_serve_help_shows_the_command():
    """serve --help shows the vllm serve command it runs, with every option it adds."""
    from trace_replay.serve import serve_args

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
    log.write_text(json.dumps({
        "request": {"prompt": "The capital of France is", "max_tokens": 2, "logprobs": 1},
        "response": {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [{
            "index": 0, "text": " Paris.", "finish_reason": "length",
            "logprobs": {"tokens": ["token_id:7042", "token_id:30"],
                         "token_logprobs": [-0.25, -1.5],
                         "top_logprobs": [{"token_id:7042": -0.25}, {"token_id:30": -1.5}]}}]},
    }) + "\n")
    out = tmp_path / "log.parquet"
    assert main(["replay", str(log), "--format", "openai", "--engine", "prefill",
                 "--out", str(out), "--quiet"]) == 0
    assert pd.read_parquet(out)["ref_logprob"].tolist() == [-0.25, -1.5]

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"id": "c", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}) + "\n")
    for turns, roles in (("last", {"assistant"}), ("all", {"assistant", "user", "template"})):
        out = tmp_path / f"chat-{turns}.parquet"
        assert main(["replay", str(chat), "--turns", turns, "--engine", "prefill",
                     "--out", str(out), "--quiet"]) == 0
        assert set(pd.read_parquet(out)["role"]) == roles
