"""Cluster runs on a local Ray cluster (runs/cluster_replay.py): the single-process result,
bit for bit, whatever is killed on the way.

One local cluster of two CPUs for the module, two actors of one CPU each, the embedded
model's built-in torch engine in deterministic mode, so that a trace's numbers are the same
bits in every batch, actor and process. "Recomputes no finished trace" is read off the
folder: each trace's digest is in exactly one part.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from trace_replay.runs.cluster import RayCluster
from trace_replay.runs.replay import replay

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'trace-replay[ray]')")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

WORDS = "red green blue cat dog sun moon tree".split()
TRACES = [
    {
        "id": f"t{i}",
        "prompt": f"List {i + 3} things:",
        "completion": "".join(f" {WORDS[(i + j) % 8]}," for j in range(5)),
    }
    for i in range(8)
]
ENGINE = {"engine": "torch", "device": "cpu", "deterministic": True, "batch_size": 2}
CLI_ENGINE = ["--engine", "torch", "--device", "cpu", "--deterministic", "--batch-size", "2"]
# a part per trace, so that kills land between parts with work still in flight
PARTS = {"chunk_size": 1, "checkpoint_every": 0}


@pytest.fixture(scope="module")
def cluster(local_ray):
    """A local cluster of 2 CPUs for the module; runs use it and leave it connected."""
    with local_ray(num_cpus=2):
        yield RayCluster(actors=2)


@pytest.fixture(scope="module")
def single():
    """The single-process run every cluster run must equal bit for bit."""
    return replay(TRACES, **ENGINE, progress=False)


def _digests_per_part(folder: Path) -> pd.Series:
    """How many parts hold each trace's rows."""
    parts = [
        pd.read_parquet(p, columns=["trace_digest"]).drop_duplicates()
        for p in folder.glob("part-*.parquet")
    ]
    return pd.concat(parts)["trace_digest"].value_counts()


def test_a_cluster_run_is_the_single_process_run(
    cluster, single, tmp_path, assert_frames_bitwise_equal
):
    """Two actors resume a folder a single-process run began: the frame is bitwise the
    single-process one, its attrs the same but for times, counters and ``cluster``; each
    trace is in one part; the cluster this process joined stays joined."""
    folder = tmp_path / "ckpt"
    replay(TRACES[:3], **ENGINE, progress=False, checkpoint=folder)
    df = replay(TRACES, **ENGINE, progress=False, checkpoint=folder, cluster=cluster)
    assert_frames_bitwise_equal(df, single)
    assert df.attrs["resumed_traces"] == 3
    own = {"started_at", "finished_at", "forwards", "resumed_traces", "cluster"}
    assert {k: v for k, v in df.attrs.items() if k not in own} == {
        k: v for k, v in single.attrs.items() if k not in own
    }
    assert df.attrs["cluster"]["actors"] == 2 and df.attrs["cluster"]["num_gpus"] == 0
    assert (_digests_per_part(folder) == 1).all() and len(_digests_per_part(folder)) == 8
    assert ray.is_initialized()


def test_a_folder_of_other_settings_is_refused(cluster, tmp_path):
    """A folder written with other engine settings is refused as a single-process run
    refuses it, before any actor starts."""
    folder = tmp_path / "ckpt"
    replay(TRACES[:1], engine="prefill", device="cpu", top_k=3, progress=False, checkpoint=folder)
    with pytest.raises(ValueError, match=r"written with other settings \(top_k\)"):
        replay(
            TRACES,
            engine="prefill",
            device="cpu",
            progress=False,
            checkpoint=folder,
            cluster=cluster,
        )
    assert len(list(folder.glob("part-*.parquet"))) == 1


def _actor_pids() -> list[int]:
    """The processes of live ReplayActor actors on this machine."""
    return [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if " ".join(p.info["cmdline"] or []).startswith("ray::ReplayActor")
    ]


def _kill_an_actor_after_the_first_part(folder: Path, killed: dict) -> None:
    deadline = time.monotonic() + 600
    while not list(folder.glob("part-*.parquet")) or not _actor_pids():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    killed["parts_then"] = len(list(folder.glob("part-*.parquet")))
    killed["pid"] = _actor_pids()[0]
    os.kill(killed["pid"], signal.SIGKILL)


def test_a_killed_actor_loses_nothing(cluster, single, tmp_path, assert_frames_bitwise_equal):
    """SIGKILL an actor once a part is written: Ray restarts it, its batch runs again, and
    the result is still bitwise the single-process one, each trace computed once."""
    folder, killed = tmp_path / "ckpt", {}
    killer = threading.Thread(
        target=_kill_an_actor_after_the_first_part, args=(folder, killed), daemon=True
    )
    killer.start()
    df = replay(TRACES, **ENGINE, **PARTS, progress=False, checkpoint=folder, cluster=cluster)
    killer.join()
    assert killed and killed["parts_then"] < len(TRACES), "the run ended before the kill"
    assert not psutil.pid_exists(killed["pid"])
    assert_frames_bitwise_equal(df, single)
    assert (_digests_per_part(folder) == 1).all() and len(_digests_per_part(folder)) == 8


def test_a_killed_driver_resumes(cluster, single, tmp_path, assert_frames_bitwise_equal):
    """SIGKILL a CLI driver (``--ray auto``) once a part is written; a rerun resumes its
    parts and gives the single-process result, each trace computed once."""
    traces, folder = tmp_path / "traces.jsonl", tmp_path / "ckpt"
    traces.write_text("".join(json.dumps(t) + "\n" for t in TRACES))
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trace_replay.cli",
            "replay",
            str(traces),
            *CLI_ENGINE,
            "--chunk-size",
            "1",
            "--checkpoint-every",
            "0",
            "--checkpoint",
            str(folder),
            "--ray",
            "auto",
            "--out",
            str(tmp_path / "out.parquet"),
            "--quiet",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 600
    while not list(folder.glob("part-*.parquet")):
        assert driver.poll() is None, driver.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no part appeared"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert 0 < len(_digests_per_part(folder)) < len(TRACES)
    while ray.available_resources().get("CPU", 0) < 2:  # the dead driver's actors go
        assert time.monotonic() < deadline, "the killed driver's actors stayed"
        time.sleep(0.2)
    df = replay(TRACES, **ENGINE, **PARTS, progress=False, checkpoint=folder, cluster=cluster)
    assert df.attrs["resumed_traces"] > 0
    assert_frames_bitwise_equal(df, single)
    assert (_digests_per_part(folder) == 1).all() and len(_digests_per_part(folder)) == 8


def test_without_a_folder_the_parts_go_to_a_temporary_one_removed_after(tmp_path, monkeypatch):
    """A run given no checkpoint writes its parts to a new temporary folder, and removes
    it afterwards, failed or not."""
    import tempfile

    from trace_replay.runs.cluster_replay import _folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="stopped"):
        with _folder(None) as folder:
            assert folder.parent == tmp_path and folder.is_dir()
            (folder / "part").write_text("")
            raise RuntimeError("stopped")
    assert not list(tmp_path.iterdir())
    with _folder(tmp_path / "mine") as folder:
        assert folder == tmp_path / "mine"
