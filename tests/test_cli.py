"""The trace-replay command line: results on disk, one-line errors, exit codes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pandas as pd
import pytest

import trace_replay
from trace_replay.cli import _HelpFormatter, _parser, main

COMMANDS = ("replay", "record", "merge", "report", "demo")


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
