"""A real CLI replay killed with SIGKILL part-way, then rerun with its checkpoint.

Every trace ends up in the result exactly once. In deterministic mode the resumed result is
bitwise the uninterrupted one (run with another batch and chunk size); in default mode the
chunks of the two runs are batched differently, so they agree within ``DEFAULT_TOLERANCE``
(measured: up to 2.6e-5 nats between batch 8 and batch 1 on the embedded model).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.slow

DEFAULT_TOLERANCE = 2e-4  # nats, |Δ logprob| and |Δ entropy| between differently batched runs
TRACES = [
    {"id": f"t{i}", "prompt": prompt, "completion": completion}
    for i, (prompt, completion) in enumerate(
        [
            ("The capital of France is", " Paris."),
            ("1, 2, 3,", " 4, 5"),
            ("def add(a, b):", "\n    return"),
            ("Say hi.", " Hi!"),
            ("Once upon a", " time"),
            ("The sky is", " blue."),
        ]
    )
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trace_replay.cli", "replay", *args, "--quiet"]


def _env() -> dict:
    # the checkout under test first; one intra-op thread, as in the test process (conftest)
    root = str(Path(__file__).resolve().parents[2])
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }


def _kill_after_first_part(args: list[str], checkpoint: Path) -> None:
    """Start the CLI, SIGKILL it once a checkpoint part exists, wait for it to die."""
    proc = subprocess.Popen(
        _cli(*args), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while not list(checkpoint.glob("part-*.parquet")):
        if proc.poll() is not None:
            raise AssertionError(
                f"the replay ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no checkpoint part appeared")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("engine,deterministic", [("torch", True), ("prefill", False)])
def test_killed_replay_resumes_to_the_uninterrupted_result(tmp_path, engine, deterministic):
    """SIGKILL mid-run, rerun: all traces once; bitwise equal (deterministic) or within tol."""
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(t) + "\n" for t in TRACES))
    flags = ["--engine", engine] + (["--deterministic"] if deterministic else [])
    full, resumed, checkpoint = (
        tmp_path / "full.parquet",
        tmp_path / "resumed.parquet",
        tmp_path / "ckpt",
    )
    subprocess.run(
        _cli(str(traces), *flags, "--batch-size", "8", "--out", str(full)),
        env=_env(),
        check=True,
        capture_output=True,
    )
    interrupted = [
        str(traces),
        *flags,
        "--batch-size",
        "2",
        "--chunk-size",
        "1",
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(resumed),
    ]
    _kill_after_first_part(interrupted, checkpoint)
    assert not resumed.exists()
    done = pd.concat(pd.read_parquet(p) for p in checkpoint.glob("part-*.parquet"))
    assert 0 < done["trace_id"].nunique() < len(TRACES)
    subprocess.run(_cli(*interrupted), env=_env(), check=True, capture_output=True)

    a, b = pd.read_parquet(full), pd.read_parquet(resumed)
    assert not b.duplicated(["trace_id", "step"]).any()
    assert b["trace_id"].drop_duplicates().tolist() == [t["id"] for t in TRACES]
    assert b.attrs["resumed_traces"] > 0
    if deterministic:
        pd.testing.assert_frame_equal(b, a, check_exact=True)
    else:
        assert b["token_id"].tolist() == a["token_id"].tolist()
        np.testing.assert_allclose(b["logprob"], a["logprob"], atol=DEFAULT_TOLERANCE, rtol=0)
        np.testing.assert_allclose(b["entropy"], a["entropy"], atol=DEFAULT_TOLERANCE, rtol=0)
