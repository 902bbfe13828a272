"""Claims: each live run's traces in its own locked file; a dead run's claims are freed."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from trace_replay.runs.claims import Claims


@pytest.fixture
def runs(tmp_path):
    """``runs(n)``: n runs' Claims on ``tmp_path``, closed after the test.

    flock locks belong to an open file, not to a process, so two Claims of one process
    exclude each other as two processes' would.
    """
    opened = []

    def make(n: int) -> list[Claims]:
        opened.extend(Claims(tmp_path) for _ in range(n))
        return opened[-n:]

    yield make
    for claims in opened:
        claims.close()


def claim_file(claims: Claims):
    return claims.folder / f"{claims.owner}.claim"


def test_a_run_owns_one_claim_file(runs, tmp_path):
    """Opening claims makes ``claims/<owner>.claim``, empty; the owner names host and pid."""
    [mine] = runs(1)
    assert [p.name for p in (tmp_path / "claims").iterdir()] == [f"{mine.owner}.claim"]
    assert claim_file(mine).read_text() == ""
    assert f".{os.getpid()}." in mine.owner and mine.mine == frozenset()


def test_set_replaces_the_claims(runs):
    """set() writes the digests sorted, one a line, and replaces what was claimed before."""
    [mine] = runs(1)
    with mine.locked():
        mine.set(["d2", "d1", "d3"])
    assert claim_file(mine).read_text() == "d1\nd2\nd3\n"
    with mine.locked():
        mine.set(["d9"])
    assert claim_file(mine).read_text() == "d9\n" and mine.mine == {"d9"}


def test_others_sees_live_runs_but_not_itself(runs):
    """others() is the union of the other live runs' claims; a run's own are not in it."""
    a, b, c = runs(3)
    with a.locked():
        a.set(["x", "y"])
    with b.locked():
        b.set(["y", "z"])
    with c.locked():
        assert c.others() == {"x", "y", "z"}
    with a.locked():
        assert a.others() == {"y", "z"}


def test_closed_runs_free_their_claims(runs):
    """close() removes the run's file: its traces are free; closing twice is harmless."""
    a, b = runs(2)
    with a.locked():
        a.set(["x"])
    a.close()
    a.close()
    assert not claim_file(a).exists() and a.mine == frozenset()
    with b.locked():
        assert b.others() == set()


def test_unlocked_claim_files_are_removed(runs, tmp_path):
    """A claim file nobody holds a lock on (its run died) is deleted, its digests ignored."""
    [mine] = runs(1)
    orphan = tmp_path / "claims" / "elsewhere.1.deadbeef.claim"
    orphan.write_text("d1\nd2\n")
    with mine.locked():
        assert mine.others() == set()
    assert not orphan.exists() and claim_file(mine).exists()


def test_locked_excludes_other_runs(runs, tmp_path):
    """Inside locked() the folder lock is taken: no other open file can take it."""
    [mine] = runs(1)
    with open(tmp_path / ".lock") as other:
        with mine.locked():
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again once the block ends
        fcntl.flock(other, fcntl.LOCK_UN)


def test_dead_runs_claims_are_released(tmp_path):
    """Claims of a live run are seen by others; once it is killed (-9) they are freed."""
    script = (
        "import sys, time; from pathlib import Path; from trace_replay.runs.claims import Claims\n"
        "c = Claims(Path(sys.argv[1]))\n"
        "with c.locked(): c.set(['d1', 'd2'])\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        mine = Claims(tmp_path)
        with mine.locked():
            assert mine.others() == {"d1", "d2"}
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        with mine.locked():
            assert mine.others() == set()
        assert [p.name for p in (tmp_path / "claims").iterdir()] == [f"{mine.owner}.claim"]
        mine.close()
    finally:
        child.kill()
        child.wait()


def test_a_fifo_lock_or_a_file_named_claims_is_refused(tmp_path):
    """A FIFO named .lock (opening it to write would block forever) and a file named claims
    are refused naming them, before anything is opened."""
    lock = tmp_path / ".lock"
    os.mkfifo(lock)
    reader = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)  # so that old code could not block
    try:
        with pytest.raises(ValueError, match=r"\.lock is not a regular file"):
            Claims(tmp_path)
    finally:
        os.close(reader)
    lock.unlink()
    (tmp_path / "claims").write_text("")
    with pytest.raises(ValueError, match=r"claims is not a folder"):
        Claims(tmp_path)


def test_a_fifo_among_the_claims_is_no_claim(runs, tmp_path):
    """A FIFO named like a claim file is skipped (no run writes one): others() neither
    blocks on it nor fails, and other runs' claims are still read."""
    first, second = runs(2)
    os.mkfifo(tmp_path / "claims" / "elsewhere.1.abcdef12.claim")
    with first.locked():
        first.set({"d1"})
    with second.locked():
        assert second.others() == {"d1"}
