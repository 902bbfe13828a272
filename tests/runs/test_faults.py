"""Fault injection on checkpointed runs: kill -9 anywhere, flipped bits, two runs on a folder.

Whatever happens, the final result holds every trace exactly once, with correct numbers, and
nothing stale or damaged is served. Runs use batch size 1 and a part per trace
(``checkpoint_every=0``) so that kills land between, inside and during part writes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pandas as pd
import pytest

from trace_replay.engines import make_engine
from trace_replay.runs.replay import replay

pytestmark = pytest.mark.slow

TOL = 1e-4  # the same computation in two processes; a wrong trace is off by far more
TRACES = [
    {
        "id": f"t{i:02d}",
        "prompt": f"Item {i}:",
        "completion": " "
        + " ".join(["red", "green", "blue", "cat", "dog"][j % 5] for j in range(i % 7 + 2)),
    }
    for i in range(32)
]
DRIVER = """
import sys
from trace_replay.runs.replay import replay
traces, checkpoint, out = sys.argv[1:]
replay(traces, engine="prefill", device="cpu", batch_size=1, top_k=3, checkpoint=checkpoint,
       checkpoint_every=0, progress=False).to_parquet(out)
"""


@pytest.fixture(scope="module")
def engine(lm):
    """The settings the driver's engine has, so both share a checkpoint folder."""
    return make_engine("prefill", lm, batch_size=1, top_k=3)


@pytest.fixture(scope="module")
def expected(engine):
    return replay(TRACES, engine=engine, progress=False)


@pytest.fixture
def files(tmp_path):
    traces = tmp_path / "traces.jsonl"
    pd.DataFrame(TRACES).to_json(traces, orient="records", lines=True)
    return traces, tmp_path / "ckpt"


def _start(traces, checkpoint, out):
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(traces), str(checkpoint), str(out)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _wait_for_parts(child, checkpoint, count):
    deadline = time.monotonic() + 300
    while len(list(checkpoint.glob("part-*.parquet"))) < count and child.poll() is None:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)
    assert child.poll() in (None, 0), child.stderr.read()


def _assert_complete_and_correct(got, expected):
    """Every trace exactly once, its tokens, and its scores within TOL."""
    assert not got.duplicated(["trace_id", "step"]).any()
    assert got["trace_id"].tolist() == expected["trace_id"].tolist()
    assert got["token_id"].tolist() == expected["token_id"].tolist()
    np.testing.assert_allclose(got["logprob"], expected["logprob"], atol=TOL, rtol=0)
    assert (got["rank"] == expected["rank"]).mean() > 0.99  # near-ties may swap


def _parts(checkpoint):
    return pd.concat(pd.read_parquet(p) for p in checkpoint.glob("part-*.parquet"))


def test_kill_9_at_random_points_then_a_flipped_bit(engine, expected, files, tmp_path):
    """Three runs killed (-9) at seeded random points, then a bit flipped in a part: the
    resumed run recomputes exactly what is missing or damaged."""
    traces, checkpoint = files
    for seed in range(3):
        rng = random.Random(seed)
        before = len(list(checkpoint.glob("part-*.parquet")))
        child = _start(traces, checkpoint, tmp_path / "unused.parquet")
        _wait_for_parts(child, checkpoint, before + rng.randint(1, 4))
        time.sleep(rng.uniform(0, 0.05))
        child.kill()
        child.wait()
    parts = sorted(checkpoint.glob("part-*.parquet"))
    assert 3 <= len(parts) < len(TRACES)
    rng = random.Random(3)
    damaged = rng.choice(parts)
    data = bytearray(damaged.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    damaged.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = replay(
            traces, engine=engine, progress=False, checkpoint=checkpoint, checkpoint_every=0
        )
    assert any("corrupt" in str(w.message) for w in caught)
    _assert_complete_and_correct(got, expected)
    assert got.attrs["resumed_traces"] == len(parts) - 1  # one trace a part, one part lost
    assert not list(checkpoint.glob(".*.tmp"))  # the killed runs' temporaries are gone
    survivors = _parts(checkpoint)
    assert not survivors.duplicated(["trace_id", "step"]).any()


def test_two_runs_on_one_folder_split_the_work(engine, expected, files, tmp_path):
    """A second run on a folder in use computes only unclaimed traces; both end complete."""
    traces, checkpoint = files
    child = _start(traces, checkpoint, tmp_path / "child.parquet")
    _wait_for_parts(child, checkpoint, 1)
    ours = replay(traces, engine=engine, progress=False, checkpoint=checkpoint, checkpoint_every=0)
    assert child.wait() == 0, child.stderr.read()
    _assert_complete_and_correct(ours, expected)
    _assert_complete_and_correct(pd.read_parquet(tmp_path / "child.parquet"), expected)
    written = _parts(checkpoint)
    assert not written.duplicated(["trace_id", "step"]).any()  # no trace computed twice
    assert written["trace_id"].nunique() == len(TRACES)


def test_a_killed_runs_claims_are_taken_over(engine, expected, files):
    """A run killed (-9) while holding claims: the other run computes its traces and ends
    complete, with no trace computed twice."""
    traces, checkpoint = files
    child = _start(traces, checkpoint, checkpoint.parent / "child.parquet")
    _wait_for_parts(child, checkpoint, 1)
    rng = random.Random(4)
    parts, pause = rng.randint(3, 6), rng.uniform(0, 0.05)

    def kill_later():  # while this process replays too
        _wait_for_parts(child, checkpoint, parts)
        time.sleep(pause)
        child.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_later)
    killer.start()
    try:
        ours = replay(
            traces, engine=engine, progress=False, checkpoint=checkpoint, checkpoint_every=0
        )
    finally:
        killer.join()
        child.wait()
    assert child.returncode == -signal.SIGKILL  # it died before finishing
    _assert_complete_and_correct(ours, expected)
    assert not _parts(checkpoint).duplicated(["trace_id", "step"]).any()
