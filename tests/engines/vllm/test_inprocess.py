"""vLLM in the caller's process: an unguarded script runs once, quietly, and leaves torch
as it found it. Each test starts vLLM once, in a fresh interpreter running a script."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[cpu]')")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# a README-style script: no `if __name__ == "__main__":` guard
UNGUARDED = textwrap.dedent("""
    import sys
    import torch
    import trace_replay as tr

    threads = torch.get_num_threads()
    df = tr.replay([{"id": "t", "prompt": "The capital of France is", "completion": " Paris."}],
                   engine=sys.argv[1], verbose=sys.argv[2] == "verbose", progress=False,
                   engine_args={"max_model_len": 512})
    print("RESULT", df.attrs["engine"], df.attrs["engine_core"], len(df))
    print("HOST", torch.get_num_threads() == threads, torch.set_num_threads.__module__)
""")


def _run_script(tmp_path, engine: str, verbose: str) -> subprocess.CompletedProcess:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    return subprocess.run(
        [sys.executable, str(script), engine, verbose],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )


def test_vllm_runs_an_unguarded_script_once_and_quietly(tmp_path):
    """engine="vllm": the script's output appears exactly once (no spawned process re-runs
    it); start-up prints none of vLLM's platform notes; torch's thread setting and
    set_num_threads function are the caller's again afterwards."""
    out = _run_script(tmp_path, "vllm", "quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("RESULT") == 1, out.stdout
    assert "RESULT vllm in-process 2" in out.stdout
    assert "HOST True torch" in out.stdout
    for noise in ("Triton", "LD_PRELOAD", "NUMA", "Loading safetensors", "EngineCore"):
        assert noise not in out.stderr, (noise, out.stderr[-3000:])
    # what start-up is doing is said, once, in the package's own words
    assert out.stderr.count("trace_replay: starting vLLM") == 1, out.stderr[-3000:]
    assert "trace_replay: vLLM ready in" in out.stderr


def test_auto_runs_an_unguarded_script_once_and_verbose_shows_vllm_logs(tmp_path):
    """engine="auto" picks vLLM without re-running the script; verbose shows vLLM's logs."""
    out = _run_script(tmp_path, "auto", "verbose")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("RESULT") == 1, out.stdout
    assert "RESULT vllm in-process 2" in out.stdout
    assert "falls back" not in out.stderr
    logs = out.stdout + out.stderr  # vLLM's handler writes to stdout by default
    assert "INFO" in logs and "Loading safetensors" in logs
