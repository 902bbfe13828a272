"""Cluster runs as Ray users run them (docs/cluster.md): a head started with ``ray start``,
the CLI submitted to it with ``ray job submit ... -- trace-replay replay ... --ray auto``.
(Ray Client, ``--ray ray://HOST:PORT``, is refused before Ray is touched: tests/runs/
test_cluster.py.)

The module starts its own head: a temporary folder, free ports (dashboard on 127.0.0.1;
Ray itself binds the node's own address, it maps 127.0.0.1 to it), token authentication
with a token of its own in the environment (so neither ~/.ray/auth_token nor a cluster of
anyone else's is touched), and stops exactly that head's process group afterwards (never
``ray stop``, which stops every Ray on the machine). Each run must give the single-process
frame bit for bit (deterministic torch engine, one thread per actor as in this process).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from trace_replay.runs.replay import replay

pytest.importorskip("ray.dashboard", reason="the [ray] extra (ray[default]) is not installed")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

WORDS = "red green blue cat dog sun moon tree".split()
TRACES = [
    {
        "id": f"t{i}",
        "prompt": f"List {i + 3} things:",
        "completion": "".join(f" {WORDS[(i + j) % 8]}," for j in range(4)),
    }
    for i in range(4)
]
ENGINE = {"engine": "torch", "device": "cpu", "deterministic": True, "batch_size": 2}
CLI_ENGINE = [
    "--engine",
    "torch",
    "--device",
    "cpu",
    "--deterministic",
    "--batch-size",
    "2",
    "--actors",
    "2",
    "--chunk-size",
    "1",
]
BIN = Path(sys.executable).parent
# a line Ray's C++ core logs at level E or F ("[2026-12-07 14:50:43,905 E 123 123] ...")
RAY_ERROR_LINE = re.compile(r"^\[[\d\- :,]+ [EF] \d+ \d+\]", re.MULTILINE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(group: int, folder: str) -> None:
    """End the head's process group, then any process still naming its folder."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    for proc in psutil.process_iter(["cmdline"]):
        if folder in " ".join(proc.info["cmdline"] or []):
            proc.kill()


def _start_head(env: dict) -> tuple[subprocess.Popen, str, dict] | None:
    """``ray start --head --block`` in a new folder on free ports, waited for until its job
    server answers; None when Ray gave up on its own start-up (its raylet waits a fixed
    ~15 s for the dashboard agent, which a heavily loaded machine can miss)."""
    folder = tempfile.mkdtemp(prefix="trh-")  # short: Ray's socket paths live in it
    # every port free (the Ray Client server's too: `ray start --head` starts it)
    ports = {
        name: _free_port()
        for name in (
            "port",
            "dashboard-port",
            "ray-client-server-port",
            "node-manager-port",
            "object-manager-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        )
    }
    workers = _free_port()
    command = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--num-cpus=2",
        "--num-gpus=0",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--temp-dir={folder}",
        f"--min-worker-port={workers}",
        f"--max-worker-port={workers + 50}",
        *(f"--{name}={port}" for name, port in ports.items()),
    ]
    log = Path(folder) / "ray-start.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    written = Path(folder) / "ray_current_cluster"  # `ray start`'s last step
    deadline = time.monotonic() + 240
    while (
        not written.is_file()
        or subprocess.run(
            [str(BIN / "ray"), "job", "list", "--address", dashboard], env=env, capture_output=True
        ).returncode
        != 0
    ):
        if process.poll() is not None:
            _stop(process.pid, folder)
            text = log.read_text()
            shutil.rmtree(folder, ignore_errors=True)
            assert "timed out during startup" in text, text[-3000:]
            return None
        assert time.monotonic() < deadline, "the head's job server did not answer"
        time.sleep(1)
    return process, folder, {"dashboard": dashboard}


@pytest.fixture(scope="module")
def head():
    """A Ray head of this module's own, with dashboard and job server: its environment
    (the token) and addresses. A start-up Ray itself gave up on is tried again, twice."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    env.pop("RAY_ADDRESS", None)
    started = None
    for _ in range(3):
        if (started := _start_head(env)) is not None:
            break
    assert started is not None, "ray start timed out three times"
    process, folder, addresses = started
    try:
        yield {"env": env, **addresses}
    finally:
        _stop(process.pid, folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def single():
    """The single-process run every cluster run must equal bit for bit."""
    return replay(TRACES, **ENGINE, progress=False)


@pytest.fixture
def traces(tmp_path) -> Path:
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in TRACES))
    return path


def _actors(head) -> list[dict]:
    """Every actor the head knows of, dead ones included (Ray's state API, as JSON; Ray may
    print a note before it)."""
    out = subprocess.run(
        [
            str(BIN / "ray"),
            "list",
            "actors",
            "--address",
            head["dashboard"],
            "--format",
            "json",
            "--limit",
            "1000",
        ],
        env=head["env"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout[out.stdout.index("[") :])


def test_a_submitted_job_is_the_single_process_run(
    head, single, traces, tmp_path, assert_frames_bitwise_equal
):
    """``ray job submit -- trace-replay replay ... --ray auto`` on the head: the job
    succeeds, its frame is bitwise the single-process one, its log shows the start-up
    phases and no E-level Ray line, and no actor is left alive on the head after it."""
    out = tmp_path / "out.parquet"
    job = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            head["dashboard"],
            "--",
            "trace-replay",
            "replay",
            str(traces),
            *CLI_ENGINE,
            "--ray",
            "auto",
            "--out",
            str(out),
        ],
        env=head["env"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-4000:]
    assert "succeeded" in log
    assert_frames_bitwise_equal(pd.read_parquet(out), single)
    for phase in (
        "connecting to Ray",
        "loading the engine once on the cluster",
        "actors' engines loaded",
    ):
        assert phase in log, phase
    assert not RAY_ERROR_LINE.search(log), RAY_ERROR_LINE.search(log).group(0)
    assert "constructor arguments in the object store" not in log
    assert sum(a.get("class_name") == "ReplayActor" for a in _actors(head)) == 2
    deadline = time.monotonic() + 60
    while alive := [a for a in _actors(head) if a.get("state") == "ALIVE"]:
        assert time.monotonic() < deadline, [a.get("class_name") for a in alive]
        time.sleep(1)  # the job's supervisor may take a moment to go
