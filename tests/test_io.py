"""Atomic writes: whole files or none, errors naming the target, crash leftovers cleaned."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from trace_replay._io import HOST, remove_stale_temporaries, write_atomic, write_target


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


def test_write_atomic_refuses_a_fifo_and_leaves_it(tmp_path):
    """A FIFO (like a device or a folder) is never renamed over: the write is refused with
    an error naming the path and what it is, and the FIFO stays a FIFO."""
    fifo = tmp_path / "r.parquet"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"r.parquet is a FIFO, not a regular file"):
        write_atomic(fifo, lambda temporary: temporary.write_bytes(b"whole"))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["r.parquet"]


def test_write_target_names_devices_and_folders():
    """/dev/null is a character device and / a folder: both refused, neither touched."""
    with pytest.raises(ValueError, match="/dev/null is a character device"):
        write_target("/dev/null")
    with pytest.raises(ValueError, match="is a folder"):
        write_target("/")


def test_write_atomic_writes_through_a_symlink(tmp_path):
    """A write to a symlink replaces its target's content; the link itself stays a link."""
    target = tmp_path / "target.parquet"
    target.write_bytes(b"old")
    link = tmp_path / "link.parquet"
    link.symlink_to(target.name)
    write_atomic(link, lambda temporary: temporary.write_bytes(b"new"))
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_bytes() == b"new"


def test_write_target_refuses_an_input_however_spelled(tmp_path, monkeypatch):
    """The output may not be an input file, whether named relatively, with ./, through a
    symlink, by an absolute path with .. in it, or by a hard link."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "t.jsonl"
    source.write_text("{}\n")
    (tmp_path / "link.jsonl").symlink_to("t.jsonl")
    os.link(source, tmp_path / "hard.jsonl")
    for out in (
        "t.jsonl",
        "./t.jsonl",
        "link.jsonl",
        f"{tmp_path}/../{tmp_path.name}/t.jsonl",
        "hard.jsonl",
    ):
        with pytest.raises(ValueError, match="is the input file"):
            write_target(out, ["t.jsonl"])
    assert write_target("other.jsonl", ["t.jsonl"]) == tmp_path / "other.jsonl"
    assert source.read_text() == "{}\n"


def test_a_path_ending_with_a_slash_is_refused(tmp_path):
    """'new/' names a folder: writing a file of that name (the slash dropped) is refused,
    naming the path, and nothing is created."""
    with pytest.raises(ValueError, match=r"new/ ends with /, so it names a folder"):
        write_atomic(f"{tmp_path}/new/", lambda temporary: temporary.write_bytes(b"whole"))
    assert os.listdir(tmp_path) == []
