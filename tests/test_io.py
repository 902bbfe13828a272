"""Atomic writes: whole files or none, errors naming the target, crash leftovers cleaned."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from trace_replay._io import HOST, remove_stale_temporaries, write_atomic


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_failed_write_names_the_target_and_leaves_nothing(tmp_path):
    """A write failing with ENOSPC raises an OSError naming the target; no temporary stays."""
    target = tmp_path / "r.parquet"

    def full_disk(temporary):
        temporary.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="r.parquet.*No space left") as raised:
        write_atomic(target, full_disk)
    assert raised.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_dead_writers_temporaries_are_removed(tmp_path):
    """A temporary of a dead process on this host goes; a live one's and another host's stay."""
    dead = tmp_path / f".r.parquet.{HOST}.{_dead_pid()}.0123abcd.tmp"
    live = tmp_path / f".r.parquet.{HOST}.{os.getpid()}.0123abcd.tmp"
    remote = tmp_path / ".r.parquet.elsewhere-1.1.0123abcd.tmp"
    for path in (dead, live, remote):
        path.write_bytes(b"x")
    write_atomic(tmp_path / "r.parquet", lambda temporary: temporary.write_bytes(b"whole"))
    assert (tmp_path / "r.parquet").read_bytes() == b"whole"
    assert not dead.exists() and live.exists() and remote.exists()


def test_stale_temporaries_of_any_target(tmp_path):
    """remove_stale_temporaries without a target cleans every dead writer's file in a folder."""
    pid = _dead_pid()
    stale = [tmp_path / f".part-{i}.parquet.{HOST}.{pid}.0123abcd.tmp" for i in range(3)]
    for path in stale:
        path.write_bytes(b"x")
    other = tmp_path / "keep.tmp"
    other.write_bytes(b"x")
    assert sorted(remove_stale_temporaries(tmp_path)) == sorted(stale)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.tmp"]
