"""The trace-replay command line: results on disk, one-line errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from trace_replay.cli import main


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
